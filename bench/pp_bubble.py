"""Pipeline bubble: the per-rank idle fraction of plait's pipeline stages beside bare
``torch.distributed.pipelining`` stages of the same cost, and the textbook formulas.

Every stage does work of known, equal cost: a sleeping autograd function (80 ms forward, 160 ms backward
per chunk) in each stage's one decoder layer (plait: a tiny Llama with one layer per stage, laid out by
``parallelize``) or after one linear (bare ``PipelineStage``). Sleeping takes no CPU, so the 2 cores of a
small machine do not decide the result. A rank is busy while a stage of it runs a forward or backward
chunk (the sleep plus the real compute: a transformer layer for plait, a linear for bare; the "extra
ms/chunk" columns show that compute) and idle otherwise. Idle fraction = 1 - busy / step wall time
(barrier to barrier), mean over ranks and measured steps, beside (p-1)/(m+p-1) for 1F1B and
(p-1)/(v*m+p-1) for interleaved 1F1B. The warm-up step (shape inference) runs without sleeping.

    python bench/pp_bubble.py [--fwd-ms 80 --bwd-ms 160 --steps 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

CONFIGS = [(m, v) for v in (1, 2) for m in (4, 8)]  # (microbatches, virtual stages per rank)
HIDDEN, SEQ = 32, 16


class Sleep(torch.autograd.Function):
    """Identity that sleeps: a stage of known cost. Sleeping time is added to ``Sleep.busy``."""

    busy = 0.0
    fwd_s, bwd_s = 0.08, 0.16

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        Sleep._sleep(Sleep.fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        Sleep._sleep(Sleep.bwd_s)
        return grad

    @staticmethod
    def _sleep(seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        Sleep.busy += time.perf_counter() - start


class Busy:
    """Seconds this rank spent inside stage forward/backward chunks (PipelineStage methods, timed)."""

    seconds = 0.0

    @staticmethod
    def install() -> None:
        from torch.distributed.pipelining import PipelineStage

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(PipelineStage, name, Busy._timed(getattr(PipelineStage, name)))

    @staticmethod
    def _timed(method):
        def timed(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                Busy.seconds += time.perf_counter() - start

        return timed


class SleepModule(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(x)


def schedule_name(v: int) -> str:
    return "1f1b" if v == 1 else "interleaved-1f1b"


def plait_step(p: int, m: int, v: int):
    """A tiny Llama with one layer per stage, laid out by plait, each layer's MLP output sleeping."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait import ParallelConfig, parallelize

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64,
                                         num_hidden_layers=p * v, num_attention_heads=4, num_key_value_heads=4))
    pm = parallelize(model, ParallelConfig(pp=p, virtual_pipeline_size=v, num_microbatches=m,
                                           pipeline_schedule=schedule_name(v)))
    for layer in pm.module.model.layers:
        if hasattr(layer, "mlp"):  # an owned layer (the others are pass-through placeholders)
            layer.mlp.register_forward_hook(lambda module, args, out: Sleep.apply(out))
    ids = torch.randint(0, 64, (m, SEQ), generator=torch.Generator().manual_seed(0))
    return lambda: pm.train_step(ids, ids)


def bare_step(p: int, m: int, v: int):
    """The same schedule over bare PipelineStages: one linear and the same sleep per stage."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank = dist.get_rank()
    stages = [PipelineStage(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), SleepModule()), rank + c * p, p * v,
                            torch.device("cpu")) for c in range(v)]
    loss = lambda out, target: ((out - target) ** 2).sum()  # noqa: E731
    if v == 1:
        schedule = Schedule1F1B(stages[0], m, loss_fn=loss, scale_grads=False)
    else:
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False)
    x, target = torch.randn(m, SEQ, HIDDEN), torch.randn(m, SEQ, HIDDEN)
    return lambda: schedule.step(x, target=target, losses=[], return_outputs=False)


def measure(step, steps: int, chunks: int) -> tuple[float, float]:
    """(idle fraction, compute ms per chunk beyond the sleep) of this rank, means over ``steps`` steps."""
    sleeps = Sleep.fwd_s, Sleep.bwd_s
    Sleep.fwd_s = Sleep.bwd_s = 0.0
    step()  # warm-up: shape inference and p2p set-up
    Sleep.fwd_s, Sleep.bwd_s = sleeps
    idle, extra = 0.0, 0.0
    for _ in range(steps):
        dist.barrier()
        Sleep.busy = Busy.seconds = 0.0
        start = time.perf_counter()
        step()
        dist.barrier()
        idle += 1 - Busy.seconds / (time.perf_counter() - start)
        extra += (Busy.seconds - Sleep.busy) / chunks * 1000
    return idle / steps, extra / steps


def worker(out: str, steps: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    Busy.install()
    p = dist.get_world_size()
    rows = {}
    for m, v in CONFIGS:
        for kind, build in (("plait", plait_step), ("bare", bare_step)):
            rows[f"{m},{v},{kind}"] = measure(build(p, m, v), steps, chunks=m * v)
    gathered: list = [None] * p
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fwd-ms", type=float, default=80.0)
    parser.add_argument("--bwd-ms", type=float, default=160.0)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per configuration (after 1 warm-up)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    Sleep.fwd_s, Sleep.bwd_s = args.fwd_ms / 1000, args.bwd_ms / 1000
    if args.worker:
        worker(args.worker, args.steps)
        return

    from plait.testing import launch

    print(f"pipeline bubble: stage work {args.fwd_ms:.0f} ms forward / {args.bwd_ms:.0f} ms backward per chunk, "
          f"gloo, {args.steps} measured steps; idle = mean over ranks of 1 - busy / step wall time")
    header = (f"{'p':>2} {'schedule':>16} {'m':>2} {'v':>2} {'formula':>8} {'plait':>7} {'bare':>7} "
              f"{'plait/formula':>14} {'bare/formula':>13} {'plait-bare':>11} {'extra ms/chunk plait':>21} "
              f"{'bare':>5}")
    print(header)
    print("-" * len(header))
    for p in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "bubble.json")
            launch([__file__, "--worker", out, "--fwd-ms", str(args.fwd_ms), "--bwd-ms", str(args.bwd_ms),
                    "--steps", str(args.steps)], p, timeout=600)
            per_rank = json.loads(Path(out).read_text())
        for m, v in CONFIGS:
            formula = (p - 1) / (v * m + p - 1)
            (plait, plait_ms), (bare, bare_ms) = (
                [sum(r[f"{m},{v},{kind}"][i] for r in per_rank) / p for i in (0, 1)] for kind in ("plait", "bare"))
            print(f"{p:>2} {schedule_name(v):>16} {m:>2} {v:>2} {formula:>8.3f} {plait:>7.3f} {bare:>7.3f} "
                  f"{plait / formula:>14.2f} {bare / formula:>13.2f} {plait - bare:>+11.3f} {plait_ms:>21.1f} "
                  f"{bare_ms:>5.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
