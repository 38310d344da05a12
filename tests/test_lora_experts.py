"""LoRA on routed experts (peft's ``target_parameters``, plait.lora.experts): peft's update and names on one process,
parity with peft under tp=2 (+SP), ep=2 (+ZeRO-1), pp=2, ZeRO-1 dp=2, tp=2 (SP) x ep=2 and ep=2 x pp=2, what each
tp x ep rank holds, the peft and merged exports, and the settings refused.

The multi-process checks share one world of 2 ranks and one of 4 (tests/workers/lora_experts_parity.py); the tests
assert on every rank's JSON.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GptOssConfig

from plait import ParallelConfig, parallelize
from plait.base.config import ConfigError
from plait.checkpoint.format import full_box, uncovered
from plait.checkpoint.lora_export import PEFT_PREFIX, consolidate_lora
from plait.checkpoint.materialize import load_parallel_model
from plait.layout_plan import plan_layout
from plait.lora.config import lora_config
from plait.lora.experts import updated
from plait.run.train_args import TrainArgs
from plait.testing import launch
from plait.testing.conformance_modes import LOSS_RTOL
from workers.lora_experts_parity import SEED, model_config

WORKER = Path(__file__).parent / "workers" / "lora_experts_parity.py"
LAYOUTS = ("tp2_sp", "tp2", "ep2", "ep2_zero1", "pp2", "zero1_dp2", "ep2_zero3")
LAYOUTS_4 = ("tp2_sp_ep2", "ep2_pp2")
# pp=1: the running model exports its adapter
EXPORTED = ("tp2_sp", "tp2", "ep2", "ep2_zero1", "zero1_dp2", "ep2_zero3")
PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LOGITS_TOL = 1e-5  # the exports against the parallel model (measured 2e-7)
# peft's merge builds each expert's delta with an einsum, plait's with the baddbmm peft's forward uses: fp32
# rounding apart (measured 1e-8 on weights of 0.1)
MERGED_WEIGHT_TOL = 1e-6


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("lora_experts")
    launch([str(WORKER), str(out)], 2, timeout=600)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("lora_experts4")
    launch([str(WORKER), str(out)], 4, timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("layout", LAYOUTS + LAYOUTS_4)
def test_expert_lora_parity_with_peft_on_one_process(request, layout):
    """Loss and every LoRA gradient element of every rank within the kit's tolerance of peft's, and together the
    ranks compared every element of every LoRA tensor peft trains (experts' and q/v's)."""
    ranks = [rank[layout] for rank in (request.getfixturevalue("world")[1] if layout in LAYOUTS
                                       else request.getfixturevalue("world4"))]
    for r in ranks:
        assert not r["failures"], r["failures"]
        assert r["loss_rel"] <= LOSS_RTOL, r
        assert r["grad_tol"] <= 1.0, r.get("grad_worst")
    expected = ranks[0]["lora_params"]
    assert sum(".experts." in n for n in expected) == 2 * 2 * 2, expected  # 2 layers x 2 parameters x A, B
    for name, shape in expected.items():
        boxes = [tuple(map(tuple, box)) for r in ranks for box in r["checked"].get(name, [])]
        assert boxes, f"no rank compared {name}"
        assert uncovered(full_box(shape), boxes) is None, f"{name}: part of its gradient compared on no rank"


@pytest.mark.parametrize("layout", EXPORTED)
def test_exported_expert_adapter_gives_the_parallel_logits(world, layout):
    for r in world[1]:
        assert r[layout]["logits_peft_dir"] <= LOGITS_TOL, r[layout]
        assert r[layout]["logits_merged"] <= LOGITS_TOL, r[layout]
        assert r[layout]["logits_reference"] <= LOGITS_TOL, r[layout]


@pytest.mark.parametrize("layout", ["tp2_sp", "ep2"])
def test_consolidated_checkpoint_is_a_peft_adapter_and_its_merge(world, layout, tmp_path):
    """A LoRA checkpoint saved at tp=2 (B split on rows) or ep=2 (A's rows and B's strided columns of each rank's
    experts) consolidates to the peft directory the running model exported, and to the merge peft makes of it."""
    case = world[0] / layout
    consolidate_lora(case / "checkpoint", tmp_path / "adapter", "adapter")
    consolidate_lora(case / "checkpoint", tmp_path / "merged", "merged")
    exported, consolidated = (load_file(path / "adapter" / "adapter_model.safetensors") for path in (case, tmp_path))
    assert exported.keys() == consolidated.keys()
    assert all(torch.equal(exported[k], consolidated[k]) for k in exported)
    assert f"{PEFT_PREFIX}model.layers.0.mlp.experts.base_layer.lora_B.weight" in consolidated
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == PARAMETERS, config
    base = load_parallel_model(model_config(), ParallelConfig(), seed=SEED).module
    peft_merged = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for name, param in merged.named_parameters():
        assert (param - peft_merged.get_parameter(name)).abs().max() <= MERGED_WEIGHT_TOL, name
    changed = (merged.model.layers[0].mlp.experts.down_proj - base.model.layers[0].mlp.experts.down_proj).abs()
    assert changed.min(dim=-1).values.min() > 0  # every expert's every row was updated
    saved = torch.load(case / "logits.pt")
    with torch.no_grad():
        assert (merged(input_ids=saved["ids"]).logits - saved["logits"]).abs().max() <= LOGITS_TOL


def _experts_pair(config, parameters: list[str]):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    pmodel = parallelize(copy.deepcopy(base), ParallelConfig(),
                         lora=lora_config(4, 8, target_modules=["q_proj"], target_parameters=parameters,
                                          init_lora_weights=False), lora_seed=3)
    reference = get_peft_model(copy.deepcopy(base), copy.deepcopy(pmodel.plan.lora.config))
    mine = {n: p for n, p in pmodel.module.named_parameters() if p.requires_grad}
    ref = {n.removeprefix(PEFT_PREFIX).replace(".default.", "."): p
           for n, p in reference.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in ref.items():
            param.copy_(mine[name])
    return pmodel, reference, mine, ref


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_one_process_expert_lora_is_peft_lora(arch):
    """Same names and same init -> the same loss and gradients as peft's ParamWrapper, bit for bit: mixtral's
    [E, out, in] experts and gpt_oss's transposed [E, in, out] ones (with biases left alone)."""
    if arch == "mixtral":
        config = model_config()
    else:
        config = GptOssConfig(vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=16, layer_types=["full_attention"] * 2)
    pmodel, reference, mine, ref = _experts_pair(config, PARAMETERS)
    assert set(ref) == set(mine)
    assert getattr(pmodel.module.model.layers[0].mlp.experts, "is_transposed", False) == (arch == "gpt_oss")
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = pmodel(ids, ids.clone())
    loss.backward()
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert loss.item() == ref_loss.item()
    for name, param in ref.items():
        assert torch.equal(mine[name].grad, param.grad), name
    assert all(mine[n].grad.abs().max() > 0 for n in mine if ".experts." in n)


