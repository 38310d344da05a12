"""Worker: LoRA on mixtral's routed experts (peft's ``target_parameters``) and on q/v under tp=2 (+SP), ep=2 (+ZeRO-1,
+ZeRO-3), pp=2 and ZeRO-1 dp=2, against peft on one process, in one world of 2 ranks (and tp x ep, ep x pp in one of 4).

``lora_experts_parity.py OUT_DIR``. For each layout plait builds the model from a seeded init with LoRA (A and B
random: ``init_lora_weights=False``, so that A has a gradient at the first step); peft's ``LoraModel`` on the same
base gets the same adapter values and trains on the whole global batch in this process. STEPS AdamW steps with the
conformance kit's settings: per step the global loss and, per element, every LoRA gradient slice a rank holds (the
owner's under ZeRO-1) against the same slice of peft's (``ATOL + RTOL * |ref|``). Each rank writes
``rank<N>.json``: per case its worst numbers, failures and the boxes of each LoRA tensor it compared (so the test
counts coverage over both ranks). At pp=1 the adapter is exported from the running model (a peft directory and a
merged model, whose logits must be the parallel model's) and saved as a plait checkpoint, with the parallel
logits beside it (``logits.pt``), for the test to consolidate.
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, MixtralConfig

from plait import ParallelConfig
from plait.base import comm
from plait.checkpoint import save_checkpoint
from plait.checkpoint.lora_export import gather_lora, save_adapter, save_merged
from plait.checkpoint.materialize import load_parallel_model
from plait.lora.config import lora_config
from plait.optim import OptimizerStep, build_optimizer
from plait.parallel.fsdp import local
from plait.testing.conformance_modes import ADAM_EPS, ATOL, LOSS_RTOL, LR, RTOL, STEPS

BATCH, SEQ, VOCAB, SEED = 4, 16, 61, 5  # BATCH: the global batch, split over dp
LAYOUTS = {"tp2_sp": dict(tp=2, sp=True), "tp2": dict(tp=2, sp=False), "ep2": dict(ep=2),
           "ep2_zero1": dict(ep=2, zero_1=True), "pp2": dict(pp=2, num_microbatches=2), "zero1_dp2": dict(zero_1=True),
           "ep2_zero3": dict(ep=2, zero_stage=3)}
LAYOUTS_4 = {"tp2_sp_ep2": dict(tp=2, sp=True, ep=2), "ep2_pp2": dict(ep=2, pp=2, num_microbatches=2)}  # 4 ranks
TARGET_MODULES, TARGET_PARAMETERS = ["q_proj", "v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def model_config() -> MixtralConfig:
    """Two layers (one per stage at pp=2), four experts (two per rank at ep=2), intermediate 32 (16 per rank)."""
    return MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=SEQ)


def lora():
    return lora_config(4, 8, target_modules=TARGET_MODULES, target_parameters=TARGET_PARAMETERS,
                       init_lora_weights=False)


def plait_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".")


def run_case(layout: dict, base: torch.nn.Module, out: Path) -> dict:
    pmodel = load_parallel_model(model_config(), ParallelConfig(**layout), seed=SEED, lora=lora())
    mesh = pmodel.mesh
    start = gather_lora(pmodel)
    reference = get_peft_model(copy.deepcopy(base), copy.deepcopy(pmodel.plan.lora.config))
    ref_params = {plait_name(n): p for n, p in reference.named_parameters() if p.requires_grad}
    result = {"failures": [], "loss_rel": 0.0, "grad_tol": 0.0, "grad_err": 0.0, "checked": {},
              "lora_params": {n: list(p.shape) for n, p in ref_params.items()}}
    if set(ref_params) != set(start):
        result["failures"].append(f"peft adapts {sorted(set(ref_params) ^ set(start))} differently")
        return result
    with torch.no_grad():
        for name, param in ref_params.items():
            param.copy_(start[name])
    ref_opt = torch.optim.AdamW(ref_params.values(), lr=LR, eps=ADAM_EPS)
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=LR, eps=ADAM_EPS)
    step_fn = OptimizerStep(pmodel.grad_sync, optimizer)
    owned = {id(p) for p in getattr(optimizer, "owned_params", pmodel.parameters())}
    named = [(n, p) for n, p in pmodel.module.named_parameters() if id(p) in owned and p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        logits = reference(input_ids=ids, use_cache=False).logits
        ref_loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        ref_loss.backward()
        mine = ids.chunk(mesh.dp)[mesh.dp_rank]
        loss = pmodel.train_step(mine, mine.clone(), num_items_in_batch=BATCH * (SEQ - 1))
        loss = comm.all_reduce(loss.detach().clone(), mesh.replica_group).item()
        rel = abs(loss - ref_loss.item()) / abs(ref_loss.item())
        result["loss_rel"] = max(result["loss_rel"], rel)
        if rel > LOSS_RTOL:
            result["failures"].append(f"step {step} loss {loss:.7f} vs peft's {ref_loss.item():.7f}")
        seen = {}
        inner = optimizer.step
        optimizer.step = lambda *a, **k: (seen.update({n: local(p.grad).clone() for n, p in named
                                                       if p.grad is not None}), inner(*a, **k))[1]
        step_fn()
        del optimizer.step
        for name, _ in named:
            _compare(result, step, name, seen.get(name), pmodel.param_specs[name], ref_params[name].grad)
        ref_opt.step()
        ref_opt.zero_grad()
    if mesh.pp == 1:
        _check_export(pmodel, reference, base, out, result)
    return result


def _compare(result: dict, step: int, name: str, grad, spec, ref_grad: torch.Tensor) -> None:
    """This rank's gradient slice of ``name`` against the same slice of peft's, element by element."""
    if grad is None:
        result["failures"].append(f"step {step}: {name} has no gradient")
        return
    expected = spec.slice_full(ref_grad)
    diff = (grad - expected).abs()
    tol = (diff / (ATOL + RTOL * expected.abs())).max().item()
    result["grad_err"] = max(result["grad_err"], diff.max().item())
    if tol > result["grad_tol"]:
        result["grad_tol"], result["grad_worst"] = tol, f"step {step} {name}: max |d| {diff.max().item():.2e}"
    if tol > 1:
        result["failures"].append(f"step {step} {name}: {tol:.2f}x the tolerance")
    result["checked"][name] = [box for box, _ in spec.boxes()]


def _check_export(pmodel, reference, base, out: Path, result: dict) -> None:
    """The running model's adapter as a peft directory and a merged model (their logits against the parallel
    model's), and as a plait checkpoint with the parallel logits beside it, for the test to consolidate."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    config = pmodel.plan.lora.config
    with torch.no_grad():
        logits = pmodel.gather_logits(pmodel(ids))
        tensors = gather_lora(pmodel)
        if pmodel.mesh.rank == 0:
            save_adapter(out / "adapter", tensors, config, base)
            save_merged(out / "merged", copy.deepcopy(base), tensors, config)
            torch.save({"ids": ids, "logits": logits}, out / "logits.pt")
        save_checkpoint(out / "checkpoint", pmodel, step=STEPS)
        dist.barrier()
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(out / "adapter"))
        merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"))
        for key, model in (("reference", reference), ("peft_dir", loaded), ("merged", merged)):
            result[f"logits_{key}"] = (model(input_ids=ids).logits - logits).abs().max().item()


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    base = load_parallel_model(model_config(), ParallelConfig(), seed=SEED).module  # the seeded init, whole
    layouts = LAYOUTS if dist.get_world_size() == 2 else LAYOUTS_4
    results = {name: run_case(layout, base, out / name) for name, layout in layouts.items()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
