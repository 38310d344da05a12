"""One rank of a 2-process world making a new user's mistakes. The optimizer built on the model before parallelize
(tp=2): writes, per rank, the error OptimizerStep raised (None: it accepted) and how many of the optimizer's tensors
were the parallel model's; with the optimizer built after, the step runs. A plain optimizer under each ZeRO stage at
dp=2: what OptimizerStep says; optimizer.step() before the gradients' sums (refused where owed). The model built
with a different seed on each rank (dp=2, then tp=2): whether the weights differed before parallelize, whether they
are rank 0's after it, and whether the dp replicas are still equal after two steps."""

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
from plait.optim import OptimizerStep, build_optimizer  # noqa: E402
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
    record.update(different_seeds(comm.world_group()))
    record["plain_under_zero"] = plain_under_zero()
    record["step_before_the_sums"] = step_before_the_sums(comm.world_group())
    record["out_of_vocab"] = out_of_vocab(pmodel)
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(4))
    logits = pmodel.gather_logits(pmodel(ids))  # with grad enabled: at tp=2 an in-place error in the gather before
    with torch.no_grad():
        record["gathered_with_grad"] = [list(logits.shape), logits.requires_grad,
                                        torch.equal(logits, pmodel.gather_logits(pmodel(ids)))]
    ranks = comm.all_gather_object(record, comm.world_group())
    if dist.get_rank() == 0:
        out.write_text(json.dumps(ranks))
    dist.destroy_process_group()


def out_of_vocab(pmodel) -> dict[str, str | None]:
    """At tp=2 (a vocab-parallel embedding and loss), an id and a label past the vocabulary: the error each gave
    (None: trained on, as before, a zero embedding and a zero target logit)."""
    vocab = pmodel.plan.model_config.vocab_size
    said = {}
    for name in ("id", "label"):
        ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(3))
        labels = ids.clone()
        (ids if name == "id" else labels)[0, 3] = vocab + 5
        try:
            pmodel.train_step(ids, labels)
            said[name] = None
        except RuntimeError as err:
            said[name] = str(err)
    return said


def plain_under_zero() -> dict[int, str | None]:
    """A plain AdamW over the parallel model at dp=2 under ZeRO-1 and ZeRO-3 (build_optimizer skipped; ZeRO-2 is
    ZeRO-3's FSDP2 path): what OptimizerStep says (None: it accepted; under ZeRO-2/3 it then trained on other
    numbers than one process)."""
    said = {}
    for stage in (1, 3):
        pmodel = parallelize(AutoModelForCausalLM.from_config(tiny_config("llama")), ParallelConfig(zero_stage=stage))
        try:
            OptimizerStep(pmodel.grad_sync, torch.optim.AdamW(pmodel.parameters(), lr=1e-3))
            said[stage] = None
        except ConfigError as err:
            said[stage] = str(err)
    return said


def step_before_the_sums(world) -> dict[str, list]:
    """``optimizer.step()`` straight after ``train_step``, by layout and optimizer: what it said (None: it stepped),
    then, after ``grad_sync.finish()``, whether a step is taken and the parameters rank 0 holds differently. A plain
    AdamW at dp=2 and at tp=2 with SP, ``build_optimizer``'s under ZeRO-1 (refused) and ZeRO-3 (FSDP2 has summed
    during backward: taken)."""
    ids = torch.randint(0, 61, (4, 8), generator=torch.Generator().manual_seed(5))
    found = {}
    for name, config in (("dp2", ParallelConfig()), ("tp2_sp", ParallelConfig(tp=2, sp=True)),
                         ("zero1", ParallelConfig(zero_stage=1)), ("zero3", ParallelConfig(zero_stage=3))):
        torch.manual_seed(0)
        pmodel = parallelize(AutoModelForCausalLM.from_config(tiny_config("llama")), config)
        plain = name in ("dp2", "tp2_sp")
        optimizer = (torch.optim.AdamW(pmodel.parameters(), lr=1e-2) if plain else
                     build_optimizer(pmodel, torch.optim.AdamW, lr=1e-2))
        pmodel.train_step(pmodel.local_batch(ids), pmodel.local_batch(ids), num_items_in_batch=4 * 7)
        try:
            optimizer.step()
            said = None
        except ConfigError as err:
            said = str(err)
        if said is not None:
            pmodel.grad_sync.finish()
            optimizer.step()
        held = {n: p.detach() for n, p in pmodel.module.named_parameters()}
        first = comm.all_gather_object(held, world)[0]
        found[name] = [said, [n for n in held if not torch.equal(held[n], first[n])] if name == "dp2" else None]
    return found


def different_seeds(world) -> dict:
    """Each rank builds its model from its own seed: parallelize lays out rank 0's (dp=2: all of it; tp=2: each
    rank its slice of rank 0's split weights), and the dp replicas then take identical steps."""
    torch.manual_seed(100 + dist.get_rank())
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    own = {name: p.detach().clone() for name, p in model.named_parameters()}
    first = comm.all_gather_object(own, world)[0]
    found = {"differed": [n for n in own if not torch.equal(own[n], first[n])]}
    pmodel = parallelize(model, ParallelConfig())  # dp=2
    found["dp_not_rank0s"] = [n for n, p in pmodel.module.named_parameters() if not torch.equal(p, first[n])]
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
    for step in range(2):
        ids = torch.randint(0, 61, (4, 8), generator=torch.Generator().manual_seed(step))
        pmodel.train_step(pmodel.local_batch(ids), pmodel.local_batch(ids), num_items_in_batch=4 * 7)
        OptimizerStep(pmodel.grad_sync, optimizer)()
    trained = {n: p.detach() for n, p in pmodel.module.named_parameters()}
    peer = comm.all_gather_object(trained, world)[0]
    found["replicas_apart_after_steps"] = [n for n in trained if not torch.equal(trained[n], peer[n])]
    torch.manual_seed(200 + dist.get_rank())
    pmodel = parallelize(AutoModelForCausalLM.from_config(tiny_config("llama")), ParallelConfig(tp=2))
    found["tp_not_rank0s"] = [name for name, p in pmodel.module.named_parameters()  # this rank's shard of rank 0's
                              if not torch.equal(p, pmodel.param_specs[name].slice_full(first_of_seed(200, name)))]
    return found


def first_of_seed(seed: int, name: str) -> torch.Tensor:
    """Parameter ``name`` of the model rank 0 built (seed ``seed``), rebuilt here."""
    torch.manual_seed(seed)
    return dict(AutoModelForCausalLM.from_config(tiny_config("llama")).named_parameters())[name].detach()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
