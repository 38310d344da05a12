"""Worker for tests/test_sft_truncation.py: `plait train`'s Trainer at tp=2 + SP, pp=2 (two microbatches) and
ZeRO-1 dp=2, one after another in one gloo world of 2 ranks, on SFT data whose answers truncation mostly cut
away, so that some steps and many micro-batches have no token to train on.

argv: <out.json> <flags.json>: flags.json holds the TrainArgs every layout shares (data, model, steps); rank 0
writes {layout: metrics history}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from plait.train_args import TrainArgs
from plait.trainer import Trainer

LAYOUTS = {"tp2_sp": dict(tensor_parallel_size=2, per_device_train_batch_size=4),
           "pp2": dict(pipeline_parallel_size=2, num_microbatches=2, per_device_train_batch_size=4),
           "zero1_dp2": dict(zero_1=True, per_device_train_batch_size=2)}


def main(out: str, flags: str) -> None:
    shared = json.loads(Path(flags).read_text())
    histories = {}
    for name, layout in LAYOUTS.items():
        args = TrainArgs(**{**shared, **layout, "output_dir": f"{shared['output_dir']}-{name}"})
        histories[name] = Trainer(args).train()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(histories))


if __name__ == "__main__":
    main(*sys.argv[1:])
