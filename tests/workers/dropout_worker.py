"""Worker: dropout masks under tensor and sequence parallelism (GPT2, every dropout at 0.1), world of 2.

Every dropout call is recorded in call order (its mask: the zeros it made), and the decoder layers'
outputs are kept. Rank 0 writes what the test compares: per case, per call, whether the two ranks' masks
are equal; whether each layer's output is bitwise equal across ranks; and whether a step recomputed under
activation checkpointing gives the gradients of the same step without it (the same masks redrawn).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import plait  # noqa: E402
from plait.base import comm  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

DROPOUT = dict(attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, _attn_implementation="eager")
IDS = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(3))


def recorded_forward(pmodel, calls: list[torch.Tensor]) -> list[torch.Tensor]:
    """One training-mode forward; every dropout's mask into ``calls``; each decoder layer's output returned."""
    original = F.dropout
    outputs: list[torch.Tensor] = []

    def dropout(x, p=0.5, training=True, inplace=False):
        y = original(x, p, training, inplace)
        calls.append(((y == 0) & (x != 0)).flatten())
        return y

    hooks = [layer.register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
             for layer in pmodel.module.transformer.h]
    F.dropout = dropout
    try:
        pmodel(IDS, IDS, num_items_in_batch=IDS[:, 1:].numel())
    finally:
        F.dropout = original
        for hook in hooks:
            hook.remove()
    return outputs


def same_on_both_ranks(t: torch.Tensor) -> bool:
    both = comm.all_gather(t.detach().float().unsqueeze(0), comm.world_group(), dim=0)
    return bool(torch.equal(both[0], both[1]))


def mask_case(sp: bool) -> dict:
    torch.manual_seed(0)
    pmodel = plait.parallelize(tiny_model("gpt2", **DROPOUT), plait.ParallelConfig(tp=2, sp=sp))
    pmodel.train()
    torch.manual_seed(11)  # the shared stream: alike on every rank
    calls: list[torch.Tensor] = []
    outputs = recorded_forward(pmodel, calls)
    return {"masks_equal": [same_on_both_ranks(c) for c in calls], "dropped": [int(c.sum()) for c in calls],
            "layer_outputs_equal": [same_on_both_ranks(o) for o in outputs]}


def recompute_case() -> dict:
    """Gradients of one step with and without activation checkpointing, from the same RNG state."""
    base = tiny_model("gpt2", **DROPOUT)
    grads = []
    for checkpointing in (False, True):
        pmodel = plait.parallelize(copy.deepcopy(base),
                                   plait.ParallelConfig(tp=2, sp=True, gradient_checkpointing=checkpointing))
        pmodel.train()
        torch.manual_seed(5)
        pmodel.train_step(IDS, IDS, num_items_in_batch=IDS[:, 1:].numel())
        grads.append({n: p.grad.clone() for n, p in pmodel.module.named_parameters()})
    worst = torch.tensor(max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank's gradients, not only those rank 0 writes
    return {"recompute_grad_diff": worst.item()}


def main() -> None:
    dist.init_process_group("gloo")
    out = Path(sys.argv[1])
    results = {"tp2-nosp": mask_case(sp=False), "tp2-sp": mask_case(sp=True), "recompute": recompute_case()}
    if dist.get_rank() == 0:
        (out / "dropout.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
