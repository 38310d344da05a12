"""Worker: several `plait train` runs (plait.run.trainer.Trainer), one after another in one world, so that a test
of many layouts pays for one launch.

argv: <out.json> <flags.json>: flags.json maps each case to its TrainArgs keywords. Every rank records each
case's metrics history (and the bytes of a training method's frozen second model it holds), or the one-line message
of a run that stopped on a non-finite step; rank 0 writes
{case: [per-rank record]}, and beside out.json, per case, CASE.grads.pt: the gradients the first optimizer step
applied, every parameter whole (``capture_gradients``: each rank's shards placed where they belong).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from plait.base import comm
from plait.parallel.grad_sync import grad_of
from plait.run.runtime import TrainingDiverged
from plait.run.train_args import TrainArgs
from plait.run.trainer import Trainer


def capture_gradients(trainer: Trainer, step: int = 1) -> list[tuple[str, torch.Tensor, object]]:
    """Keep, as the optimizer applies its ``step``-th step, the gradients it is given (summed over the layout and
    clipped): (name, this rank's local gradient, its shard spec) for every parameter this rank updates (under ZeRO-1
    the ones it owns). Filled in place as the run goes."""
    kept: list[tuple[str, torch.Tensor, object]] = []
    optimizer, calls = trainer.optimizer_step.optimizer, [0]
    inner = optimizer.step

    def keeping(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            owned = {id(p) for p in getattr(optimizer, "owned_params", trainer.pmodel.parameters())}
            for name, param in trainer.pmodel.module.named_parameters():
                grad = grad_of(param)
                if id(param) in owned and grad is not None:
                    kept.append((name, grad.detach().double().cpu().clone(), trainer.pmodel.param_specs[name]))
        return inner(*args, **kwargs)

    optimizer.step = keeping
    return kept


def whole(kept_by_rank: list[list[tuple[str, torch.Tensor, object]]]) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient from every rank's ``capture_gradients``; an element no rank held is NaN."""
    full: dict[str, torch.Tensor] = {}
    for kept in kept_by_rank:
        for name, grad, spec in kept:
            spec.place(grad, full.setdefault(name, torch.full(spec.full_shape, float("nan"), dtype=grad.dtype)))
    return full


def assert_gradients_agree(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every parameter of ``expected`` has ``got``'s step-1 gradient, within rtol 1e-5 and atol 4e-7. A layout sums
    tokens and ranks in another order than one process, and a bias's gradient, a sum over every token of the batch,
    keeps that fp32 noise however small the sum: LLaVA's projector bias at tp=2 with SP is 2.0e-7 off on an AVX-512
    Xeon (1.7x an atol of 1e-7; 1.0x and 1.5x under ATEN_CPU_CAPABILITY default and avx2). The atol is twice that."""
    for name, reference in expected.items():
        torch.testing.assert_close(got[name], reference, rtol=1e-5, atol=4e-7, equal_nan=True, msg=name)


def record_read_ahead(trainer: Trainer, hook: str, examples: list) -> list[set[int]]:
    """At each call of the method's ``hook`` (``micro_step`` or ``before_step``), the indices of ``examples``
    (``plait.data.vision.Example``s, None for text) whose pixels are being read ahead (plait.data.pixel_loader)."""
    seen, original = [], getattr(trainer.method, hook)

    def recording(*args):
        seen.append({i for i, e in enumerate(examples) if e is not None and e.reload is not None and e.reload.started})
        return original(*args)

    setattr(trainer.method, hook, recording)
    return seen


def second_model_bytes(trainer: Trainer) -> int | None:
    """The bytes of the parameters this rank holds of the method's frozen second model (DPO's reference, a
    distillation teacher), as ``plait plan`` counts them; None without one."""
    method = trainer.method
    frozen = getattr(method, "teacher", None) or getattr(getattr(method, "reference", None), "model", None)
    if frozen is None or frozen is trainer.pmodel:
        return None
    return sum(p.numel() * p.element_size() for p in frozen.parameters())


def run(name: str, args: dict, out: Path) -> dict:
    trainer = Trainer(TrainArgs(**args))
    kept = capture_gradients(trainer)
    try:
        record = {"history": trainer.train(), "second_model_bytes": second_model_bytes(trainer)}
    except TrainingDiverged as err:
        return {"diverged": str(err)}
    by_rank = comm.all_gather_object(kept, comm.world_group())
    if dist.get_rank() == 0:
        torch.save(whole(by_rank), out.with_name(f"{name}.grads.pt"))
    return record


def main(out: str, flags: str) -> None:
    records = {name: run(name, args, Path(out)) for name, args in json.loads(Path(flags).read_text()).items()}
    by_rank = comm.all_gather_object(records, comm.world_group())
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({name: [r[name] for r in by_rank] for name in records}))


if __name__ == "__main__":
    main(*sys.argv[1:])
