"""Worker: the MoE router's load-balancing loss (``output_router_logits``) under plait's layouts, world of 2.

The reference is transformers' own training loss (``model(ids, labels=ids).loss``: cross-entropy plus
``router_aux_loss_coef`` times the aux loss of that forward) on one process, averaged over the forwards plait's
layout runs (one per microbatch per dp rank), which is what plait defines its loss to be. Each case trains
3 AdamW steps through the conformance kit's comparison; refusals are recorded as their messages. Rank 0
writes ``moe_aux.json``: {case: record}.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from plait.base import comm
from plait.base.config import ConfigError, ParallelConfig
from plait.parallelize import parallelize
from plait.testing.conformance_modes import BATCH, LOSS_RTOL, SEQ, STEPS, load_subject
from plait.testing.conformance_worker import Record, compare_grads, local_grads, perturb, reference_grads

LAYOUTS = {
    "tp2-sp": dict(tp=2, sp=True), "tp2": dict(tp=2, sp=False), "dp2": dict(tp=1),
    "zero1-dp2": dict(zero_1=True), "tp2-sp-recompute": dict(tp=2, sp=True, gradient_checkpointing=True),
    "tp2-sp-microbatches2": dict(tp=2, sp=True, num_microbatches=2),
    "cp2": dict(cp=2), "cp2-ring-microbatches2": dict(cp=2, cp_attention="ring", num_microbatches=2),
}
COEF = 0.5  # large, so that a dropped or mis-gathered aux loss is far outside the tolerance
# SGD, not the kit's AdamW: Adam divides by the root of tiny second moments and lifts mixtral's fp32 reordering
# noise past the gradient tolerance by step 2 (its step 1 is at 0.02x); SGD keeps later steps as exact as the
# first while still checking that the parameters stay in step.
LR = 0.1


def model_config(arch: str):
    config = copy.deepcopy(load_subject(f"transformers:{arch}").config)
    config.output_router_logits, config.router_aux_loss_coef = True, COEF
    return config


def reference_loss(model, ids: torch.Tensor, forwards: int) -> tuple[torch.Tensor, float]:
    """transformers' loss averaged over ``forwards`` equal chunks; and the share of it the aux loss makes."""
    losses, aux = [], []
    for chunk in ids.chunk(forwards):
        out = model(input_ids=chunk, labels=chunk, use_cache=False)
        losses.append(out.loss)
        aux.append(COEF * out.aux_loss.item())
    loss = torch.stack(losses).mean()
    return loss, sum(aux) / len(aux) / loss.item()


def run_case(arch: str, layout: dict) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(model_config(arch))
    perturb(reference)
    record = Record([name for name, _ in reference.named_parameters()])
    record.values["aux_share"] = None
    pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(**layout))
    mesh, forwards = pmodel.mesh, pmodel.mesh.dp * pmodel.config.num_microbatches
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    optimizer_step = step_after_sync(pmodel)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, reference.config.vocab_size, (BATCH * mesh.dp, SEQ), generator=gen)
        ref_loss, aux_share = reference_loss(reference, ids, forwards)
        ref_loss.backward()
        local = ids.chunk(mesh.dp)[mesh.dp_rank]
        loss = pmodel.train_step(local, labels=local, num_items_in_batch=ids.shape[0] * (SEQ - 1)).detach()
        global_loss = comm.all_reduce(loss.clone(), mesh.replica_group).item()  # dp rows, cp tokens
        rel = abs(global_loss - ref_loss.item()) / abs(ref_loss.item())
        record.worst("loss_rel", rel)
        record.worst("aux_share", aux_share)
        if rel > LOSS_RTOL:
            record.fail(f"step {step} loss {global_loss:.6f} vs {ref_loss.item():.6f}: rel err {rel:.2e}")
        compare_grads(record, step, pmodel, reference_grads(reference), optimizer_step(record, step))
        ref_opt.step()
        ref_opt.zero_grad()
    return record.json()


def step_after_sync(pmodel, optimizer_class=torch.optim.SGD, **kwargs):
    """An optimizer step after the gradient sync, returning the gradients it stepped on: plain SGD (or
    ``optimizer_class`` with ``kwargs``) on every local parameter, or plait's ZeRO-1 / ZeRO-2/3 step over it (its
    gradients read just before the inner step: under ZeRO-2/3 this rank's rows, as FSDP2 reduce-scattered them)."""
    from plait.optim import OptimizerStep, build_optimizer

    kwargs = kwargs or {"lr": LR}
    if not pmodel.config.zero_1 and not pmodel.config.fsdp:
        optimizer = optimizer_class(pmodel.parameters(), **kwargs)

        def plain(record: Record, step: int) -> dict:
            pmodel.grad_sync.finish()
            grads = local_grads(record, step, list(pmodel.module.named_parameters()))
            optimizer.step()
            optimizer.zero_grad()
            return grads

        return plain
    optimizer = build_optimizer(pmodel, optimizer_class, **kwargs)
    owned = {id(p) for p in getattr(optimizer, "owned_params", pmodel.parameters())}
    named = [(n, p) for n, p in pmodel.module.named_parameters() if id(p) in owned]
    run, inner = OptimizerStep(pmodel.grad_sync, optimizer), optimizer.step

    def zero(record: Record, step: int) -> dict:
        seen = {}

        def reading(*args, **kwargs):
            seen.update(local_grads(record, step, named))
            return inner(*args, **kwargs)

        optimizer.step = reading
        try:
            run()
        finally:
            optimizer.step = inner
        return seen

    return zero


def refusal(arch: str, layout: dict, mask: bool = False) -> str:
    """The message plait raises for ``layout`` (before any collective), or "" when it raises none."""
    from transformers import AutoModelForCausalLM

    try:
        pmodel = parallelize(AutoModelForCausalLM.from_config(model_config(arch)), ParallelConfig(**layout))
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        pmodel.train_step(ids, labels=ids, attention_mask=torch.ones_like(ids) if mask else None)
    except ConfigError as err:
        return str(err)
    return ""


def main() -> None:
    dist.init_process_group("gloo")
    out = Path(sys.argv[1])
    results: dict = {}
    for arch in ("mixtral", "qwen3_moe"):
        for name, layout in LAYOUTS.items():
            results[f"{arch}|{name}"] = run_case(arch, layout)
    results["refused|mask-sp"] = refusal("mixtral", dict(tp=2, sp=True), mask=True)
    results["refused|mask-cp"] = refusal("mixtral", dict(cp=2), mask=True)
    by_rank = comm.all_gather_object(results, comm.world_group())  # every rank's record: every ZeRO-1 owner
    if dist.get_rank() == 0:
        (out / "moe_aux.json").write_text(json.dumps({case: [r[case] for r in by_rank] for case in results}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
