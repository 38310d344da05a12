"""The allocator's peak per rank at ZeRO stages 0-3 on an accelerator, beside the ZeRO paper's formula.

    python bench/device_memory.py [--dp 2] [--steps 3] [--models small,large]

bench/memory.py measures each rank's peak resident memory on the CPU in real gloo worlds. On an accelerator the
figure that matters is the allocator's peak (``torch.accelerator.max_memory_allocated``: every live tensor, what
an out-of-memory error is about). A machine lent with one device cannot hold a dp=2 world (NCCL refuses two ranks
on one GPU), so this bench runs rank 0 of a ``--dp``-rank world in one process on torch's fake process group:
every collective returns at once without moving data, while every buffer FSDP2 and plait allocate for it (the
gathered parameters, the reduce-scatter inputs, sharded gradients and optimizer state) is allocated as in the
real world. Rank 0's memory is therefore the real rank's; its numbers (losses, gradients) are not, and are not
printed. On a machine without an accelerator it runs the same steps and prints no memory (a check of the script).

Per stage: the bytes stored between steps (parameters and AdamW state as the optimizer holds them; plait frees
gradients at each step's end) against the ZeRO paper's split for fp32 AdamW at dp ranks (psi the parameters:
0: 4 + 8, 1: 4 + 8/dp, 2 and 3: 4/dp + 8/dp bytes per parameter); and the allocator's peak of each step beside
the paper's bytes at the stage's peak, gradients included (0: 16, 1: 4 + 4 + 8/dp, 2: 4/dp + 4 + 8/dp, FSDP2's
stage 2 keeping each layer gathered beside its shard until backward is done with it, 3: 16/dp): the rest is
activations and the collectives' buffers; and ``plait plan``'s peak for the same layout and batch.

Stage 2 is FSDP2's (``reshard_after_forward=False``, docs/decisions.md D13): at the end of the forward it holds
every unit gathered beside its shard and the optimizer state, 4/dp + 4 + 8/dp bytes per parameter, with all the
activations; stage 1 holds 4 + 8/dp there and reaches 4 + 4 + 8/dp only at the end of the backward, when the
activations are gone. So stage 2 peaks below stage 1 while the forward's activations are under (4 - 4/dp) bytes
per parameter, and above it past that; the planner counts both. "ok" holds when each stage's stored bytes are the
formula's within one row per tensor (ZeRO-2/3 split each tensor's rows over dp) and one parameter's state (ZeRO-1
gives each rank whole parameters), and on an accelerator when the peaks order stage 3 < 1 < 0 and stage 2 lies
below or above stage 1 as the planner says.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
MIB = 1024 * 1024
# the models: bench/memory.py's 51M Llama of its peak-RSS table, and a 0.55B one whose bytes dwarf activations
MODELS = {
    "small": dict(vocab_size=8192, hidden_size=640, intermediate_size=1792, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512),
    "large": dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512),
}
# bytes per parameter stored between steps: parameters and AdamW state; gradients are set to None after each step,
# except --bf16's fp32 main_grad buffers (kept for the run) beside bf16 parameters at stages 0 and 1, whose
# optimizer holds fp32 masters too; at stages 2 and 3 --bf16 keeps fp32 shards (the masters) and gathers bf16 copies
STORED = {
    "fp32": {0: lambda dp: 4 + 8.0, 1: lambda dp: 4 + 8 / dp, 2: lambda dp: 12 / dp, 3: lambda dp: 12 / dp},
    "bf16": {0: lambda dp: 2 + 4 + 12.0, 1: lambda dp: 2 + 4 + 12 / dp, 2: lambda dp: 12 / dp, 3: lambda dp: 12 / dp},
}
# the ZeRO paper's bytes per parameter at a stage's peak (mixed precision: 2 + 2 + 12 unsharded); FSDP2's stage 2
# keeps the gathered copy beside the shard
AT_PEAK = {
    "fp32": {0: lambda dp: 16.0, 1: lambda dp: 4 + 4 + 8 / dp, 2: lambda dp: 4 / dp + 4 + 8 / dp,
             3: lambda dp: 16 / dp},
    "bf16": {0: lambda dp: 16.0, 1: lambda dp: 2 + 2 + 12 / dp, 2: lambda dp: 4 / dp + 2 + 2 / dp + 8 / dp,
             3: lambda dp: 16 / dp},
}


def stored_bytes(pmodel, optimizer) -> tuple[int, int]:
    """This rank's bytes of parameters, gradients and optimizer state (with masters) as they are stored now, and
    how many tensors (for the formula's one-row-per-tensor rounding)."""
    from memory import optimizer_state_bytes, tensor_bytes  # bench/memory.py, beside this file

    from plait.parallel.fsdp import local

    params = list(pmodel.parameters())
    from plait.parallel.grad_sync import MAIN_GRAD, grad_of

    grads = [local(p.grad) for p in params if p.grad is not None]
    main = [grad_of(p) for p in params if hasattr(p, MAIN_GRAD)]
    return (tensor_bytes(local(p) for p in params) + tensor_bytes(grads) + tensor_bytes(main)
            + optimizer_state_bytes(optimizer), len(params))


def run_stage(name: str, stage: int, dp: int, steps: int, rows: int, seq: int, bf16: bool,
              device: torch.device) -> dict:
    """Rank 0's stored bytes and allocator peaks over ``steps`` steps at ``stage`` (AdamW, fp32 or ``bf16`` as
    ``plait train --bf16`` runs it, ``rows`` x ``seq`` tokens a rank), and ``plait plan``'s peak for it
    (bench/plan_check.py's prediction)."""
    from plan_check import _predict
    from transformers import LlamaConfig, LlamaForCausalLM

    import plait
    from plait.base import device as dev
    from plait.optim import OptimizerStep, build_optimizer

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**MODELS[name]))
    psi = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    row = max(p.numel() // p.shape[0] for p in model.parameters())
    sharded = stage >= 2
    if bf16 and not sharded:
        model.to(torch.bfloat16)
    layout = {"zero_stage": stage, "mixed_precision": bf16 and sharded}
    pmodel = plait.parallelize(model, plait.ParallelConfig(**layout))
    fused = {"fused": True} if dev.use_fused_adamw(device) else {}  # as plait train builds it
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, weight_decay=0.0,
                                optimizer_dtype=torch.float32 if bf16 else None, **fused)
    step = OptimizerStep(pmodel.grad_sync, optimizer, max_grad_norm=1.0)
    del model
    gc.collect()
    peaks, stored = [], []
    vocab = MODELS[name]["vocab_size"]
    for i in range(steps):
        ids = torch.randint(0, vocab, (rows * dp, seq), generator=torch.Generator().manual_seed(i)).to(device)
        dev.reset_peak_memory(device)
        local_ids = pmodel.local_batch(ids)
        loss = pmodel.train_step(local_ids, local_ids, num_items_in_batch=plait.num_items_in_batch(ids))
        step(loss)
        dev.synchronize(device)
        peaks.append(dev.peak_memory_bytes(device))
        stored.append(stored_bytes(pmodel, optimizer)[0])
    tensors = stored_bytes(pmodel, optimizer)[1]
    del pmodel, optimizer, step, loss
    gc.collect()
    if dev.accelerator() is not None:
        torch.accelerator.empty_cache()
    planned = _predict(layout, LlamaConfig(**MODELS[name]), torch.bfloat16 if bf16 else torch.float32, rows,
                       seq).peak
    return {"model": name, "stage": stage, "planned": planned, "psi": psi, "tensors": tensors,
            "largest": largest, "row": row, "peaks": peaks, "stored": stored}


