"""Worker for tests/test_pipeline.py: many pipeline checks in one gloo world.

argv: <out.json> <world tag: w2 | w4>. Each check builds the same tiny model on every rank (same seed),
trains a plain transformers + torch copy of it on the full batch as the reference, and the plait layout
on this rank's share, for 3 AdamW steps with fp32. Results go to rank 0, which writes
{check: [per-rank result dict]}. A failure inside plait raises (the launcher stops the world).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import (
    DeepseekV4Config, DeepseekV4ForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig, GPT2Config, GPT2LMHeadModel,
    HYV4Config, HYV4ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Zamba2Config,
    Zamba2ForCausalLM,
)

sys.path.insert(0, str(Path(__file__).parent))
from tiny_decoder import TinyAdapter, TinyConfig, TinyDecoder  # noqa: E402

from plait import ConfigError, ParallelConfig, Registry, parallelize  # noqa: E402
from plait.checkpoint.gather import gather_full  # noqa: E402
from plait.layout_plan import pipeline_layout  # noqa: E402
from plait.optim.clip import global_grad_norm  # noqa: E402
from plait.pipeline import stages_of_rank  # noqa: E402
from plait.pipeline.stages import is_placeholder  # noqa: E402
from plait.testing.conformance_worker import Float64Throughout  # noqa: E402

VOCAB, BATCH, SEQ, STEPS = 61, 8, 16, 3
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
FLOAT64 = {"gemma4"}  # built in float64 (build), run in float64 throughout (parity)


def build(arch: str, attn: str = "sdpa", device: str = "cpu"):
    torch.manual_seed(1234)
    with torch.device(device):
        if arch in ("llama", "llama_tied"):
            return LlamaForCausalLM(LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=arch == "llama_tied",
                attn_implementation=attn, **TOKENS))
        if arch == "mistral":
            return MistralForCausalLM(MistralConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, sliding_window=8, attn_implementation=attn,
                **TOKENS))
        if arch == "gpt2":
            return GPT2LMHeadModel(GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, attn_implementation=attn, **TOKENS))
        if arch == "custom":
            return TinyDecoder(TinyConfig(vocab_size=VOCAB))
        if arch == "gemma4":  # per-layer embeddings: every stage computes them from the token ids
            # float64 (throughout: FLOAT64): Adam amplifies this tiny model's fp32 reordering noise past the gradient
            # tolerance by step 2
            return Gemma4ForCausalLM(Gemma4TextConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"] * 2, vocab_size_per_layer_input=VOCAB,
                hidden_size_per_layer_input=8, attn_implementation=attn, **TOKENS)).double()
        if arch == "deepseek_v4":  # hash routing by token id in layers 0 and 2: every stage gets the token ids
            return DeepseekV4ForCausalLM(DeepseekV4Config(
                vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
                max_position_embeddings=64, sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=4,
                index_head_dim=8, qk_rope_head_dim=4, mlp_layer_types=["hash_moe", "moe"] * 2,
                layer_types=["heavily_compressed_attention", "compressed_sparse_attention"] * 2,
                attn_implementation="eager", **TOKENS))  # its only one
        if arch == "hy_v4":  # "shared" indexer layers reuse the previous layer's top-k indices (prev_topk_indices)
            return HYV4ForCausalLM(HYV4Config(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=4, head_dim=4, max_position_embeddings=64,
                n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=4,
                qk_rope_head_dim=4, v_head_dim=8, mlp_layer_types=["dense", "sparse"] * 2,
                layer_types=["indexed_attention"] * 4, index_head_dim=8, index_n_heads=4,
                indexer_types=["full", "shared"] * 2, attn_implementation="eager", **TOKENS))
        if arch == "zamba2":  # one transformer block shared by layers 1 and 3, with a LoRA adapter per use
            return Zamba2ForCausalLM(Zamba2Config(
                vocab_size=VOCAB, max_position_embeddings=64, hidden_size=32, num_hidden_layers=4,
                layers_block_type=["linear_attention", "hybrid"] * 2, mamba_d_state=8, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, attention_hidden_size=64, attention_head_dim=8,
                mamba_headdim=8, kv_channels=8, num_query_groups=4, hybrid_layer_ids=[1, 3], attn_implementation=attn,
                **TOKENS))
    raise ValueError(arch)


def batch(step: int, padding: bool):
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padding:  # left padding: without the padding mask on every stage, real tokens would attend to it
        for row, pad in ((0, 5), (3, 3), (6, 9)):
            mask[row, :pad] = 0
        ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, labels, (mask if padding else None)


def reference_loss(model, ids, labels, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least, as plait's loss
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def registry_for(arch: str) -> Registry | None:
    if arch != "custom":
        return None
    registry = Registry(autoload=False)
    registry.register(TinyAdapter())
    return registry


def parity(arch: str, layout: dict, padding: bool = False, attn: str = "sdpa") -> dict:
    """3 AdamW steps of plait vs the reference: per-step loss and gradient errors, final parameter errors. A float64
    model runs float64 throughout, as the conformance kit's recheck does: transformers computes its norms in fp32
    even in a float64 model, and Adam grew that rounding past the gradient tolerance by step 3 under
    ATEN_CPU_CAPABILITY=default (gemma4: 1.98e-06 against atol 1e-06)."""
    with Float64Throughout() if arch in FLOAT64 else contextlib.nullcontext():
        return _parity(arch, layout, padding, attn)


def _parity(arch: str, layout: dict, padding: bool, attn: str) -> dict:
    model = build(arch, attn)
    ref = copy.deepcopy(model)
    pm = parallelize(model, ParallelConfig(**layout), registry=registry_for(arch))
    mesh = pm.mesh
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    local = dict(pm.module.named_parameters())
    out = {"loss_rel": 0.0, "grad_abs": 0.0, "grads_close": True, "param_abs": 0.0, "norm_rel": 0.0, "losses": [],
           "checked": sorted(local), "parameters": sorted(name for name, _ in ref.named_parameters())}
    rows = BATCH // mesh.dp
    for step in range(STEPS):
        ids, labels, mask = batch(step, padding)
        ref_opt.zero_grad()
        ref_loss = reference_loss(ref, ids, labels, mask)
        ref_loss.backward()
        mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
        num_items = int((labels[:, 1:] != -100).sum())
        loss = pm.train_step(ids[mine], labels[mine], None if mask is None else mask[mine], num_items)
        pm.grad_sync.finish()
        if mesh.dp_group is not None:
            dist.all_reduce(loss, group=mesh.dp_group)
        out["losses"].append([loss.item(), ref_loss.item()])
        # the global gradient norm counts every logical parameter once (a tied embedding too)
        norm = global_grad_norm(pm.grad_sync.norm_params, [mesh.tp_group, mesh.pp_group], torch.device("cpu"),
                                torch.promote_types(torch.float32, next(pm.parameters()).dtype))  # float64 model
        ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]))
        out["norm_rel"] = max(out["norm_rel"], abs(norm.item() - ref_norm.item()) / ref_norm.item())
        out["loss_rel"] = max(out["loss_rel"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        for name, param in local.items():
            expected = ref_params[name].grad
            if expected is None:  # unused by the forward (DeepSeek-V4's hash-routed layers' gate weights)
                out["grads_close"] &= param.grad is None
                continue
            full = gather_full(pm, name, param.grad)
            out["grad_abs"] = max(out["grad_abs"], (full - expected).abs().max().item())
            out["grads_close"] &= bool(torch.allclose(full, expected, rtol=1e-5, atol=1e-6))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
    for name, param in local.items():
        out["param_abs"] = max(out["param_abs"], (gather_full(pm, name, param) - ref_params[name]).abs().max().item())
    ids, labels, mask = batch(STEPS, padding)
    with torch.no_grad():
        ref_eval = reference_loss(ref, ids, labels, mask).item()
    mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    num_items = int((labels[:, 1:] != -100).sum())
    eval_loss = pm.eval_loss(ids[mine], labels[mine], None if mask is None else mask[mine], num_items)
    if mesh.dp_group is not None:
        dist.all_reduce(eval_loss, group=mesh.dp_group)
    out["eval_rel"] = abs(eval_loss.item() - ref_eval) / ref_eval
    out["tied_diff"] = tied_difference(pm)
    out["replicated_diff"] = replicated_difference(pm)
    out["stages"] = stages_of_rank(mesh.pp_rank, pm.config)
    return out


def tied_difference(pm) -> float | None:
    """Max difference between the tied weight's copies on the first and last stage (None if untied)."""
    names = [n for n in ("transformer.wte.weight", "model.embed_tokens.weight", "lm_head.weight")]
    local = dict(pm.module.named_parameters())
    mine = {n: gather_full(pm, n, local[n]) for n in names if n in local}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pm.mesh.dp_rank, pm.mesh.tp_rank, mine))
    if not pm.grad_sync.tied:
        return None
    copies = [t for dp, tp, held in everyone if (dp, tp) == (pm.mesh.dp_rank, pm.mesh.tp_rank) for t in held.values()]
    assert len(copies) == 2, f"expected the tied weight on two stages, found {len(copies)} copies"
    return (copies[0] - copies[1]).abs().max().item()


