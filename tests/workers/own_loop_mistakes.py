"""One rank of a tp=2 world making a new user's mistake: the optimizer built on the model before parallelize.
Writes, per rank, the error OptimizerStep raised (None: it accepted) and how many of the optimizer's tensors
were the parallel model's; with the optimizer built after, the step runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from plait import ParallelConfig, parallelize  # noqa: E402
from plait.base import comm  # noqa: E402
from plait.base.config import ConfigError  # noqa: E402
from plait.optim import OptimizerStep  # noqa: E402
from tiny_models import tiny_config  # noqa: E402


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    before = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the mistake
    pmodel = parallelize(model, ParallelConfig(tp=2))
    ours = {id(p) for p in pmodel.parameters()}
    held = [t for group in before.param_groups for t in group["params"]]
    record = {"held": len(held), "stale": sum(id(t) not in ours for t in held)}
    try:
        OptimizerStep(pmodel.grad_sync, before)
        record["error"] = None
    except ConfigError as err:
        record["error"] = str(err)
    after = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    ids = torch.randint(0, 61, (2, 8))
    pmodel.train_step(ids, ids)
    record["norm"] = OptimizerStep(pmodel.grad_sync, after)().item()
    ranks = comm.all_gather_object(record, comm.world_group())
    if dist.get_rank() == 0:
        out.write_text(json.dumps(ranks))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
