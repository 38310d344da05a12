"""Worker: several `plait train` runs (plait.run.trainer.Trainer), one after another in one world, so that a test
of many layouts pays for one launch.

argv: <out.json> <flags.json>: flags.json maps each case to its TrainArgs keywords. Every rank records each
case's metrics history (and the bytes of a training method's frozen second model it holds), or the one-line message
of a run that stopped on a non-finite step; rank 0 writes
{case: [per-rank record]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from plait.base import comm
from plait.run.runtime import TrainingDiverged
from plait.run.train_args import TrainArgs
from plait.run.trainer import Trainer


def second_model_bytes(trainer: Trainer) -> int | None:
    """The bytes of the parameters this rank holds of the method's frozen second model (DPO's reference, a
    distillation teacher), as ``plait plan`` counts them; None without one."""
    method = trainer.method
    frozen = getattr(method, "teacher", None) or getattr(getattr(method, "reference", None), "model", None)
    if frozen is None or frozen is trainer.pmodel:
        return None
    return sum(p.numel() * p.element_size() for p in frozen.parameters())


def run(args: dict) -> dict:
    trainer = Trainer(TrainArgs(**args))
    try:
        return {"history": trainer.train(), "second_model_bytes": second_model_bytes(trainer)}
    except TrainingDiverged as err:
        return {"diverged": str(err)}


def main(out: str, flags: str) -> None:
    records = {name: run(args) for name, args in json.loads(Path(flags).read_text()).items()}
    by_rank = comm.all_gather_object(records, comm.world_group())
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({name: [r[name] for r in by_rank] for name in records}))


if __name__ == "__main__":
    main(*sys.argv[1:])