def meta_build(arch: str, layout: dict) -> dict:
    """Build on meta: non-owned modules hold nothing; after to_empty + loading the owned weights, parity."""
    model = build(arch, device="meta")
    config = ParallelConfig(**layout)
    rows = pipeline_layout(model, config)
    pm = parallelize(model, config)
    stages = stages_of_rank(pm.mesh.pp_rank, pm.config)
    owned = [name for name, stage, _ in rows if stage in stages]
    others = [name for name, stage, _ in rows if stage is not None and stage not in stages]
    pm.module.to_empty(device="cpu")
    held = sum(p.numel() * p.element_size() for p in pm.module.parameters())
    expected = sum(size for name, stage, size in rows if stage in stages)
    foreign = [n for n in others if not is_placeholder(pm.module.get_submodule(n))
               or any(True for _ in pm.module.get_submodule(n).parameters())]
    source = build(arch)
    ref = copy.deepcopy(source)
    weights = {**dict(source.named_parameters(remove_duplicate=False)), **dict(source.named_buffers())}
    with torch.no_grad():  # what a loader does: fill the owned tensors (rotary inv_freq included)
        for name, tensor in [*pm.module.named_parameters(), *pm.module.named_buffers()]:
            tensor.copy_(weights[name])
    ids, labels, _ = batch(0, False)
    loss = pm.train_step(ids, labels)
    ref_loss = reference_loss(ref, ids, labels, None)
    return {"owned": owned, "foreign_with_storage": foreign, "held_bytes": held, "layout_bytes": expected,
            "loss_rel": abs(loss.item() - ref_loss.item()) / ref_loss.item()}