def test_every_tp_and_ep_rank_holds_its_slice_of_the_update():
    """tp=2 x ep=2 on the plan (no processes): each rank's A and B slices give exactly its slice of the full
    update of gate_up_proj (column split) and down_proj (row split), and the slices tile A and B."""
    model = AutoModelForCausalLM.from_config(model_config())
    plan = plan_layout(model, ParallelConfig(tp=2, ep=2), 4,
                       lora=lora_config(4, 8, target_modules=[], target_parameters=PARAMETERS))
    gen = torch.Generator().manual_seed(0)
    experts = "model.layers.0.mlp.experts"
    for prefix, leaf in ((f"{experts}.base_layer", "gate_up_proj"), (experts, "down_proj")):
        weight = model.get_parameter(f"{experts}.{leaf}").detach()
        spec_a = plan.specs_by_rank[0][f"{prefix}.lora_A.weight"]
        a = torch.randn(spec_a.full_shape, generator=gen)
        b = torch.randn(plan.specs_by_rank[0][f"{prefix}.lora_B.weight"].full_shape, generator=gen)
        full = updated(weight, a, b, 2.0, False)
        boxes = {"A": [], "B": []}
        for tp_rank in range(2):
            for ep_rank in range(2):
                specs = plan.ep.localize(plan.specs_by_rank[tp_rank], ep_rank)
                local_a, local_b = (specs[f"{prefix}.{f}.weight"] for f in ("lora_A", "lora_B"))
                local_w = specs[f"{experts}.{leaf}"]
                got = updated(local_w.slice_full(weight), local_a.slice_full(a), local_b.slice_full(b), 2.0, False)
                assert torch.equal(got, local_w.slice_full(full)), (leaf, tp_rank, ep_rank)
                boxes["A"] += [box for box, _ in local_a.boxes()]
                boxes["B"] += [box for box, _ in local_b.boxes()]
        assert uncovered(full_box(a.shape), boxes["A"]) is None and uncovered(full_box(b.shape), boxes["B"]) is None


@pytest.mark.parametrize("options, message", [
    (dict(target_parameters=["mlp.experts.gate_up_proj"], dropout=0.1), "input to drop"),
    (dict(target_parameters=["self_attn.q_proj.weight"]), "not in routed experts"),
    (dict(target_parameters=["mlp.experts.nothing"]), "match no parameter"),
    (dict(target_modules=[]), "nothing to adapt"),
])
def test_bad_expert_lora_settings_are_refused_before_any_group(options, message):
    model = AutoModelForCausalLM.from_config(model_config())
    with pytest.raises(ConfigError, match=message):
        dropout = options.pop("dropout", 0.0)
        plan_layout(model, ParallelConfig(), lora=lora_config(4, 8, dropout, **options))


def test_train_flags_name_peft_target_parameters():
    args = TrainArgs(lora_r=4, lora_target_modules="",
                     lora_target_parameters="mlp.experts.gate_up_proj, mlp.experts.down_proj")
    config = args.lora()
    assert config.target_parameters == PARAMETERS and not config.target_modules
    assert TrainArgs(lora_r=4).lora().target_modules is None  # the adapter's projections, filled in by the plan
