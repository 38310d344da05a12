"""Worker: float8 (torchao, emulated) under plait's layouts against one process, in one world of 2 ranks.

Run by tests/test_float8.py through plait.testing.launch: ``float8_parity.py OUT.json``. Every rank trains, on the
same global batches, the one-process references (torchao's own ``convert_to_float8_training`` of the decoder layers'
linears, per recipe, and the model without float8), then plait with float8 at tp=2 with SP (each recipe, and
tensorwise with power-of-2 scales), and at ZeRO-1 dp=2, pp=2 and cp=2 (rowwise); it records the relative differences the test
asserts on, and checks that a float8 tp=2 checkpoint loads into a layout without float8 as the same weights.
Rank 0 writes {case: [per-rank record]}.

Also imported by the test for its one-process checks (the model, the batches, the reference loop).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import plait  # noqa: E402
from plait.base import comm  # noqa: E402
from plait.checkpoint import save_checkpoint  # noqa: E402
from plait.checkpoint.gather import gather_full  # noqa: E402
from plait.checkpoint.materialize import load_parallel_model  # noqa: E402
from plait.optim import OptimizerStep, build_optimizer  # noqa: E402
from plait.parallel.float8 import Float8Matmul, float8_modules  # noqa: E402
from plait.tp.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ, LR = 3, 4, 16, 1e-3
RECIPES = ("tensorwise", "rowwise")
LINEARS = 14  # 2 decoder layers x (q, k, v, o, gate, up, down)
# layouts trained with plait's optimizer step, beside tp=2 with SP (trained with plain AdamW, its gradients gathered)
LAYOUTS = {"zero1-dp2": dict(zero_1=True), "pp2": dict(pp=2, num_microbatches=2), "cp2": dict(cp=2)}


def float8_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny Llama with every decoder linear a multiple of 16 on both dims at tp=2 (head_dim 16, 2 kv heads:
    k/v projections 32 wide, 16 per rank)."""
    return tiny_model("llama", seed=0, hidden_size=64, intermediate_size=128, head_dim=16).to(dtype)


def make_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 61, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def float8_config(recipe: str, pow2: bool = False):
    """torchao's config of ``recipe``, emulated; ``pow2``: scales rounded down to powers of 2 (rowwise's default)."""
    from torchao.float8 import Float8LinearConfig

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return dataclasses.replace(config, round_scales_to_power_of_2=True) if pow2 else config


def torchao_float8(model: torch.nn.Module, recipe: str, pow2: bool = False) -> torch.nn.Module:
    """torchao's own conversion of the decoder layers' linears (emulated): the one-process float8 reference,
    without any plait code."""
    from torchao.float8 import convert_to_float8_training

    config = float8_config(recipe, pow2)
    return convert_to_float8_training(model, module_filter_fn=lambda m, fqn: ".layers." in fqn, config=config)


