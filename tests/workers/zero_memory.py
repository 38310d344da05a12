"""Worker: one ZeRO stage trained by plait's trainer on a world of ranks; this rank's peak resident memory after
each step and the bytes it holds (parameters, gradients, optimizer state).

argv: <out.json> <model_config.json> <output_dir> <zero_stage> <steps>. The stage is a ``Trainer`` as ``plait
train`` builds it (meta model, this rank's shards materialised, glibc keeping freed memory on the CPU). Its peak is
reset after the build (``/proc/self/clear_refs``), then read after each step as ``peak_rss_mb`` is, the high-water
mark of the resident set. One stage per process: the peak is a property of the process's malloc heap, which a
stage run before would have shaped. The gradients are counted as the optimizer step meets them (after FSDP2's
reduce-scatter, or ZeRO-1's reduce to the owners). Rank 0 writes [per-rank record].
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from plait.base import comm
from plait.optim import Zero1Optimizer
from plait.parallel.fsdp import local
from plait.parallel.grad_sync import grad_of
from plait.run.train_args import TrainArgs
from plait.run.trainer import Trainer

MIB = 2**20


def resident(field: str) -> int:
    """VmRSS or VmHWM (the peak since the last reset) of this process, in bytes."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":")) * 1024


def reset_peak() -> int:
    """Reset the high-water mark to the resident set now; returns the resident bytes."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return resident("VmRSS")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run(config: str, output_dir: str, stage: int, steps: int) -> dict:
    args = TrainArgs(model_config=config, output_dir=output_dir, max_steps=steps,
                     zero_stage=stage, per_device_train_batch_size=1, block_size=32, save_steps=0,
                     save_final=False, lr_scheduler_type="constant", report_to="none")
    trainer = Trainer(args)
    params = [p for p in trainer.pmodel.parameters()]
    optimizer = trainer.optimizer
    seen: dict = {}
    step = optimizer.step

    def counted_step(*a, **k):  # the gradients the optimizer is about to read
        seen["grads"] = tensor_bytes(local(g) for g in (grad_of(p) for p in params) if g is not None)
        return step(*a, **k)

    optimizer.step = counted_step
    base = reset_peak()
    peaks = []
    for i in range(steps):
        trainer.step(i)
        peaks.append(resident("VmHWM"))
    inner = optimizer.optim if isinstance(optimizer, Zero1Optimizer) else optimizer
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    record = {"base": base, "peaks": peaks, "params": tensor_bytes(local(p) for p in params), "grads": seen["grads"],
              "state": tensor_bytes(state), "state_tensors": len(state), "numel": sum(p.numel() for p in params),
              "largest": max(p.numel() for p in params), "tensors": len(params),
              "row_elements": sum(p.numel() // max(p.shape[0], 1) if p.dim() else 1 for p in params)}
    trainer.heartbeat.close()
    return record


def main(out: str, config: str, output_dir: str, stage: str, steps: str) -> None:
    by_rank = comm.all_gather_object(run(config, output_dir, int(stage), int(steps)), comm.world_group())
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(by_rank))


if __name__ == "__main__":
    main(*sys.argv[1:])