def refusals() -> dict:
    """ConfigErrors raised on every rank before any collective; the world stays usable afterwards."""
    out = {}
    try:
        parallelize(build("llama"), ParallelConfig(pp=2, pipeline_schedule="interleaved-1f1b", num_microbatches=4))
    except ConfigError as e:
        out["parallelize"] = str(e)
    pm = parallelize(build("llama"), ParallelConfig(pp=2, num_microbatches=4))
    ids, labels, _ = batch(0, False)
    try:
        pm.train_step(ids[:6], labels[:6])
    except ConfigError as e:
        out["train_step"] = str(e)
    out["after"] = pm.train_step(ids, labels).item()
    return out


PP2 = dict(pp=2, num_microbatches=4)
def replicated_difference(pm) -> float | None:
    """Max difference between the copies every stage holds of the plan's every_stage modules (None if none)."""
    local = dict(pm.module.named_parameters())
    mine = {n: gather_full(pm, n, local[n]) for n in pm.plan.replicated if n in local}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pm.mesh.dp_rank, pm.mesh.tp_rank, mine))
    if not pm.plan.replicated:
        return None
    peers = [held for dp, tp, held in everyone if (dp, tp) == (pm.mesh.dp_rank, pm.mesh.tp_rank)]
    assert len(peers) == pm.mesh.pp and all(held.keys() == mine.keys() for held in peers), "a stage lacks a copy"
    return max((held[n] - mine[n]).abs().max().item() for held in peers for n in mine)


