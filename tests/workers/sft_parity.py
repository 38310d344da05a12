"""Worker for tests/test_sft_parity.py: SFT batches (prompt-masked labels, padded or packed) at tp=2 + SP,
pp=2 and ZeRO-1 dp=2 against one process, in one gloo world of 2 ranks.

argv: <out.json>. For llama, gpt2 and qwen3 (the generic adapter, plait-transformers) and both layouts of the
examples, every rank builds the same tiny model; the reference is plain transformers + torch AdamW on the
whole global batch, with the loss summed over labelled tokens and divided by their count in the global
batch (packed rows carry restarting position ids, as in training). 3 fp32 steps; rank 0 writes
{check: [per-rank result]}.
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from plait import ParallelConfig, parallelize
from plait.checkpoint.gather import gather_full
from plait.data.sft_blocks import Example, batch_inputs, count_labels, lay_out
from plait.optim import OptimizerStep, build_optimizer
from plait.parallel.grad_sync import grad_of

VOCAB, SEQ, BATCH, STEPS, LR = 61, 16, 8, 3, 1e-3
LAYOUTS = {"tp2_sp": dict(tp=2, sp=True), "pp2": dict(pp=2, num_microbatches=2), "zero1_dp2": dict(zero_1=True)}


def build(arch: str):
    torch.manual_seed(1234)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64))


def examples() -> list[Example]:
    """Skewed lengths (many short, some longer than a block), a prompt then a completion."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(60):
        n = int(rng.choice([3, 4, 5, 6, 9, 13, 20]))
        ids = rng.integers(3, VOCAB, n)
        trainable = np.arange(n) >= n // 2  # the second half is the "completion"
        out.append(Example(ids, trainable, f"example {i}"))
    return out


def reference_loss(model, ids, labels, positions, num_items):
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits  # a cache turns off packing
    total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                            reduction="sum")
    return total / num_items


def parity(arch: str, layout: str, packing: bool) -> dict:
    blocks = lay_out(examples(), SEQ, 0, packing, "truncate")
    model = build(arch)
    ref = copy.deepcopy(model)
    config = ParallelConfig(**LAYOUTS[layout])
    pm = parallelize(model, config)
    mesh = pm.mesh
    zero = config.zero_1
    opt = build_optimizer(pm, torch.optim.AdamW, lr=LR)  # ZeRO-1's optimizer under zero_1, plain AdamW otherwise
    stepper = OptimizerStep(pm.grad_sync, opt, None)
    owned = {id(p) for p in getattr(opt, "owned_params", pm.parameters())}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    local = dict(pm.module.named_parameters())
    out = {"loss_rel": 0.0, "grad_abs": 0.0, "grads_close": True, "norm_rel": 0.0, "param_abs": 0.0, "losses": [],
           "num_items": [], "checked": []}
    rows_per_rank = BATCH // mesh.dp
    for step in range(STEPS):
        rows = torch.arange(step * BATCH, (step + 1) * BATCH)
        num_items = count_labels(blocks, rows)
        ids, labels, positions = batch_inputs(blocks, rows, torch.device("cpu"))
        ref_opt.zero_grad()
        ref_loss = reference_loss(ref, ids, labels, positions, num_items)
        ref_loss.backward()
        mine = slice(mesh.dp_rank * rows_per_rank, (mesh.dp_rank + 1) * rows_per_rank)
        loss = pm.train_step(ids[mine], labels[mine], num_items_in_batch=num_items,
                             position_ids=None if positions is None else positions[mine])
        if mesh.dp_group is not None:
            dist.all_reduce(loss, group=mesh.dp_group)
        ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])).item()
        # The gradients the optimizer steps on, read just before its step: after the tp/pp sums and the dp
        # reduction (to the owning rank under ZeRO-1, which then holds only its own parameters' sums).
        seen: dict[str, torch.Tensor] = {}

        def reading(*args, **kwargs):
            seen.update({name: grad_of(p).detach().clone() for name, p in local.items() if id(p) in owned})
            return type(opt).step(opt, *args, **kwargs)

        opt.step = reading
        try:
            norm = stepper().item()
        finally:
            del opt.step  # the class's own method again
        out["norm_rel"] = max(out["norm_rel"], abs(norm - ref_norm) / ref_norm)
        for name, grad in seen.items():
            full = grad if zero else gather_full(pm, name, grad)  # ZeRO-1 here is dp only: shards are whole
            expected = ref_params[name].grad
            out["grad_abs"] = max(out["grad_abs"], (full - expected).abs().max().item())
            out["grads_close"] &= bool(torch.allclose(full, expected, rtol=1e-5, atol=1e-6))
        out["checked"] = sorted(set(out["checked"]) | set(seen))
        ref_opt.step()
        out["losses"].append([loss.item(), ref_loss.item()])
        out["num_items"].append(num_items)
        out["loss_rel"] = max(out["loss_rel"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    for name, param in local.items():
        if zero:  # every dp rank holds the whole (updated) parameters after the ZeRO-1 all-gather
            out["param_abs"] = max(out["param_abs"], (param.detach() - ref_params[name]).abs().max().item())
        else:
            out["param_abs"] = max(out["param_abs"],
                                   (gather_full(pm, name, param) - ref_params[name]).abs().max().item())
    out["parameters"] = sorted(name for name, _ in ref.named_parameters())  # a tied weight under one name
    out["packed_rows_with_several_examples"] = (
        0 if blocks.position_ids is None else int(((blocks.position_ids[:, 1:] == 0).sum(1) > 0).sum()))
    return out


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = {}
    for arch in ("llama", "gpt2", "qwen3"):
        for layout in LAYOUTS:
            for packing in (False, True):
                results[f"{arch}-{layout}-{'packed' if packing else 'padded'}"] = parity(arch, layout, packing)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {name: [r[name] for r in gathered] for name in results}
        Path(out_path).write_text(json.dumps(merged, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
