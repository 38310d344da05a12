"""Worker for tests/test_trainer_reference.py: `plait train`'s Trainer at tp=2 + SP, pp=2 and ZeRO-1 dp=2 on
plain text, and at tp=2 + SP on packed SFT, one after another in one gloo world of 2 ranks.

argv: <out.json> <flags.json>: flags.json maps each case to its TrainArgs keywords; rank 0 writes
{case: metrics history}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from plait.train_args import TrainArgs
from plait.trainer import Trainer


def main(out: str, flags: str) -> None:
    histories = {name: Trainer(TrainArgs(**args)).train() for name, args in json.loads(Path(flags).read_text()).items()}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(histories))


if __name__ == "__main__":
    main(*sys.argv[1:])