CHECKS = {
    "w2": {
        # The conformance kit (tests/test_conformance.py) trains the bundled adapters under pp2-1f1b (llama, gpt2,
        # mistral: its sliding window on every stage), pp2-interleaved-v2, pp2-tied and pp2-recompute (llama, gpt2)
        # against one process at every step; the checks here add eval, the global gradient norm, final parameters
        # and tied or every-stage copies, once per schedule and family: llama at 1f1b (and tied), gpt2 interleaved
        # (its position embedding on stage 0, its tied head on the last).
        "llama-1f1b": (parity, "llama", PP2),
        "gpt2-interleaved-v2": (parity, "gpt2", {**PP2, "virtual_pipeline_size": 2,
                                                 "pipeline_schedule": "interleaved-1f1b"}),
        "llama-gpipe": (parity, "llama", {**PP2, "pipeline_schedule": "gpipe"}),
        "gpt2-zero-bubble": (parity, "gpt2", {**PP2, "pipeline_schedule": "zero-bubble"}),
        "llama-zero-bubble-v2": (parity, "llama", {**PP2, "pipeline_schedule": "zero-bubble",
                                                   "virtual_pipeline_size": 2}),
        "llama-tied-1f1b": (parity, "llama_tied", PP2),
        "llama-user-cuts": (parity, "llama", {**PP2, "pipeline_cuts": ("model.layers.0",)}),
        "llama-eager-padding": (parity, "llama", PP2, True, "eager"),
        "gpt2-eager-padding-v2": (parity, "gpt2", {**PP2, "virtual_pipeline_size": 2,
                                                   "pipeline_schedule": "interleaved-1f1b"}, True, "eager"),
        "custom-fallback-padding": (parity, "custom", PP2, True),
        "gemma4-per-layer-inputs-1f1b": (parity, "gemma4", PP2),
        "gemma4-per-layer-inputs-interleaved-v2": (parity, "gemma4", {**PP2, "virtual_pipeline_size": 2,
                                                                     "pipeline_schedule": "interleaved-1f1b"}),
        "deepseek_v4-token-ids-1f1b": (parity, "deepseek_v4", PP2),
        # cut before a "shared" layer: stage 1's first layer attends with the top-k indices stage 0's last chose
        "hy_v4-carried-topk-1f1b": (parity, "hy_v4", {**PP2, "pipeline_cuts": ("model.layers.0",)}),
        # the shared block on both stages, each stage's adapter unused on the other: summed as tied copies
        "zamba2-shared-block-1f1b": (parity, "zamba2", PP2),
        "meta-llama": (meta_build, "llama", PP2),
        "refusals": (refusals,),
    },
    "w4": {
        "llama-tp2-pp2-sp": (parity, "llama", {**PP2, "tp": 2}),
        "llama-tp2-pp2-sp-interleaved": (parity, "llama", {**PP2, "tp": 2, "virtual_pipeline_size": 2,
                                                            "pipeline_schedule": "interleaved-1f1b"}),
        "gpt2-tp2-pp2-sp": (parity, "gpt2", {**PP2, "tp": 2}),
        "mistral-tp2-pp2-zero-bubble": (parity, "mistral", {**PP2, "tp": 2, "pipeline_schedule": "zero-bubble"}),
        "llama-pp2-dp2": (parity, "llama", PP2),
        "gpt2-pp4": (parity, "gpt2", {"pp": 4, "num_microbatches": 4}),
        "gemma4-per-layer-inputs-pp4": (parity, "gemma4", {"pp": 4, "num_microbatches": 4}),
    },
}


def main() -> None:
    out_path, world = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, (fn, *args) in CHECKS[world].items():
        results[name] = fn(*args)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {name: [r[name] for r in gathered] for name in results}
        Path(out_path).write_text(json.dumps(merged, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
