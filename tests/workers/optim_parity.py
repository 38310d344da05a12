"""Worker: ZeRO-1, ZeRO-2/3 (FSDP2), clipping, accumulation, activation checkpointing and bf16 against one process.

Run as a world of tp*pp*dp ranks: ``optim_parity.py OUT.json TP PP [--float64 CHECK,...]``. Every variant trains a
copy of the same tiny Llama (tied embeddings, 4 q heads and 1 kv head, so tp=2 replicates the kv head) for STEPS
optimizer steps on the same global batches; the reference is plain transformers + torch AdamW on the whole global
batch in this process. Rank 0 writes, per check, the numbers the pytest module asserts on.

A parity check whose fp32 miss is shaped like reordering noise (``noise_shaped``: losses, norms and step 1's
gradients right, a later gradient or the final parameters off, which Adam grows from 1e-7 rounding) runs again in
float64 throughout (plait.testing.noise's rule), held to the float64 bounds; so does every check named after
``--float64``, so that this path runs on every machine. Where fp32 rounding lands depends on the CPU's kernels:
an Intel Xeon (AVX-512, AMX) under ATEN_CPU_CAPABILITY=default failed five of these fp32 checks at tp2_dp2, while an
AMD EPYC stayed within them in all three capabilities (BOUNDS). The kit's own rule (plait.testing.noise) reads its
notes' text and has no final-parameter check: this one reads the figures below.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from plait import ParallelConfig, parallelize
from plait.base import comm
from plait.checkpoint import load_checkpoint, save_checkpoint
from plait.data import local_microbatch
from plait.optim import OptimizerStep, Zero1Optimizer, build_optimizer
from plait.optim.param_groups import embedding_params, weight_decay_groups
from plait.parallel.fsdp import local
from plait.parallel.grad_sync import grad_of
from plait.testing.conformance_worker import Float64Throughout

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 5, 8, 16, 97
LR, WEIGHT_DECAY, SMALL_NORM = 1e-2, 0.1, 0.05
# Bounds per dtype: losses and norms relative; parameters after STEPS AdamW steps absolute (Adam divides each update
# by sqrt(v), so rounding in a near-zero gradient, tp's partial sums, moves a parameter by up to a fraction of lr);
# each step's stepped gradients in units of the kit's tolerance (1e-6 + 1e-5 |g|). Worst measured over every check
# of the 3 worlds under native, default and avx2 capability on an AMD EPYC (2026-12-02), fp32: losses and norms
# 1.8e-6, parameters 7.9e-6 (1.2e-5 at tp2_dp2 on an earlier machine), gradients 0.42 (0.023 at step 1); float64
# throughout: 3.5e-15, 4.0e-14, 2.0e-9.
BOUNDS = {"float32": {"loss": 1e-5, "param": 2e-5, "grad": 1.0},
          "float64": {"loss": 1e-13, "param": 1e-12, "grad": 5e-8}}


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                         max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=generator) < 0.2] = -100  # uneven token counts per rank
        batches.append((ids, labels))
    return batches


def num_items(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def reference(base: LlamaForCausalLM, batches, max_norm: float | None) -> dict:
    model = copy.deepcopy(base)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    groups = weight_decay_groups(model.named_parameters(), shapes, embedding_params(model), WEIGHT_DECAY)
    optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms, grads = [], [], []
    for ids, labels in batches:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
        grads.append({name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return {"losses": losses, "norms": norms, "grads": grads,
            "params": dict(model.named_parameters(remove_duplicate=False))}


def without_backward(pmodel, ids: torch.Tensor, labels: torch.Tensor, how: str) -> None:
    """A forward that no backward follows, as an evaluation runs one: ``eval_loss``, ``generate`` (one new token),
    or the model called under ``torch.no_grad`` (``forward``; a pipeline stage cannot be called alone, so there
    ``eval_loss``). Under ZeRO-2/3 FSDP2 leaves gathered copies registered after it (plait.parallel.fsdp.reshard)."""
    rows = local_microbatch(torch.arange(GLOBAL_BATCH), pmodel.mesh.dp_rank, pmodel.mesh.dp, 1, 0)
    if how == "generate":
        pmodel.generate(ids, max_new_tokens=1)
    elif how == "forward" and pmodel.pipeline is None:
        with torch.no_grad():
            pmodel(ids[rows])
    else:
        pmodel.eval_loss(ids[rows], labels[rows], num_items_in_batch=num_items(labels))


def train(base, batches, layout, *, zero_1=True, max_norm=None, accumulation=1, checkpointing=False,
          bf16_params=False, bf16_autocast=False, main_grads=True, reduce_dtype=None, plain_dp=False,
          counters=None, zero_stage=0, mixed_precision=False, evaluate: tuple[str, str] | None = None) -> dict:
    """Train a parallel copy of ``base``; returns global losses, norms and the ParallelModel. ``evaluate``: a
    forward without backward (``without_backward``) before the optimizer is built, and another after each step."""
    tp, pp = layout
    model = copy.deepcopy(base)
    if bf16_params:
        model.to(torch.bfloat16)
    pmodel = parallelize(model, ParallelConfig(tp=tp, pp=pp, zero_1=zero_1 and not zero_stage, zero_stage=zero_stage,
                                               mixed_precision=mixed_precision,
                                               gradient_checkpointing=checkpointing, bf16_autocast=bf16_autocast,
                                               num_microbatches=2 if pp > 1 else 1))
    mesh = pmodel.mesh
    if evaluate:
        without_backward(pmodel, *batches[0], evaluate[0])
    if plain_dp:  # the baseline ZeRO-1 must match bit for bit: torch AdamW on every parameter
        shapes = {name: spec.full_shape for name, spec in pmodel.param_specs.items()}
        groups = weight_decay_groups(pmodel.module.named_parameters(), shapes, embedding_params(pmodel.module),
                                     WEIGHT_DECAY)
        optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY,
                                    optimizer_dtype=torch.float32 if bf16_params else None, main_grads=main_grads)
        step = OptimizerStep(pmodel.grad_sync, optimizer, max_norm, reduce_dtype=reduce_dtype)
        stepped_grads: list[dict] = []  # per step, the gradients the optimizer stepped on (ZeRO-1: its owned ones)
        owned = {id(p) for p in getattr(optimizer, "owned_params", pmodel.parameters())}

        def reading(*args, **kwargs):
            stepped_grads.append({name: grad_of(p).detach().float().clone() for name, p in
                                  pmodel.module.named_parameters() if id(p) in owned and grad_of(p) is not None})
            return type(optimizer).step(optimizer, *args, **kwargs)

        optimizer.step = reading
    leaf_mlp_calls = []
    # a pre-hook: recomputation stops early, after the last saved tensor, so a post-hook of the mlp never fires
    # the first decoder layer this pipeline rank owns (other stages' layers are placeholders without an mlp)
    first_mlp = next(m for n, m in pmodel.module.named_modules()
                     if n.startswith("model.layers.") and n.endswith(".mlp"))
    first_mlp.register_forward_pre_hook(lambda *_: leaf_mlp_calls.append(1))
    losses, norms, held = [], [], []
    for ids, labels in batches:
        total = torch.zeros(())
        for micro in range(accumulation):
            rows = local_microbatch(torch.arange(GLOBAL_BATCH), mesh.dp_rank, mesh.dp, accumulation, micro)
            with comm.count_collectives() as counter:
                loss = pmodel.train_step(ids[rows], labels[rows], num_items_in_batch=num_items(labels))
            if counters is not None:
                counters.append(("micro", micro, counter.records))
            # gradient elements this rank holds between micro-steps, as a share of its parameters' (1/dp: sharded)
            held.append(sum(local(p.grad).numel() for p in pmodel.parameters() if p.grad is not None)
                        / sum(p.numel() for p in pmodel.parameters()))
            total += loss.detach().float()
        with comm.count_collectives() as counter:
            if plain_dp:
                pmodel.grad_sync.finish()
                optimizer.step()
                optimizer.zero_grad()
            else:
                norms.append(step().item())
        if evaluate:
            without_backward(pmodel, ids, labels, evaluate[1])
        if counters is not None:
            counters.append(("step", None, counter.records))
        losses.append(comm.all_reduce(total, mesh.dp_group).item())
    return {"losses": losses, "norms": norms, "pmodel": pmodel, "optimizer": optimizer, "grads_held": max(held),
            "grads": [] if plain_dp else stepped_grads,
            "mlp_calls_per_micro_step":
                len(leaf_mlp_calls) / (len(batches) * accumulation * pmodel.config.num_microbatches)}


def max_param_diff(pmodel, ref_params: dict) -> float:
    """Largest |parallel - reference| over every parameter slice of every rank (no tp gather needed)."""
    worst = torch.zeros(())
    for name, param in pmodel.module.named_parameters():
        expected = pmodel.param_specs[name].slice_full(ref_params[name].detach())
        worst = torch.maximum(worst, (local(param).detach().float() - expected).abs().max())
    return dist_max(worst)


def grad_errors(run: dict, expected: dict) -> tuple[list[float], list[str]]:
    """Per step, the largest |stepped - reference| gradient element over every rank, in units of the kit's
    tolerance (1e-6 + 1e-5 |g|); and the parameter names compared on any rank (every owner, every stage)."""
    errors, names = [], set()
    for stepped, reference in zip(run["grads"], expected["grads"], strict=True):
        worst = torch.zeros(())
        for name, grad in stepped.items():
            want = run["pmodel"].param_specs[name].slice_full(reference[name])
            worst = torch.maximum(worst, ((grad - want).abs() / (1e-6 + 1e-5 * want.abs())).max())
            names.add(name)
        errors.append(dist_max(worst))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(names))
    return errors, sorted(set().union(*everyone))


def dist_max(value: torch.Tensor) -> float:
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


FP32_FIGURES = ("loss_rel", "norm_rel", "param_diff", "grad_err_by_step")  # kept beside a float64 recheck's


def noise_shaped(result: dict) -> bool:
    """An fp32 miss shaped like reordering noise (plait.testing.noise): losses, norms and step 1's gradients within
    the fp32 bounds, a later step's gradients or the final parameters over them."""
    bound = BOUNDS["float32"]
    right = (result["loss_rel"] <= bound["loss"] and result.get("norm_rel", 0.0) <= bound["loss"]
             and result["grad_err_by_step"][0] <= bound["grad"])
    return right and (max(result["grad_err_by_step"]) > bound["grad"] or result["param_diff"] > bound["param"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tp", type=int)
    parser.add_argument("pp", type=int)
    parser.add_argument("--float64", default="", help="checks decided in float64 whatever fp32 gives, comma-separated")
    args = parser.parse_args()
    out, tp, pp, forced = args.out, args.tp, args.pp, args.float64.split(",")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    layout = (tp, pp)
    base, batches = make_model(), make_batches()
    base64 = copy.deepcopy(base).double()  # what a float64 check and its reference start from
    parameters = sorted(name for name, _ in base.named_parameters())
    references: dict[tuple[str, float | None], dict] = {}
    results: dict[str, dict] = {}

    def expected(dtype: str, max_norm: float | None) -> dict:
        """The one-process reference at ``dtype`` (float64 under Float64Throughout), built once."""
        if (dtype, max_norm) not in references:
            references[dtype, max_norm] = reference(base if dtype == "float32" else base64, batches, max_norm)
        return references[dtype, max_norm]

    def measure(run: dict, want: dict, dtype: str, max_norm: float | None) -> dict:
        errors, compared = grad_errors(run, want)
        result = {"dtype": dtype, "loss_rel": rel(run["losses"], want["losses"]),
                  "param_diff": max_param_diff(run["pmodel"], want["params"]), "grad_err_by_step": errors,
                  "compared": compared, "losses": run["losses"], "ref_losses": want["losses"]}
        if max_norm is not None:
            result.update(norms=run["norms"], ref_norms=want["norms"], norm_rel=rel(run["norms"], want["norms"]))
        return result

    def parity(name: str, **options) -> dict:
        """Train ``options``' variant in fp32 and compare; where the miss is noise-shaped, or ``name`` is in
        ``--float64``, again in float64 throughout, whose result stands (with the fp32 one under "fp32")."""
        run = train(base, batches, layout, **options)
        max_norm = options.get("max_norm")
        result = measure(run, expected("float32", max_norm), "float32", max_norm)
        if name in forced or noise_shaped(result):
            options.pop("counters", None)  # the fp32 run counted them
            with Float64Throughout():
                again = train(base64, batches, layout, **options)
                result = {**measure(again, expected("float64", max_norm), "float64", max_norm),
                          "fp32": {k: v for k, v in result.items() if k in FP32_FIGURES}}
        results[name] = {**result, "parameters": parameters, "max_norm": max_norm}
        return run

    zero = parity("zero1")
    results["zero1"]["owned_fraction"] = dist_max(torch.tensor(_owned_fraction(zero)))
    plain = train(base, batches, layout, zero_1=False, plain_dp=True)
    local_diff = max((a.detach() - b.detach()).abs().max() for a, b in
                     zip(zero["pmodel"].parameters(), plain["pmodel"].parameters()))
    results["zero1_vs_dp"] = {"losses": zero["losses"], "dp_losses": plain["losses"],
                              "max_local_param_diff": dist_max(local_diff)}

    for name, zero_1 in (("clip_zero1", True), ("clip_dp", False)):
        parity(name, zero_1=zero_1, max_norm=SMALL_NORM)

    counters: list = []
    run = parity("accumulation", accumulation=2, counters=counters)
    micro = [records for kind, m, records in counters if kind == "micro"]
    steps = [records for kind, _, records in counters if kind == "step"]
    results["accumulation"].update(
        first_micro_collectives=len(micro[0]), last_micro_collectives=len(micro[1]),
        micro_reduce_ops=sum(op == "reduce" for records in micro for op, _ in records),
        step_reduce_ops=sum(op == "reduce" for op, _ in steps[0]), dp=run["pmodel"].mesh.dp, tp=tp, pp=layout[1])

    run = parity("checkpointing", checkpointing=True)  # a leaf's inside runs again in backward
    results["checkpointing"].update(mlp_calls_per_micro_step=run["mlp_calls_per_micro_step"],
                                    mlp_calls_without=zero["mlp_calls_per_micro_step"])

    ref = expected("float32", None)
    run = train(base, batches, layout, bf16_params=True)
    results["bf16_master"] = {"loss_rel": rel(run["losses"], ref["losses"]), **_dtypes(run)}
    run = train(base, batches, layout, bf16_autocast=True)
    results["bf16_autocast"] = {"loss_rel": rel(run["losses"], ref["losses"]), **_dtypes(run)}

    wire = {}
    for name, dtype in (("bf16", None), ("fp32", torch.float32)):  # bf16 grads reduced as bf16 or fp32
        counters = []
        run = train(base, batches, layout, bf16_params=True, main_grads=False, reduce_dtype=dtype, counters=counters)
        wire[name] = sum(n for kind, _, records in counters if kind == "step" for op, n in records if op == "reduce")
        results[f"bf16_reduce_{name}"] = {"loss_rel": rel(run["losses"], ref["losses"]), **_dtypes(run)}
    results["reduce_dtype"] = {"bf16_bytes": wire["bf16"], "fp32_bytes": wire["fp32"],
                               "numel": sum(p.numel() for p in run["pmodel"].parameters()) * STEPS}

    # ZeRO-2 (2 micro-steps a step) and ZeRO-3 on FSDP2, with clipping that bites; ZeRO-3 with recomputation, and
    # with FSDP2's mixed precision (bf16 compute from fp32 shards)
    # with evaluation as a user's loop runs it: before the optimizer is built and after every step
    run = parity("zero2_clip_accumulation", zero_stage=2, accumulation=2, max_norm=SMALL_NORM,
                 evaluate=("forward", "eval_loss"))
    results["zero2_clip_accumulation"].update(grads_held=dist_max(torch.tensor(run["grads_held"])),
                                              dp=run["pmodel"].mesh.dp)
    results["zero2_after_forwards"] = after_forwards(run, batches[0], Path(out).parent / "zero2-checkpoint")
    run = parity("zero3_clip", zero_stage=3, max_norm=SMALL_NORM, evaluate=("forward", "generate"))
    results["zero3_clip"].update(shard_fraction=dist_max(torch.tensor(_shard_fraction(run))), dp=run["pmodel"].mesh.dp)
    run = parity("zero3_checkpointing", zero_stage=3, checkpointing=True)
    results["zero3_checkpointing"].update(mlp_calls_per_micro_step=run["mlp_calls_per_micro_step"],
                                          mlp_calls_without=zero["mlp_calls_per_micro_step"])
    run = train(base, batches, layout, zero_stage=3, mixed_precision=True)
    results["zero3_bf16"] = {"loss_rel": rel(run["losses"], ref["losses"]), **_dtypes(run)}

    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


def after_forwards(run: dict, batch: tuple[torch.Tensor, torch.Tensor], path: Path) -> dict:
    """Stage 2 after forwards without backward (which leave every unit gathered in FSDP2): whether every parameter
    is a shard again after ``generate``, and the largest change to a parameter row from saving a checkpoint and
    loading it back, each right after the model was called under no_grad (0: the shards went to disk and came
    back into the shards)."""
    pmodel = run["pmodel"]
    before = {name: local(p).detach().clone() for name, p in pmodel.module.named_parameters()}
    without_backward(pmodel, *batch, "generate")
    sharded = all(isinstance(p, DTensor) for p in pmodel.parameters())
    without_backward(pmodel, *batch, "forward")
    save_checkpoint(path, pmodel, run["optimizer"], step=STEPS)
    without_backward(pmodel, *batch, "forward")
    load_checkpoint(path, pmodel, run["optimizer"])
    change = max((local(p).detach() - before[name]).abs().max() for name, p in pmodel.module.named_parameters())
    return {"sharded_after_generate": -dist_max(torch.tensor(-float(sharded))), "reload_change": dist_max(change)}


def _owned_fraction(run: dict) -> float:
    """This rank's share of the elements it keeps optimizer state for (1/dp ideally)."""
    optimizer = run["optimizer"]
    assert isinstance(optimizer, Zero1Optimizer)
    total = sum(p.numel() for p in run["pmodel"].parameters())
    return sum(p.numel() for p in optimizer.owned_params) / total


def _shard_fraction(run: dict) -> float:
    """This rank's share of the parameter elements it stores between steps (ZeRO-3: about 1/dp)."""
    params = list(run["pmodel"].parameters())
    return sum(local(p).numel() for p in params) / sum(p.numel() for p in params)


def _dtypes(run: dict) -> dict:
    """dtypes of the model's parameters, of what the optimizer steps (masters) and of its state."""
    optimizer = run["optimizer"]
    local = optimizer.optim if isinstance(optimizer, Zero1Optimizer) else optimizer
    stepped = [p for group in local.param_groups for p in group["params"]]
    state = [v for s in local.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"param_dtypes": sorted({str(p.dtype) for p in run["pmodel"].parameters()}),
            "stepped_dtypes": sorted({str(p.dtype) for p in stepped}),
            "state_dtypes": sorted({str(v.dtype) for v in state}),
            "local_optimizer": type(local).__name__}


if __name__ == "__main__":
    main()
