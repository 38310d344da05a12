"""Worker: expert parallelism against one process, with the router's load-balancing loss on. World of 2 or 4.

``python ep_parity.py OUT WORLD``. Each case builds a tiny MoE model (the generic adapter's tiny config) with
``output_router_logits`` on where the family has an aux loss, trains 3 AdamW steps (the kit's lr and eps) through
plait at an ep layout and compares the loss and every gradient shard with transformers' own training loss on
one process (the moe_aux worker's reference and optimizer step). Every rank writes ``rank<R>.json`` ({case: record}), so the
test checks every ep rank's experts, not one rank's. Besides parity:
* ``norm``: the global gradient norm of ``OptimizerStep`` without ZeRO (expert squares summed over the ep group)
  equals the reference's total norm;
* ``capacity``: a capacity factor that drops pairs drops exactly the pairs over each expert's capacity on each
  rank (counted by hand from the reference router), and a factor that drops none keeps parity.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_aux_worker import model_config, reference_loss, step_after_sync
from plait.base import comm
from plait.base.config import ParallelConfig
from plait.optim import OptimizerStep
from plait.parallelize import parallelize
from plait.testing.conformance_modes import ADAM_EPS, BATCH, LOSS_RTOL, LR, SEQ, STEPS, load_subject
from plait.testing.conformance_worker import Record, compare_grads, perturb, reference_grads

HAS_AUX = {"mixtral", "qwen3_moe", "gpt_oss", "olmoe"}  # deepseek_v3 balances with a bias, not a loss
# llama4_text: expert-major experts (every expert on every token, weighted before them), no aux loss
# dbrx: its own experts module (DbrxExperts: routed, w1 / v1 / w2 [experts * ffn, hidden]), run without its aux loss
# tp cases without ep run on qwen3_moe: mixtral's fp32 noise under tp passes the kit's tolerance at step 2-3
# under AdamW (tests/test_generic_conformance.py's FP32_SENSITIVE), ep itself adds none (its cases pass here)
CASES = {
    2: [(arch, "ep2", dict(ep=2)) for arch in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe", "dbrx",
                                               "llama4_text")]
    + [("qwen3_moe", "ep2-zero1", dict(ep=2, zero_1=True)), ("mixtral", "cp2-ep2", dict(cp=2, ep=2)),
       ("mixtral", "ep2-recompute-microbatches2", dict(ep=2, gradient_checkpointing=True, num_microbatches=2)),
       ("mixtral", "ep2-capacity-no-drop", dict(ep=2, moe_capacity_factor=100.0)),
       ("qwen3_moe", "ep2-zero3", dict(ep=2, zero_stage=3)), ("dbrx", "ep2-zero2", dict(ep=2, zero_stage=2)),
       ("qwen3_moe", "cp2-ep2-zero3", dict(cp=2, ep=2, zero_stage=3)),
       ("qwen3_moe", "tp2-whole-experts", dict(tp=2, sp=True, expert_tensor_parallel=False)),
       ("gpt_oss", "tp2-nosp-whole-experts", dict(tp=2, sp=False, expert_tensor_parallel=False))],
    4: [("mixtral", "ep2-tp2", dict(ep=2, tp=2, sp=True)), ("qwen3_moe", "ep2-dp4-zero1", dict(ep=2, zero_1=True)),
        ("mixtral", "ep4", dict(ep=4)), ("llama4_text", "ep4", dict(ep=4)),
        ("qwen3_moe", "ep2-dp4-zero3", dict(ep=2, zero_stage=3)),
        ("llama4_text", "ep2-tp2-zero2", dict(ep=2, tp=2, sp=True, zero_stage=2)),
        ("qwen3_moe", "ep2-pp2-zero3", dict(ep=2, pp=2, num_microbatches=2, zero_stage=3)),
        ("qwen3_moe", "ep2-pp2", dict(ep=2, pp=2, num_microbatches=2)),
        ("qwen3_moe", "ep2-tp2-whole-experts", dict(ep=2, tp=2, sp=True, expert_tensor_parallel=False)),
        ("mixtral", "ep2-tp2-nosp-whole-experts", dict(ep=2, tp=2, sp=False, expert_tensor_parallel=False))],
}


def config_of(arch: str):
    if arch in HAS_AUX:
        return model_config(arch)
    return copy.deepcopy(load_subject(f"transformers:{arch}").config)


def run_case(arch: str, layout: dict) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config_of(arch))
    perturb(reference)
    record = Record([name for name, _ in reference.named_parameters()])
    record.values["aux_share"] = 0.0
    pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(**layout))
    mesh, forwards = pmodel.mesh, pmodel.mesh.dp * pmodel.config.num_microbatches
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=ADAM_EPS)  # the kit's optimizer
    optimizer_step = step_after_sync(pmodel, torch.optim.AdamW, lr=LR, eps=ADAM_EPS)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, reference.config.vocab_size, (BATCH * mesh.dp, SEQ), generator=gen)
        if arch in HAS_AUX:
            ref_loss, aux_share = reference_loss(reference, ids, forwards)
            record.worst("aux_share", aux_share)
        else:
            ref_loss = torch.stack([reference(input_ids=c, labels=c, use_cache=False).loss
                                    for c in ids.chunk(forwards)]).mean()
        ref_loss.backward()
        local = ids.chunk(mesh.dp)[mesh.dp_rank]
        loss = pmodel.train_step(local, labels=local, num_items_in_batch=ids.shape[0] * (SEQ - 1)).detach()
        global_loss = comm.all_reduce(loss.clone(), mesh.replica_group).item()
        rel = abs(global_loss - ref_loss.item()) / abs(ref_loss.item())
        record.worst("loss_rel", rel)
        if rel > LOSS_RTOL:
            record.fail(f"step {step} loss {global_loss:.6f} vs {ref_loss.item():.6f}: rel err {rel:.2e}")
        compare_grads(record, step, pmodel, reference_grads(reference), optimizer_step(record, step))
        ref_opt.step()
        ref_opt.zero_grad()
    record.values["experts_held"] = sum(p.numel() for n, p in pmodel.module.named_parameters() if "experts" in n)
    return record.json()


def norm_case() -> dict:
    """OptimizerStep's global norm at ep=2 without ZeRO against the one-process total norm."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config_of("mixtral"))
    perturb(reference)
    pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(ep=2))
    ids = torch.randint(0, reference.config.vocab_size, (BATCH * 2, SEQ), generator=torch.Generator().manual_seed(1))
    reference_loss(reference, ids, 2)[0].backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None]).item()
    local = ids.chunk(2)[pmodel.mesh.dp_rank]
    pmodel.train_step(local, labels=local, num_items_in_batch=ids.shape[0] * (SEQ - 1))
    norm = OptimizerStep(pmodel.grad_sync, torch.optim.SGD(pmodel.parameters(), lr=0.0))().item()
    return {"norm": norm, "expected": expected}


