"""Worker: LoRA under tp=2 + SP, pp=2, ZeRO-1 dp=2 and cp=2 against peft on one process, in one world of 2 ranks.

``lora_parity.py OUT.json [--float64] [ARCH ...]``. For each architecture and layout, a tiny model gets LoRA (both A and B
random: ``init_lora_weights=False``, so that A's gradient is not zero at the first step) from plait, and the
same adapter values are copied into peft's ``LoraModel`` on a copy of the base, which trains on the whole
global batch in this process. STEPS AdamW steps; per step the global loss and every LoRA gradient slice a rank
holds (the owner's, under ZeRO-1) are compared; afterwards the base weights must be bit-unchanged. At pp=1 the
adapter is also exported: as a peft directory loaded by ``PeftModel.from_pretrained`` on the unmodified base,
and merged into the base (``from_pretrained``), both must give the parallel model's logits. Rank 0 writes
the worst numbers per case, and what failed, for tests/test_lora.py. SFT + LoRA: packed, prompt-masked
blocks (plait.data.sft_blocks) at tp=2 + SP and pp=2. ``--float64`` runs every model in float64: the recheck
that tells fp32 rounding (shrinks ~1e8-fold) from a real difference (stays); it checks the parity cases only
(no exports, no dropout masks: the fp32 world's checks, which rounding does not touch).
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, GPTBigCodeConfig, LlamaConfig, Phi3Config, Qwen3Config

from plait import ParallelConfig, parallelize
from plait.base import comm
from plait.checkpoint.lora_export import gather_lora, save_adapter, save_merged
from plait.data.sft_blocks import Example, batch_inputs, count_labels, lay_out
from plait.lora.config import lora_config
from plait.optim import OptimizerStep, build_optimizer

STEPS, BATCH, SEQ, VOCAB, LR = 3, 4, 16, 61, 1e-2
LAYOUTS = {"tp2_sp": dict(tp=2, sp=True), "tp2": dict(tp=2, sp=False), "pp2": dict(pp=2, num_microbatches=2),
           "zero1_dp2": dict(zero_1=True), "cp2": dict(cp=2)}
FUSED_ONLY = ("phi3", "gpt_bigcode")  # architectures checked for their fused projections' split only
FUSED_LAYOUTS = {name: LAYOUTS[name] for name in ("tp2_sp", "tp2")}
SFT_LAYOUTS = ("tp2_sp", "pp2", "cp2")  # SFT + LoRA: packed examples, prompt tokens masked, restarting position ids


def sft_blocks():
    """Packed SFT blocks of skewed lengths whose first half (the prompt) carries no label."""
    rng = np.random.default_rng(7)
    examples = []
    for i in range(40):
        n = int(rng.choice([3, 4, 6, 9, 13, 20]))
        examples.append(Example(rng.integers(3, VOCAB, n), np.arange(n) >= n // 2, f"example {i}"))
    return lay_out(examples, SEQ, 0, True, "truncate")


def batches(sft: bool):
    """(ids, labels, position ids or None, labelled tokens of the global batch) for every step."""
    if sft:
        blocks = sft_blocks()
        for step in range(STEPS):
            rows = torch.arange(step * BATCH, (step + 1) * BATCH)
            ids, labels, positions = batch_inputs(blocks, rows, torch.device("cpu"))
            yield ids, labels, positions, count_labels(blocks, rows)
        return
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        yield ids, ids.clone(), None, BATCH * (SEQ - 1)


def reference_loss(model, ids, labels, positions, num_items: int) -> torch.Tensor:
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                            reduction="sum")
    return total / num_items


def base_model(arch: str) -> torch.nn.Module:
    if arch == "llama":  # 2 kv heads: at tp=2 each rank holds one
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    elif arch == "gpt2":  # Conv1D, fused c_attn, tied embeddings
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    elif arch == "qwen3":  # the generic adapter; per-head q/k norms; 1 kv head replicated over tp=2
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=SEQ)
    elif arch == "phi3":  # the generic adapter; fused qkv_proj (per head) and gate_up_proj (gate | up)
        config = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                            pad_token_id=0, bos_token_id=0, eos_token_id=0)
    elif arch == "gpt_bigcode":  # multi-query c_attn: q heads | one k | one v head, the kv rows shared over tp=2
        config = GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, multi_query=True,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def plait_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".")


def run_case(arch: str, layout: dict, out_dir: Path, sft: bool = False) -> dict:
    base = base_model(arch)
    pmodel = parallelize(copy.deepcopy(base), ParallelConfig(**layout),
                         lora=lora_config(4, 8, init_lora_weights=False), lora_seed=7)
    mesh, config = pmodel.mesh, pmodel.plan.lora.config
    start = gather_lora(pmodel)
    reference = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    ref_params = {plait_name(n): p for n, p in reference.named_parameters() if p.requires_grad}
    result = {"failures": [], "loss_rel": 0.0, "grad_err": 0.0, "lora_names": sorted(ref_params),
              "checked_by_step": [[] for _ in range(STEPS)], "grad_err_by_step": [0.0] * STEPS,
              "elem_err_by_step": [0.0] * STEPS}
    if set(ref_params) != set(start):
        result["failures"].append(f"peft adapts {sorted(set(ref_params) ^ set(start))} differently")
        return result
    with torch.no_grad():
        for name, param in ref_params.items():
            param.copy_(start[name])
    ref_opt = torch.optim.AdamW(ref_params.values(), lr=LR)
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=LR)
    step_fn = OptimizerStep(pmodel.grad_sync, optimizer)
    owned = {id(p) for p in getattr(optimizer, "owned_params", pmodel.parameters())}
    named = [(n, p) for n, p in pmodel.module.named_parameters() if id(p) in owned]
    inner_optimizer = getattr(optimizer, "optim", optimizer)  # ZeRO-1 wraps the optimizer of its own slice
    stepped = [p for group in inner_optimizer.param_groups for p in group["params"]]
    result["frozen_stepped"] = sum(not p.requires_grad for p in stepped)
    for step, (ids, labels, positions, num_items) in enumerate(batches(sft)):
        ref_loss = reference_loss(reference, ids, labels, positions, num_items)
        ref_loss.backward()
        mine = slice(mesh.dp_rank * BATCH // mesh.dp, (mesh.dp_rank + 1) * BATCH // mesh.dp)
        loss = pmodel.train_step(ids[mine], labels[mine], num_items_in_batch=num_items,
                                 position_ids=None if positions is None else positions[mine])
        loss = comm.all_reduce(loss.detach().clone(), mesh.replica_group).item()  # dp rows, cp tokens
        result["loss_rel"] = max(result["loss_rel"], abs(loss - ref_loss.item()) / abs(ref_loss.item()))
        seen = {}
        inner = optimizer.step
        optimizer.step = lambda *a, **k: (seen.update({n: p.grad.clone() for n, p in named if p.grad is not None}),
                                          inner(*a, **k))[1]
        step_fn()
        del optimizer.step
        for name, param in named:
            if not param.requires_grad:
                continue
            if name not in seen:
                result["failures"].append(f"step {step}: {name} has no gradient")
                continue
            expected = pmodel.param_specs[name].slice_full(ref_params[name].grad)
            # scale of the tensor, not of each element: AdamW's first steps divide by sqrt(v), so fp32 rounding in
            # a summation order moves later gradients by up to ~5e-5 of the tensor's largest (GPT2, step 3, at
            # pp=2 as at tp=2), element by element far more where an entry is near zero
            err = ((seen[name] - expected).abs().max() / (1e-6 + 1e-4 * expected.abs().max())).item()
            result["grad_err_by_step"][step] = max(result["grad_err_by_step"][step], err)
            # element by element at the conformance kit's tolerance (1e-6 + 1e-5 |g|): what float64 must meet
            elem = ((seen[name] - expected).abs() / (1e-6 + 1e-5 * expected.abs())).max().item()
            result["elem_err_by_step"][step] = max(result["elem_err_by_step"][step], elem)
            if err > result["grad_err"]:
                result["grad_err"], result["grad_worst"] = err, f"step {step} {name}: max |d| " \
                    f"{(seen[name] - expected).abs().max().item():.2e}, max |g| {expected.abs().max().item():.2e}"
            result["checked_by_step"][step].append(name)
        ref_opt.step()
        ref_opt.zero_grad()
    result["state_numel"] = sum(v.numel() for st in inner_optimizer.state.values() for v in st.values()
                                if torch.is_tensor(v) and v.dim() > 0)
    result["trained_numel"] = sum(p.numel() for p in stepped)
    changed = [n for n, p in pmodel.module.named_parameters() if not p.requires_grad and not torch.equal(
        p.detach(), pmodel.param_specs[n].slice_full(base.get_parameter(n).detach()))]
    result["base_changed"] = changed
    result["frozen_grads"] = [n for n, p in pmodel.module.named_parameters() if not p.requires_grad and p.grad is not None]
    if mesh.pp == 1 and mesh.cp == 1 and not sft and torch.get_default_dtype() == torch.float32:
        _check_export(pmodel, reference, base, config, out_dir, result)
    return result


def _check_export(pmodel, reference, base, config, out_dir: Path, result: dict) -> None:
    """Logits of the parallel model vs peft's reference, the exported adapter on the base, and the merged model."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = pmodel.gather_logits(pmodel(ids))
        tensors = gather_lora(pmodel)
        if pmodel.mesh.rank == 0:
            save_adapter(out_dir / "adapter", tensors, config, base)
            save_merged(out_dir / "merged", copy.deepcopy(base), tensors, config)
        dist.barrier()
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(out_dir / "adapter"))
        merged = AutoModelForCausalLM.from_pretrained(str(out_dir / "merged"))
        for key, model in (("reference", reference), ("peft_dir", loaded), ("merged", merged)):
            result[f"logits_{key}"] = (model(input_ids=ids).logits - logits).abs().max().item()
    keys = json.loads((out_dir / "adapter" / "adapter_config.json").read_text())
    result["adapter_target_modules"] = sorted(keys["target_modules"])


