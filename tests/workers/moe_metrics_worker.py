"""Worker: a step's MoE routing counts and aux loss under plait's layouts (world of 2) against one process's.

The reference is the unparallelised model's own router on the step's whole global batch: transformers' recorded
router logits (``output_router_logits``), their top-k experts counted by hand; its aux loss is transformers' per
forward, averaged over the forwards the layout runs (one per microbatch per dp rank), times the coefficient. Each
case runs one ``train_step`` and ``RoutingMetrics.take()``; rank 0 writes ``moe_metrics.json``: {case: record}.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from plait.base.config import ParallelConfig
from plait.parallelize import parallelize
from plait.run.moe_metrics import RoutingMetrics
from plait.testing.conformance_modes import load_subject

# Each layout splits the routing differently: dp and cp ranks route different tokens, tp ranks the same ones
# (their counts must not add up) or under SP their own sequence shards, pp ranks different layers (and torch's
# schedule runs each stage once more to learn shapes); recompute runs each layer's forward twice.
LAYOUTS = {
    "dp2": dict(), "tp2-sp-recompute": dict(tp=2, sp=True, gradient_checkpointing=True), "tp2": dict(tp=2, sp=False),
    "cp2": dict(cp=2), "pp2": dict(pp=2, num_microbatches=2), "ep2": dict(ep=2),
}
# the layouts on one architecture, the sequence-sharded one on a second (tests/test_moe_metrics.py runs both
# architectures on one process)
CASES = [*(f"mixtral|{name}" for name in LAYOUTS), "qwen3_moe|tp2-sp-recompute"]
COEF = 0.5
ROWS, SEQ = 4, 16  # the global batch


def build(arch: str, layout: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The reference model and a parallelised copy; the aux loss on wherever plait allows it (not under pp)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(load_subject(f"transformers:{arch}").config)
    config.output_router_logits, config.router_aux_loss_coef = layout.get("pp", 1) == 1, COEF
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    return reference, parallelize(copy.deepcopy(reference), ParallelConfig(**layout))


@torch.no_grad()
def hand_count(model: torch.nn.Module, ids: torch.Tensor) -> list[list[int]]:
    """Per MoE layer, the tokens of ``ids`` the model's own router sends to each expert (top-k of its logits)."""
    out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    k = model.config.num_experts_per_tok
    return [torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=logits.shape[-1]).tolist()
            for logits in out.router_logits]


@torch.no_grad()
def reference_aux(model: torch.nn.Module, ids: torch.Tensor, forwards: int) -> float:
    """transformers' aux loss times its coefficient, averaged over ``forwards`` equal chunks of ``ids``."""
    losses = [model(input_ids=chunk, output_router_logits=True, use_cache=False).aux_loss
              for chunk in ids.chunk(forwards)]
    return COEF * torch.stack(losses).mean().item()


def run_case(arch: str, layout: dict) -> dict:
    reference, pmodel = build(arch, layout)
    routing = RoutingMetrics.install(pmodel)
    mesh = pmodel.mesh
    ids = torch.randint(0, reference.config.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    local = ids.chunk(mesh.dp)[mesh.dp_rank]
    pmodel.train_step(local, labels=local, num_items_in_batch=ROWS * (SEQ - 1))
    step = routing.take()
    record = {"names": step.names, "tokens": [t.tolist() for t in step.tokens], "expected": hand_count(reference, ids),
              "aux_loss": step.aux_loss, "expected_aux": None}
    if reference.config.output_router_logits:
        record["expected_aux"] = reference_aux(reference, ids, mesh.dp * pmodel.config.num_microbatches)
    return record


def main() -> None:
    dist.init_process_group("gloo")
    results = {case: run_case(case.split("|")[0], LAYOUTS[case.split("|")[1]]) for case in CASES}
    if dist.get_rank() == 0:
        (Path(sys.argv[1]) / "moe_metrics.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
