"""Worker: context-parallel parity against one process, many cases in one world.

Run by tests/test_cp_parity.py through plait.testing.launch. For each case every rank trains the same tiny
model twice for 3 AdamW steps: as plain transformers (the reference, whole sequences) and through plait at
the case's layout; at every step it compares the loss and every gradient this rank steps on (its tp slice,
pipeline stage, ZeRO-1 share or ZeRO-2/3 rows) with the same slice of the reference's, at the conformance
kit's tolerance, and records the names it compared, so the test can check that the ranks together compared
every parameter at every step. Batches: plain causal, packed documents (position ids restarting, documents
that cross the slice boundaries and one longer than a slice, labels cut at each document's end as SFT packing
does), or right padding (an attention mask). Each case runs in float32, or in float64 where FLOAT64 says fp32
rounding was measured to be what exceeds the tolerance; an fp32 case whose failures over the ranks are shaped like
that rounding (gradients only, from step 2 on: ``plait.testing.noise.noise_shaped``) runs again in float64, which
decides, its fp32 failures kept as a note (another machine's kernels round differently: gemma3_text-cp2-ring was
1.45x the tolerance at step 2 on an AMD EPYC, within it on an Intel Xeon). One JSON file per rank: {case: result}.

    cp_parity.py OUT_DIR [CASE,CASE...] [--dtype float32|float64]

runs this world size's cases (all, or those named); --dtype runs them all in that dtype (to measure FLOAT64).
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.gemma2 import modeling_gemma2

from plait.base import comm
from plait.base.config import ParallelConfig
from plait.cp import ring
from plait.optim.step import OptimizerStep, build_optimizer
from plait.parallel.fsdp import local
from plait.parallelize import parallelize
from plait.testing.conformance_modes import ADAM_EPS, ATOL, LOSS_RTOL, LR, RTOL, load_subject, with_overrides
from plait.testing.conformance_worker import perturb
from plait.testing.noise import noise_shaped

STEPS, BATCH, SEQ = 3, 2, 32
GEMMA2_EAGER = modeling_gemma2.eager_attention_forward
TILE = ring.TILE
IGNORE = -100
# documents of a packed row (lengths sum to SEQ): at cp=2 slices are chunks of 8 tokens, at cp=4 of 4
PACKED = (5, 13, 3, 11)

# name -> (world, subject, ParallelConfig kwargs, model overrides, batch kind)
CASES = {
    "llama-cp2-ring-padded": (2, "llama", dict(cp=2, cp_attention="ring"), {}, "padded"),
    "llama-cp2-a2a-padded": (2, "llama", dict(cp=2, cp_attention="all-to-all"), {}, "padded"),
    "mistral-cp2-a2a-window-causal": (2, "mistral", dict(cp=2, cp_attention="all-to-all"), {}, "causal"),
    "gpt2-cp2-a2a-recompute": (2, "gpt2", dict(cp=2, gradient_checkpointing=True), {}, "causal"),
    "gpt2-cp2-ring-recompute": (2, "gpt2", dict(cp=2, cp_attention="ring", gradient_checkpointing=True), {}, "packed"),
    "llama-cp2-zero1": (2, "llama", dict(cp=2, zero_1=True), {}, "packed"),
    "llama-cp2-microbatches": (2, "llama", dict(cp=2, num_microbatches=2), {}, "packed"),
    "mistral-cp2-ring-tiled": (2, "mistral", dict(cp=2, cp_attention="ring"), {}, "packed"),  # TILE = 3 tokens
    "llama-cp2-a2a-eager-padded": (2, "llama", dict(cp=2, cp_attention="all-to-all"),
                                   {"_attn_implementation": "eager"}, "padded"),
    "mistral-cp2-a2a-eager-packed": (2, "mistral", dict(cp=2, cp_attention="all-to-all"),
                                     {"_attn_implementation": "eager"}, "packed"),
    "gpt_oss-cp2-ring-sinks": (2, "transformers:gpt_oss", dict(cp=2), {}, "packed"),
    "gemma3_text-cp2-ring": (2, "transformers:gemma3_text", dict(cp=2, cp_attention="ring"), {}, "packed"),
    "llama-cp2-tp2-sp-a2a": (4, "llama", dict(cp=2, tp=2, sp=True, cp_attention="all-to-all"), {}, "packed"),
    "llama-cp2-tp2-sp-ring": (4, "llama", dict(cp=2, tp=2, sp=True, cp_attention="ring"), {}, "packed"),
    "qwen3-cp2-tp2-a2a": (4, "transformers:qwen3", dict(cp=2, tp=2, sp=False), {}, "packed"),
    "llama-cp2-pp2-ring": (4, "llama", dict(cp=2, pp=2, num_microbatches=2, cp_attention="ring"), {}, "packed"),
    "llama-cp2-pp2-a2a": (4, "llama", dict(cp=2, pp=2, num_microbatches=2), {}, "causal"),
    "gpt2-cp2-pp2-interleaved-ring": (4, "gpt2", dict(cp=2, pp=2, num_microbatches=2, cp_attention="ring",
                                                      pipeline_schedule="interleaved-1f1b", virtual_pipeline_size=2),
                                      {}, "packed"),
    "llama-cp2-dp2-zero1": (4, "llama", dict(cp=2, zero_1=True), {}, "packed"),
    "llama-cp2-pp2-zero-bubble-ring": (4, "llama", dict(cp=2, pp=2, num_microbatches=2, cp_attention="ring",
                                                       pipeline_schedule="zero-bubble", virtual_pipeline_size=2),
                                       {}, "packed"),
    "llama-cp2-pp2-gpipe-a2a": (4, "llama", dict(cp=2, pp=2, num_microbatches=2, pipeline_schedule="gpipe"), {},
                                "padded"),
    # ZeRO-2/3 (FSDP2) shard over the dp x cp ranks: each rank compares the rows it holds. ZeRO-2 with 2
    # microbatches: parameters stay gathered across them, gradients reduce-scattered after each backward
    "llama-cp2-dp2-zero2-ring": (4, "llama", dict(cp=2, zero_stage=2, num_microbatches=2, cp_attention="ring"), {},
                                 "packed"),
    "llama-cp2-dp2-zero3-a2a": (4, "llama", dict(cp=2, zero_stage=3, cp_attention="all-to-all"), {}, "padded"),
}
# the architectures at cp=2 and cp=4, both strategies, on packed documents that cross the slices
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "gpt2": "gpt2", "gemma2": "transformers:gemma2",
                 "qwen3": "transformers:qwen3", "phi3": "transformers:phi3", "mixtral": "transformers:mixtral",
                 "deepseek_v3": "transformers:deepseek_v3"}
# MLA gives every query head its own key and value (DeepSeek-V3: 128 and 128); with the tiny config's 2 kv heads
# for 4 query heads, transformers' own sdpa path repeats the keys to 8 heads under any mask and fails
OVERRIDES = {"deepseek_v3": dict(num_key_value_heads=4)}
# cp=4 (four slices, a ring of four hops) is the same machinery for every architecture; it runs on those whose
# attention differs (llama's GQA, mistral's window, gpt2's learned positions, gemma2's soft-capped eager attention,
# mixtral's experts, deepseek_v3's latent attention). Qwen3's and Phi3's attention is llama's once q/k are projected
# (per-head norms and a fused qkv act on each token before it): they run both strategies at cp=2 only, and qwen3 at
# cp2 x tp2 above.
CP4_LEFT_OUT = ("qwen3", "phi3")
for _arch, _ref in ARCHITECTURES.items():
    for _cp in (2,) if _arch in CP4_LEFT_OUT else (2, 4):
        for _strategy, _short in (("all-to-all", "a2a"), ("ring", "ring")):
            CASES[f"{_arch}-cp{_cp}-{_short}-packed"] = (_cp, _ref, dict(cp=_cp, cp_attention=_strategy),
                                                         OVERRIDES.get(_arch, {}), "packed")


# Cases run in float64 (each case runs once, in one dtype): those where fp32 rounding, which Adam amplifies from step
# 2 on (an update is about lr * sign(grad) whatever the gradient's size, so rounding turns the smallest ones), exceeds
# the tolerance or comes within 2x of it (another machine's kernels round differently). Measured (CPU, gloo, every
# case both ways): the worst gradient over the ranks, in multiples of the tolerance, at steps 1 2 3. The 45 other
# cases stay within 0.36 in fp32 at every step (and within 0.03 in float64).
FLOAT64 = {
    "llama-cp2-ring-padded": "fp32 0.02 0.59 0.86 | float64 0.000 0.000 0.000",
    "qwen3-cp2-ring-packed": "fp32 0.06 1.22 0.73 | float64 0.000 0.000 0.000",
    "qwen3-cp2-tp2-a2a": "fp32 0.05 0.92 0.54 | float64 0.000 0.000 0.000",
    "gemma2-cp4-a2a-packed": "fp32 0.02 1.26 1.80 | float64 0.003 0.002 0.002",
    # float64 with transformers' own gemma2 attention: 0.055 0.79 1.15 (cp2), 0.055 0.79 1.13 (cp4); see GEMMA2
    "gemma2-cp2-ring-packed": "fp32 0.10 1.23 1.55 | float64 0.002 0.025 0.029",
    "gemma2-cp4-ring-packed": "fp32 0.12 1.59 2.01 | float64 0.003 0.002 0.002",
}


def gemma2_eager_in_dtype(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **_):
    """GEMMA2: transformers' gemma2 eager attention (its only one: sdpa takes no soft-cap) with the softmax in the
    inputs' dtype. Its own takes the softmax in fp32 even in a float64 model, so the float64 reference keeps fp32
    rounding that the ring (float64 throughout) does not: 1.13-1.15x the tolerance at step 3 in float64 (FLOAT64).
    The all-to-all runs the model's eager function itself, so both sides round alike there."""
    assert not dropout, "the tiny config has no attention dropout"
    groups = module.num_key_value_groups  # read when called: the all-to-all sets it for its heads
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (module.head_dim ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def batch(kind: str, rows: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, SEQ), generator=gen)
    labels = ids.clone()
    out = {"input_ids": ids}
    if kind == "packed":
        positions, end = [], 0
        for length in PACKED:
            positions.append(torch.arange(length))
            end += length
            if end < SEQ:
                labels[:, end] = IGNORE  # the first token of a document is not predicted from the last one
        out["position_ids"] = torch.cat(positions).expand(rows, SEQ).contiguous()
    elif kind == "padded":
        mask = torch.ones(rows, SEQ, dtype=torch.long)
        mask[0, SEQ - 7:] = 0
        labels[mask == 0] = IGNORE
        out["attention_mask"] = mask
    out["labels"] = labels
    return out