def dropout_case(layout: dict) -> dict:
    """LoRA dropout (0.1) on llama at tp=2: each column-parallel LoRA input gets one mask on both tp ranks (it
    is replicated), each row-parallel one a mask per rank (its own features); recomputation under activation
    checkpointing redraws the same masks (equal gradients)."""
    from plait.lora.layers import LoraDropout

    grads, result = {}, {}
    for checkpointing in (False, True):
        pmodel = parallelize(base_model("llama"), ParallelConfig(**layout, gradient_checkpointing=checkpointing),
                             lora=lora_config(4, 8, 0.1, init_lora_weights=False), lora_seed=7)
        masks = []
        for name, module in pmodel.module.named_modules():
            if isinstance(module, LoraDropout):
                module.register_forward_hook(
                    lambda m, args, out, name=name: masks.append((name, m.replicated, (out == 0) & (args[0] != 0))))
        torch.manual_seed(11)
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
        pmodel.train_step(ids, ids.clone())
        grads[checkpointing] = {n: p.grad.clone() for n, p in pmodel.module.named_parameters() if p.requires_grad}
        if not checkpointing:
            other = comm.all_gather_object([(n, r, m) for n, r, m in masks], pmodel.mesh.tp_group)[1 - pmodel.mesh.tp_rank]
            result["calls"] = len(masks)
            result["dropped"] = min(int(m.sum()) for _, _, m in masks)
            result["replicated_equal"] = all(torch.equal(m, o) for (_, r, m), (_, _, o) in zip(masks, other) if r)
            result["row_differ"] = all(not torch.equal(m, o) for (_, r, m), (_, _, o) in zip(masks, other) if not r)
            result["row_calls"] = sum(not r for _, r, _ in masks)
    result["recompute_equal"] = all(torch.equal(grads[False][n], grads[True][n]) for n in grads[False])
    return result


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    if "--float64" in args:
        args.remove("--float64")
        torch.set_default_dtype(torch.float64)
    archs = args or ["llama", "gpt2", "qwen3"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        shared = comm.all_gather_object(tmp, comm.world_group())[0]  # one folder all ranks read
        for arch in archs:
            layouts = FUSED_LAYOUTS if arch in FUSED_ONLY else LAYOUTS
            for name, layout in layouts.items():
                case = Path(shared) / f"{arch}-{name}"
                results[f"{arch}/{name}"] = run_case(arch, layout, case)
            for name in SFT_LAYOUTS if arch not in FUSED_ONLY else ():
                results[f"{arch}/sft_{name}"] = run_case(arch, LAYOUTS[name], Path(shared), sft=True)
        for name in ("tp2_sp", "tp2") if torch.get_default_dtype() == torch.float32 else ():
            results[f"dropout/{name}"] = dropout_case(LAYOUTS[name])
        dist.barrier()
    by_rank = comm.all_gather_object(results, comm.world_group())  # every rank's record: every stage, every owner
    if dist.get_rank() == 0:
        out.write_text(json.dumps({case: [r[case] for r in by_rank] for case in results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