def report(results: list[dict], dp: int, rows: int, seq: int, bf16: bool, on_device: bool) -> bool:
    """Print the table; True when each stage stores the formula's bytes, and on an accelerator when every model's
    peaks order stage 3 < 1 < 0 and stage 2 falls below or above stage 1 as ``plait plan`` says (see the module's
    doc for when stage 2 is above)."""
    precision = "bf16" if bf16 else "fp32"
    print(f"rank 0 of dp={dp} (fake process group, one process), {precision} AdamW"
          f"{' (fp32 masters)' if bf16 else ''}, {rows} x {seq} tokens per rank (MiB)")
    print(f"{'model':>6} {'stage':>5} {'psi':>7} {'stored':>7} {'formula':>7} {'peak per step':>20} "
          f"{'paper at peak':>13} {'plait plan':>10} {'peak/plan':>9}")
    good = True
    for r in results:
        psi = r["psi"]
        want = STORED[precision][r["stage"]](dp) * psi
        slack = 12 * r["tensors"] * r["row"] + 8 * r["largest"]  # a row per tensor (2, 3), a parameter (1)
        stored = r["stored"][-1]
        fits = abs(stored - want) <= slack
        good &= fits
        peak = max(r["peaks"]) if on_device else None
        peaks = " ".join(f"{p / MIB:6.0f}" for p in r["peaks"]) if on_device else "n/a"
        ratio = f"{peak / r['planned']:9.3f}" if on_device else f"{'n/a':>9}"
        print(f"{r['model']:>6} {r['stage']:5d} {psi / 1e6:6.1f}M {stored / MIB:7.0f} {want / MIB:7.0f} "
              f"{peaks:>20} {AT_PEAK[precision][r['stage']](dp) * psi / MIB:13.0f} {r['planned'] / MIB:10.0f} {ratio}"
              f"{'' if fits else '  stored bytes off the formula'}")
    if on_device:
        for name in dict.fromkeys(r["model"] for r in results):
            peak = {r["stage"]: max(r["peaks"]) for r in results if r["model"] == name}
            planned = {r["stage"]: r["planned"] for r in results if r["model"] == name}
            verdict = []
            if all(s in peak for s in (0, 1, 3)) and not peak[3] < peak[1] < peak[0]:
                verdict.append("NOT stage 3 < 1 < 0")
            if 1 in peak and 2 in peak and (peak[2] < peak[1]) != (planned[2] < planned[1]):
                verdict.append("stage 2 against stage 1 NOT as planned")
            good &= not verdict
            print(f"{name}: measured " + ", ".join(f"stage {s} {peak[s] / MIB:.0f}" for s in sorted(peak))
                  + "; planned " + ", ".join(f"stage {s} {planned[s] / MIB:.0f}" for s in sorted(planned))
                  + "".join(f"; {v}" for v in verdict))
    print("ok" if good else "NOT ok")
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--bf16", action="store_true", help="as plait train --bf16: bf16 compute, fp32 masters")
    ns = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.base import device as dev

    device = dev.pick_device("auto")
    dev.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ns.dp)
    results = [run_stage(name, int(stage), ns.dp, ns.steps, ns.rows, ns.seq, ns.bf16, device)
               for name in ns.models.split(",") for stage in ns.stages.split(",")]
    ok = report(results, ns.dp, ns.rows, ns.seq, ns.bf16, dev.accelerator() is not None)
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