def reference_loss(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    kwargs = {k: v for k, v in inputs.items() if k != "labels"}
    logits = model(**kwargs, use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    labels = inputs["labels"][:, 1:].reshape(-1)
    total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels, ignore_index=IGNORE, reduction="sum")
    count = int((labels != IGNORE).sum())
    return total / count, count


@functools.cache
def subject_of(arch: str):
    """The adapter and tiny config of ``arch``, loaded once per rank: every case of it copies the config
    (``with_overrides``) and lays out its own model, as the conformance kit's worker keeps one per subject."""
    return load_subject(arch)


def run_case(name: str, dtype: torch.dtype) -> dict:
    """One case at ``dtype``: its worst errors, its failures (each naming the step and parameter), and per step
    the parameters (full names) whose gradients this rank compared."""
    ring.TILE = 3 if name.endswith("-tiled") else TILE  # tiles that do not divide a chunk, some empty
    _, arch, layout, overrides, kind = CASES[name]
    subject = subject_of(arch)
    config = with_overrides(subject.config, overrides)
    if dtype == torch.float64 and hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # torch's grouped matmul (the default) takes no float64
    # gemma2 in float64: its attention (the reference's, and the all-to-all's inner one) in float64 (GEMMA2)
    modeling_gemma2.eager_attention_forward = gemma2_eager_in_dtype if dtype == torch.float64 else GEMMA2_EAGER
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).to(dtype)
    perturb(reference)
    pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(**layout), registry=subject.registry)
    mesh = pmodel.mesh
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=ADAM_EPS)
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=LR, eps=ADAM_EPS)
    step_fn = OptimizerStep(pmodel.grad_sync, optimizer)
    # the parameters this rank steps on: all it holds, or its ZeRO-1 share (the owners of the others check them)
    owned = {id(p) for p in getattr(optimizer, "owned_params", pmodel.parameters())}
    named = [(n, p) for n, p in pmodel.module.named_parameters() if id(p) in owned or not p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    result = {"dtype": str(dtype).removeprefix("torch."), "loss_rel": 0.0, "grad_tol": [0.0] * STEPS,
              "checked": [[] for _ in range(STEPS)], "failures": [],
              "coords": f"dp {mesh.dp_rank} cp {mesh.cp_rank} tp {mesh.tp_rank} pp {mesh.pp_rank}",
              "parameters": [n for n, _ in reference.named_parameters()],
              "aliases": [n for n, _ in reference.named_parameters(remove_duplicate=False)]}
    failures = result["failures"]
    for step in range(1, STEPS + 1):
        inputs = batch(kind, BATCH * mesh.dp, reference.config.vocab_size, gen)
        ref_loss, count = reference_loss(reference, inputs)
        ref_loss.backward()
        chunk = {k: v.chunk(mesh.dp)[mesh.dp_rank] for k, v in inputs.items()}
        loss = pmodel.train_step(chunk["input_ids"], chunk["labels"], chunk.get("attention_mask"), count,
                                 chunk.get("position_ids"))
        loss = comm.all_reduce(loss.detach().clone(), mesh.replica_group).item()
        rel = abs(loss - ref_loss.item()) / abs(ref_loss.item())
        result["loss_rel"] = max(result["loss_rel"], rel)
        if rel > LOSS_RTOL:
            failures.append(f"step {step} loss {loss:.6f} vs {ref_loss.item():.6f} (rel {rel:.2e})")
        seen: dict[str, torch.Tensor | None] = {}
        inner = optimizer.step

        def reading(*args, **kwargs):  # the gradients each rank steps on: after every reduction
            seen.update({n: None if p.grad is None else local(p.grad).detach().clone() for n, p in named})
            return inner(*args, **kwargs)

        optimizer.step = reading
        step_fn()
        del optimizer.step
        for pname, grad in seen.items():
            full = reference.get_parameter(pname).grad
            if grad is None or full is None:  # compared only when neither has one (unused by the forward)
                if grad is not None or full is not None:
                    failures.append(f"step {step} grad {pname}: {'plait' if grad is None else 'the reference'} "
                                    f"has none")
                else:
                    result["checked"][step - 1].append(pname)
                continue
            expected = pmodel.param_specs[pname].slice_full(full)
            if expected.numel() == 0:  # ZeRO-3: a parameter too small to give this rank rows; another checks it
                continue
            diff = (grad - expected).abs()
            tol = (diff / (ATOL + RTOL * expected.abs())).max().item()
            result["grad_tol"][step - 1] = max(result["grad_tol"][step - 1], tol)
            result["checked"][step - 1].append(pname)
            if tol > 1:
                failures.append(f"step {step} grad {pname}: max |diff| {diff.max().item():.2e} "
                                f"({tol:.2f}x tolerance)")
        ref_opt.step()
        ref_opt.zero_grad()
    if mesh.pp == 1 and mesh.dp == 1:  # forward(): each cp rank's share of the loss, normalised by the whole batch
        with torch.no_grad():
            inputs = batch(kind, BATCH, reference.config.vocab_size, gen)
            ref_loss, _ = reference_loss(reference, inputs)
            share = pmodel(inputs["input_ids"], labels=inputs["labels"], attention_mask=inputs.get("attention_mask"),
                           position_ids=inputs.get("position_ids"))
            loss = comm.all_reduce(share.clone(), mesh.cp_group).item()
        if abs(loss - ref_loss.item()) > LOSS_RTOL * abs(ref_loss.item()):
            failures.append(f"forward() loss summed over cp {loss:.6f} vs {ref_loss.item():.6f}")
    return result


def decided(name: str, dtype: torch.dtype, recheck: bool) -> dict:
    """``run_case`` at ``dtype``; where ``recheck`` and the fp32 failures of every rank are noise-shaped, the case
    again in float64, whose result stands (with ``fp32_failures``: this rank's fp32 ones). Failures are cut to 10."""
    result = run_case(name, dtype)
    everyone = comm.all_gather_object(result["failures"], comm.world_group())
    if recheck and dtype == torch.float32 and noise_shaped([f for failures in everyone for f in failures]):
        result = {**run_case(name, torch.float64), "fp32_failures": result["failures"][:10]}
    failures = result["failures"]
    result["failures"], result["more_failures"] = failures[:10], max(0, len(failures) - 10)
    return result


def main() -> None:
    args = sys.argv[1:]
    forced = args.pop(args.index("--dtype") + 1) if "--dtype" in args else None
    if "--dtype" in args:
        args.remove("--dtype")
    out_dir = Path(args[0])
    only = args[1].split(",") if len(args) > 1 else None
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results: dict[str, dict] = {}
    for name, (case_world, *_) in CASES.items():
        if case_world != world or (only and name not in only):
            continue
        dtype = getattr(torch, forced) if forced else torch.float64 if name in FLOAT64 else torch.float32
        # A case that raises ends the world (not carried on to the next case): on one rank it may have left the
        # others inside a collective, so the launcher stops every rank and shows the traceback.
        results[name] = decided(name, dtype, recheck=forced is None)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
