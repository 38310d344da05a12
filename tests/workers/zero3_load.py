"""Worker: a Hugging Face directory loaded into ZeRO-3 shards (dp=2) reads only each rank's rows.

``zero3_load.py HF_DIR OUT.json``: every rank counts the elements its reader fills (``CheckpointReader.read``),
compares its rows of every parameter with the same rows of the directory's tensors, and rank 0 writes both ranks'
counts and mismatches.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from plait import ParallelConfig
from plait.checkpoint.load import CheckpointReader
from plait.checkpoint.materialize import load_parallel_model
from plait.parallel.fsdp import local


def main() -> None:
    hf_dir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    read = [0]
    original = CheckpointReader.read

    def counting(self, logical, box, target):
        read[0] += math.prod(b - a for a, b in box)
        return original(self, logical, box, target)

    CheckpointReader.read = counting
    pmodel = load_parallel_model(hf_dir, ParallelConfig(zero_stage=3))
    full = load_file(f"{hf_dir}/model.safetensors")
    mismatched = [name for name, param in pmodel.module.named_parameters()
                  if not torch.equal(local(param).detach(), pmodel.param_specs[name].slice_full(full[name]))]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"read": read[0], "mismatched": mismatched,
                                      "total": sum(t.numel() for t in full.values())})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