def capacity_case() -> dict:
    """Pairs dropped by a capacity factor of 0.5: counted by hand from the routing the experts receive on each
    rank, against what the dispatch dropped and what the step's routing metrics report (summed over ranks)."""
    from transformers import AutoModelForCausalLM

    from plait.run.moe_metrics import RoutingMetrics

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config_of("mixtral"))
    perturb(reference)
    factor, experts = 0.5, reference.config.num_local_experts
    pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(ep=2, moe_capacity_factor=factor))
    ids = torch.randint(0, reference.config.vocab_size, (BATCH * 2, SEQ), generator=torch.Generator().manual_seed(1))
    local = ids.chunk(2)[pmodel.mesh.dp_rank]
    expected = torch.zeros((), dtype=torch.long)

    def count(module, args):  # the routing this rank's dispatch receives
        capacity = math.ceil(factor * args[1].numel() / experts)
        expected.add_((torch.bincount(args[1].reshape(-1), minlength=experts) - capacity).clamp(min=0).sum())

    for name in pmodel.plan.ep.modules:
        pmodel.module.get_submodule(name).register_forward_pre_hook(count)
    routing = RoutingMetrics.install(pmodel)
    loss = pmodel(local, labels=local)  # a training forward: counted (no backward needed)
    dropped = sum(d.dropped for d in pmodel.experts.dispatches)
    reported = routing.take().dropped
    return {"dropped": dropped, "expected": int(expected), "reported": reported,
            "expected_total": int(comm.all_reduce(expected.clone(), comm.world_group())), "finite": math.isfinite(loss.item())}


def main() -> None:
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    results = {f"{arch}|{name}": run_case(arch, layout) for arch, name, layout in CASES[world]}
    if world == 2:
        results["norm"] = norm_case()
        results["capacity"] = capacity_case()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
