"""Worker: what each rank of several layouts holds, measured beside ``plait.costs``'s prediction.

Run as a world of 2 ranks: ``planner_worker.py OUT.json``. For each layout, a tiny Llama (tied embeddings,
vocab 61: padded under tp; one kv head: replicated under tp, its gradient summed, repeated by cp's
all-to-all; or a tiny Mixtral, its routed experts kept whole over tp) is laid out, its optimizer
built as ``plait train`` builds it, and two steps run; each rank records its parameter, gradient (after
backward) and optimizer bytes (after the step), the collectives ``plait.base.comm`` saw in the second step (the
first infers pipeline shapes), and the planner's numbers for that rank. Rank 0 writes them all.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, PretrainedConfig

from plait import ParallelConfig, parallelize
from plait.base.comm import count_collectives
from plait.base.meta import build_meta_model
from plait.costs.activations import trace_activations
from plait.costs.estimate import Batch, estimate_layout
from plait.costs.measure import gradient_bytes, optimizer_bytes, parameter_bytes
from plait.costs.memory import Precision
from plait.layout_plan import plan_layout
from plait.lora.config import lora_config
from plait.optim import OptimizerStep, build_optimizer
from plait.plugin.registry import default_registry

SEQ, BATCH = 16, 4
# name -> (layout, bf16 parameters, weight decay)
LAYOUTS = {
    "dp2_zero1_wd": (ParallelConfig(zero_1=True), False, 0.1),
    "dp2_zero1_bf16": (ParallelConfig(zero_1=True), True, 0.0),
    "pp2_bf16": (ParallelConfig(pp=2, num_microbatches=2), True, 0.0),
    "tp2_sp_recompute": (ParallelConfig(tp=2, gradient_checkpointing=True), False, 0.0),
    "tp2_nosp": (ParallelConfig(tp=2, sp=False), False, 0.0),
    # cp: one kv head repeated for all-to-all; ZeRO-1 and gradients over the replica group (dp x cp = 2)
    "cp2_zero1_wd": (ParallelConfig(cp=2, zero_1=True), False, 0.1),
    "cp2_ring_recompute": (ParallelConfig(cp=2, cp_attention="ring", gradient_checkpointing=True), False, 0.0),
    # LoRA (rank 4 on q, v): the base frozen, no gradient or optimizer state; ZeRO-1 shards the adapters' state
    "dp2_zero1_lora": (ParallelConfig(zero_1=True), False, 0.0),
    # ZeRO-2/3 (FSDP2): each rank's rows of every parameter, gradient and AdamW state; bf16 compute from fp32 shards
    "dp2_zero2_wd": (ParallelConfig(zero_stage=2), False, 0.1),
    "dp2_zero3_bf16": (ParallelConfig(zero_stage=3, mixed_precision=True), True, 0.0),
    "dp2_zero3_lora": (ParallelConfig(zero_stage=3), False, 0.0),
}
LORA = {"dp2_zero1_lora", "dp2_zero3_lora"}
# a tiny Mixtral whose experts are split over tp (their gathered input is not gathered again in backward), or kept
# whole: under SP no experts collectives, without SP a token share
MOE_LAYOUTS = {
    "moe_tp2_sp": (ParallelConfig(tp=2), False, 0.0),
    "moe_tp2_sp_whole_recompute": (ParallelConfig(tp=2, expert_tensor_parallel=False, gradient_checkpointing=True),
                                   False, 0.0),
    "moe_tp2_nosp_whole_recompute": (ParallelConfig(tp=2, sp=False, expert_tensor_parallel=False,
                                                    gradient_checkpointing=True), False, 0.0),
    # ZeRO-3 with ep: each rank's experts sharded over the ranks holding the same experts (here itself alone)
    "moe_ep2_zero3": (ParallelConfig(ep=2, zero_stage=3), False, 0.0),
}


# a tiny Llama 4 text model: expert-major experts (every token through every expert) in every layer, its shared
# expert beside them; split over tp (tokens gathered per expert under SP), divided over ep (whole blocks moved)
LLAMA4_LAYOUTS = {
    "llama4_ep2": (ParallelConfig(ep=2), False, 0.0),
    "llama4_tp2_sp_recompute": (ParallelConfig(tp=2, gradient_checkpointing=True), False, 0.0),
    "llama4_tp2_nosp": (ParallelConfig(tp=2, sp=False), False, 0.0),
}


def llama4_config() -> PretrainedConfig:
    from plait.testing.conformance_modes import load_subject

    config = load_subject("transformers:llama4_text").config
    config.vocab_size, config.max_position_embeddings = 61, SEQ
    return config


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                       max_position_embeddings=SEQ)


def moe_config() -> MixtralConfig:
    return MixtralConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=SEQ)


def run(name: str, config: ParallelConfig, bf16: bool, weight_decay: float, model_config: PretrainedConfig) -> dict:
    dtype = torch.bfloat16 if bf16 else torch.float32
    world, rank = dist.get_world_size(), dist.get_rank()
    registry = default_registry()
    meta = build_meta_model(model_config, dtype)
    lora = lora_config(4, 8.0, target_modules=["q_proj", "v_proj"]) if name in LORA else None
    plan = plan_layout(meta, config, world, registry, lora=lora)
    per_device = BATCH
    estimate = estimate_layout(meta, plan, Batch(per_device, SEQ), Precision(dtype, torch.float32),
                               trace_activations(meta, SEQ, registry, plan.adapter), weight_decay)
    predicted = estimate.for_rank(rank)
    torch.manual_seed(0)
    # under FSDP2's mixed precision the model (its shards) stays fp32 and computes in bf16
    model_dtype = torch.float32 if config.mixed_precision else dtype
    pmodel = parallelize(AutoModelForCausalLM.from_config(model_config).to(model_dtype), config, lora=lora)
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3, weight_decay=weight_decay,
                                optimizer_dtype=torch.float32)
    step = OptimizerStep(pmodel.grad_sync, optimizer, 1.0)
    # the same sequences on the ranks of a dp replica (a cp group splits them; tp ranks share them)
    ids = torch.randint(0, 61, (per_device, SEQ), generator=torch.Generator().manual_seed(pmodel.mesh.dp_rank))
    num_items = per_device * (SEQ - 1) * pmodel.mesh.dp
    pmodel.train_step(ids, ids, num_items_in_batch=num_items)  # warm-up: the pipeline infers shapes (a forward)
    step()
    with count_collectives() as counter:
        pmodel.train_step(ids, ids, num_items_in_batch=num_items)
        grads = gradient_bytes(pmodel)
        step()
    return {
        "measured": {"parameters": parameter_bytes(pmodel), "gradients": grads,
                     "optimizer": optimizer_bytes(optimizer)},
        "predicted": {"parameters": predicted.static.parameters, "gradients": predicted.static.gradients,
                      "optimizer": predicted.static.optimizer},
        "records": counter.records,
        "predicted_comm": [[op.group, op.op, op.count, op.bytes] for op in estimate.comm[predicted.pp_rank]],
        # the tp region entry's cached input (under SP a gathered sequence) must not outlive the step, which the
        # planner's peak assumes; recomputation re-enters it inside backward
        "entry_held_after_step": pmodel.applied.entry._last is not None,
    }


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = {name: run(name, *spec, model_config()) for name, spec in LAYOUTS.items()}
    results |= {name: run(name, *spec, moe_config()) for name, spec in MOE_LAYOUTS.items()}
    results |= {name: run(name, *spec, llama4_config()) for name, spec in LLAMA4_LAYOUTS.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