def train(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict:
    """AdamW steps of a whole model on whole batches: each step's loss, gradients and gradient norm, and the
    parameters after the last step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    record = {"losses": [], "grads": [], "norms": []}
    for ids in batches:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters()}
        record["losses"].append(loss.item())
        record["grads"].append(grads)
        record["norms"].append(math.sqrt(sum(g.pow(2).sum().item() for g in grads.values())))
        optimizer.step()
        optimizer.zero_grad()
    record["params"] = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    return record


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def worst_grad(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest relative difference (norm of the difference over the reference's norm) over parameters."""
    return max(rel(g, reference[name]) for name, g in grads.items())


def tp_case(base, recipe: str, batches, ref8: dict, ref: dict, pow2: bool = False, checkpoint: Path | None = None):
    config = plait.ParallelConfig(tp=2, sp=True, float8=recipe, float8_emulate=True)
    pmodel = plait.parallelize(copy.deepcopy(base), config)
    if pow2:  # the recipe with power-of-2 scales (not a plait option): each TP layer gets torchao's matmul with it
        matmul = Float8Matmul(float8_config(recipe, pow2=True))
        for module in pmodel.module.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.float8 is not None:
                module.float8 = matmul
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    out = describe(pmodel, base)
    out.update(loss_f8=0.0, loss_hp=0.0, grad_f8=0.0, grad_hp=0.0)
    for step, ids in enumerate(batches):
        loss = pmodel(ids, labels=ids, num_items_in_batch=ids.shape[0] * (SEQ - 1))
        loss.backward()
        pmodel.grad_sync.finish()
        grads = {name: gather_full(pmodel, name, p.grad) for name, p in pmodel.module.named_parameters()}
        out["loss_f8"] = max(out["loss_f8"], abs(loss.item() - ref8["losses"][step]) / ref8["losses"][step])
        out["loss_hp"] = max(out["loss_hp"], abs(loss.item() - ref["losses"][step]) / ref["losses"][step])
        out["grad_f8"] = max(out["grad_f8"], worst_grad(grads, ref8["grads"][step]))
        out["grad_hp"] = max(out["grad_hp"], worst_grad(grads, ref["grads"][step]))
        optimizer.step()
        optimizer.zero_grad()
    params = {name: gather_full(pmodel, name, p) for name, p in pmodel.module.named_parameters()}
    out["param_f8"] = worst_grad(params, ref8["params"])
    if checkpoint is not None:  # layout-free: the float8 tp=2 checkpoint is the same weights at dp=2 without float8
        save_checkpoint(checkpoint, pmodel)
        loaded = load_parallel_model(checkpoint, plait.ParallelConfig())
        out["checkpoint_equal"] = all(torch.equal(p, params[name]) for name, p in loaded.module.named_parameters())
        out["checkpoint_float8_layers"] = len(float8_modules(loaded.module))
    return out


def step_case(base, config: plait.ParallelConfig, batches, ref8: dict, ref: dict) -> dict:
    """plait's own optimizer step (ZeRO-1 where the config says) on a layout with float8: each step's loss and
    gradient norm, and the parameters this rank holds after the last step, against the one-process runs."""
    pmodel = plait.parallelize(copy.deepcopy(base), config)
    mesh = pmodel.mesh
    step = OptimizerStep(pmodel.grad_sync, build_optimizer(pmodel, torch.optim.AdamW, lr=LR))
    out = describe(pmodel, base)
    out.update(loss_f8=0.0, loss_hp=0.0, norm_f8=0.0, norm_hp=0.0)
    for i, ids in enumerate(batches):
        local = ids.chunk(mesh.dp)[mesh.dp_rank]  # each dp rank its rows; cp takes its slice of each sequence
        loss = pmodel.train_step(local, local, num_items_in_batch=ids.shape[0] * (SEQ - 1))
        loss = comm.all_reduce(loss, mesh.replica_group).item()
        norm = step().item()
        out["loss_f8"] = max(out["loss_f8"], abs(loss - ref8["losses"][i]) / ref8["losses"][i])
        out["loss_hp"] = max(out["loss_hp"], abs(loss - ref["losses"][i]) / ref["losses"][i])
        out["norm_f8"] = max(out["norm_f8"], abs(norm - ref8["norms"][i]) / ref8["norms"][i])
        out["norm_hp"] = max(out["norm_hp"], abs(norm - ref["norms"][i]) / ref["norms"][i])
    out["param_f8"] = worst_grad(dict(pmodel.module.named_parameters()), ref8["params"])
    return out


def describe(pmodel, base) -> dict:
    """What the test checks was converted, and that the parameters kept their names (checkpoints, ZeRO-1): the
    names of the unsplit model, in its order (under pp, those of this rank's stage)."""
    names, layers = [n for n, _ in pmodel.module.named_parameters()], float8_modules(pmodel.module)
    return {"float8_layers": layers, "names_unchanged": names == [n for n, _ in base.named_parameters() if n in names]
            and len(names) == len(set(names)) and set(names) <= {n for n, _ in base.named_parameters()},
            "repr": repr(pmodel.module.get_submodule(layers[-1]))}


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    base, batches = float8_llama(), make_batches()
    ref = train(copy.deepcopy(base), batches)
    records = {}
    for recipe in RECIPES:
        ref8 = train(torchao_float8(copy.deepcopy(base), recipe), batches)
        checkpoint = Path(out).parent / "checkpoint" if recipe == "rowwise" else None
        records[f"tp2-sp-{recipe}"] = tp_case(base, recipe, batches, ref8, ref, checkpoint=checkpoint)
        if recipe == "rowwise":  # rowwise: power-of-2 scales, so any layout matches one process to fp32 noise
            for name, layout in LAYOUTS.items():
                config = plait.ParallelConfig(float8=recipe, float8_emulate=True, **layout)
                records[f"{name}-{recipe}"] = step_case(base, config, batches, ref8, ref)
    ref8 = train(torchao_float8(copy.deepcopy(base), "tensorwise", pow2=True), batches)
    records["tp2-sp-tensorwise-pow2"] = tp_case(base, "tensorwise", batches, ref8, ref, pow2=True)
    by_rank = comm.all_gather_object(records, comm.world_group())
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({name: [r[name] for r in by_rank] for name in records}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
