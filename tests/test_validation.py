"""Every layout refusal names the values and the fix, and happens before any collective (single process)."""

from __future__ import annotations

import re

import pytest
import torch

from plait import ConfigError, ParallelConfig
import plait
from plait.base.words import flag_words
from plait.layout_plan import check_capabilities
from plait.plugin.registry import default_registry
from plait.tp.layout import plan_tensor_parallel
from plait.tp.sequence_parallel import sp_grad_sum_params
from plait.tp.sharding import ShardSpec
from tiny_models import tiny_config, tiny_model


def tp_plan(model):
    registry = default_registry()
    return registry.tp_plan(registry.resolve(model.config), model.config)


def meta_model(arch, **overrides):
    with torch.device("meta"):
        return tiny_model(arch, **overrides)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=0), r"tp=0 must be a positive integer"),
        (dict(pp=-1), r"pp=-1 must be a positive integer"),
        (dict(dp=0), r"dp=0 must be a positive integer or None"),
        (dict(pipeline_schedule="fast"), r"pipeline_schedule='fast' is unknown; choose one of gpipe, 1f1b"),
    ],
)
def test_bad_config_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kwargs)


def test_world_size_not_divisible():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp\*pp = 4\*1 = 4"):
        ParallelConfig(tp=4).resolve(6)


def test_explicit_dp_mismatch():
    with pytest.raises(ConfigError, match=r"tp\*pp\*dp = 2\*1\*2 = 4 != world size 2"):
        ParallelConfig(tp=2, dp=2).resolve(2)


def test_dp_derived():
    assert ParallelConfig(tp=2, pp=2).resolve(8).dp == 2


def test_parallelize_refuses_layout_larger_than_world():
    with pytest.raises(ConfigError, match=r"needs 2 processes, but this process runs alone .*torchrun --nproc_per_node 2"):
        plait.parallelize(tiny_model("llama"), ParallelConfig(tp=2))


@pytest.mark.parametrize(
    "arch, overrides, tp, message",
    [
        ("llama", dict(num_attention_heads=4, num_key_value_heads=4), 3,
         r"num_attention_heads=4 is not divisible by tp=3"),
        ("llama", dict(num_attention_heads=12, num_key_value_heads=6, hidden_size=48), 4,
         r"num_key_value_heads=6 is not divisible by tp=4"),
        ("llama", dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=48), 6,
         r"tp=6 is not a multiple of num_key_value_heads=4"),
        ("llama", dict(intermediate_size=66), 4, r"model.layers.0.mlp.gate_proj output features = 66 is not divisible by tp=4"),
        ("gpt2", dict(n_head=4), 3, r"num_attention_heads=4 is not divisible by tp=3"),
    ],
)
def test_sharding_refusals(arch, overrides, tp, message):
    model = meta_model(arch, **overrides)
    with pytest.raises(ConfigError, match=message):
        plan_tensor_parallel(model, tp_plan(model), tp, 0)


NINE_HEADS = dict(num_attention_heads=9, num_key_value_heads=9, hidden_size=36, intermediate_size=72)


@pytest.mark.parametrize(
    "overrides, layout, world, refusal, hint",
    [
        (NINE_HEADS, dict(tp=2), 2, "num_attention_heads=9 is not divisible by tp=2; choose a tp that divides 9",
         "with 2 processes, no tp > 1 fits this model: use them for pipeline stages (pp=2) "
         "or data parallelism (tp=1: dp=2; zero_1=True shards the optimizer state over it)"),
        (NINE_HEADS, dict(tp=2), 9, "num_attention_heads=9 is not divisible by tp=2",
         "with 9 processes, tp=3 or 9 would work"),
        (NINE_HEADS, dict(tp=2, pp=2, num_microbatches=2), 18, "num_attention_heads=9 is not divisible by tp=2",
         "with 18 processes and pp=2, tp=3 or 9 would work"),
        (NINE_HEADS, dict(tp=2), 1, "num_attention_heads=9 is not divisible by tp=2",
         "this model splits over tp=3 or 9, which 1 process cannot hold: launch a multiple of tp*pp processes"),
        (dict(NINE_HEADS, intermediate_size=64), dict(tp=2), 9, "num_attention_heads=9 is not divisible by tp=2",
         "with 9 processes, no tp > 1 fits this model: use them for data parallelism"),  # 64 splits over neither
        (dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=48, intermediate_size=96), dict(tp=6), 12,
         "tp=6 is not a multiple of num_key_value_heads=4", "with 12 processes, tp=2, 4 or 12 would work"),
        (dict(intermediate_size=66), dict(tp=4), 8, "model.layers.0.mlp.gate_proj output features = 66 is not "
         "divisible by tp=4", "with 8 processes, tp=2 would work"),
    ],
)
def test_tp_refusal_lists_the_tp_sizes_that_fit_the_world(overrides, layout, world, refusal, hint):
    """A tp the heads (or features) refuse: the rule's message first, then what would work with this world's
    processes, checked by every tp rule (9 heads but 64 intermediate features: tp=3 fits the heads only)."""
    from plait.layout_plan import plan_layout

    model = meta_model("llama", **overrides)
    with pytest.raises(ConfigError) as refused:
        plan_layout(model, ParallelConfig(**layout), world)
    message = str(refused.value)
    assert message.startswith(refusal) and f"; {hint}" in message and "\n" not in message, message


def test_a_refusal_names_fields_to_python_and_flags_to_plait(tmp_path, capsys):
    """The same refusal in the caller's words: ParallelConfig's fields from Python, the flags under the plait
    command (plait.base.words)."""
    from plait.cli import main
    from plait.layout_plan import plan_layout

    model = meta_model("llama", **NINE_HEADS)
    fields = r"pipeline stages \(pp=2\) or data parallelism \(tp=1: dp=2; zero_1=True shards"
    flags = r"pipeline stages \(--pipeline_parallel_size 2\) or data parallelism \(--tensor_parallel_size 1: dp=2; " \
            r"--zero_1 shards"
    with pytest.raises(ConfigError, match=fields):
        plan_layout(model, ParallelConfig(tp=2), 2)
    with flag_words(), pytest.raises(ConfigError, match=flags):
        plan_layout(model, ParallelConfig(tp=2), 2)
    with pytest.raises(ConfigError, match=fields):  # the words go back with the block
        plan_layout(model, ParallelConfig(tp=2), 2)
    path = tmp_path / "config.json"
    tiny_config("llama", **NINE_HEADS).to_json_file(path)
    with pytest.raises(SystemExit):
        main(["plan", "--model_config", str(path), "--block_size", "18", "--tensor_parallel_size", "2",
              "--world_size", "2"])
    assert re.search(flags, capsys.readouterr().err)


def test_plait_plan_names_the_tp_sizes_that_fit(tmp_path, capsys):
    from plait.cli import main

    path = tmp_path / "config.json"
    tiny_config("llama", **NINE_HEADS).to_json_file(path)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model_config", str(path), "--block_size", "18", "--tensor_parallel_size", "2",
              "--world_size", "9"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "num_attention_heads=9 is not divisible by --tensor_parallel_size 2; choose a --tensor_parallel_size that " \
           "divides 9; with 9 processes, --tensor_parallel_size 3 or 9 would work" in err


def test_plan_naming_missing_module():
    model = meta_model("llama")
    plan = plait.TPPlan((plait.Column("model.layers.*.mlp.not_there"),))
    with pytest.raises(ConfigError, match=r"names 'model.layers.\*.mlp.not_there', but the model \(LlamaForCausalLM\) has no such module"):
        plan_tensor_parallel(model, plan, 2, 0)


def test_sp_plan_must_cover_replicated_params():
    model = meta_model("llama")
    plan = plait.SPPlan(begin="model.layers.0", end="model.norm", norms=("model.layers.*.input_layernorm",))
    shards = plan_tensor_parallel(model, tp_plan(model), 2, 0)
    with pytest.raises(ConfigError, match=r"post_attention_layernorm.weight is replicated inside the sequence-parallel region"):
        sp_grad_sum_params(model, plan, shards)


def test_sp_plan_unknown_module():
    model = meta_model("llama")
    plan = plait.SPPlan(begin="model.blocks.0", end="model.norm", norms=())
    with pytest.raises(ConfigError, match=r"SP plan names 'model.blocks.0'"):
        sp_grad_sum_params(model, plan, {})


def test_capability_refused():
    registry = plait.Registry(autoload=False)
    import types

    module = types.ModuleType("no_tp")

    @plait.hookimpl
    def plait_adapter_info():
        return plait.AdapterInfo("no_tp", ("llama",), plait.Capabilities(tp=False, sp=False))

    @plait.hookimpl
    def plait_tp_plan(config):
        return plait.TPPlan(())

    @plait.hookimpl
    def plait_leaf_modules(config):
        return []

    module.plait_adapter_info, module.plait_tp_plan, module.plait_leaf_modules = (
        plait_adapter_info, plait_tp_plan, plait_leaf_modules)
    adapter = registry.register(module)
    with pytest.raises(ConfigError, match=r"adapter 'no_tp' does not support tp, sp \(it supports: pp, vpp, tied_embeddings\)"
                                          r".*: tp=1$"):
        check_capabilities(adapter, ParallelConfig(tp=2).resolve(2), tiny_config("llama"))
    module.plait_adapter_info = plait.hookimpl(lambda: plait.AdapterInfo(
        name="no_sp", architectures=("llama",), capabilities=plait.Capabilities(sp=False)))
    no_sp = plait.Registry(autoload=False).register(module)
    with pytest.raises(ConfigError, match=r"does not support sp .*: sp=False$"):
        check_capabilities(no_sp, ParallelConfig(tp=2).resolve(2), tiny_config("llama"))
    with flag_words(), pytest.raises(ConfigError, match=r"does not support sp .*: --disable_sequence_parallel$"):
        check_capabilities(no_sp, ParallelConfig(tp=2).resolve(2), tiny_config("llama"))


def test_plan_patterns_match_one_component():
    from plait.base.patterns import matches

    assert matches("model.layers.*.mlp", "model.layers.11.mlp")
    assert not matches("model.layers.*.mlp", "model.layers.1.x.mlp")
    assert not matches("model.layers.*", "model.layers.1.mlp")


def test_sequence_checked_once_per_step_at_pp1(monkeypatch):
    """train_step checks the sequence length once, not again in each microbatch's forward."""
    import torch

    from plait import ParallelConfig, parallelize
    from plait.parallel_model import ParallelModel
    from tiny_models import tiny_model

    pmodel = parallelize(tiny_model("llama"), ParallelConfig(num_microbatches=2))
    calls = []
    original = ParallelModel._check_sequence
    monkeypatch.setattr(ParallelModel, "_check_sequence", lambda self, *args: (calls.append(1), original(self, *args)))
    ids = torch.randint(0, 61, (4, 16))
    pmodel.train_step(ids, ids)
    assert len(calls) == 1


def test_expert_parallel_refusals_name_the_values_and_the_fix():
    """ep's refusals, before any group: not dividing dp x cp, nor the experts; a dense model; experts without
    transformers' routing contract (Llama 4's expert-major ones are divided, a capacity refused for them); a capacity
    factor that is not a positive number."""
    from plait.base.meta import build_meta_model
    from plait.layout_plan import plan_layout
    from plait.testing.conformance_modes import load_subject

    with pytest.raises(ConfigError, match=r"ep=3 must divide the ranks it is carved from, dp = 4; choose an ep "
                                          r"that divides 4"):
        ParallelConfig(ep=3).resolve(4)
    with pytest.raises(ConfigError, match=r"moe_capacity_factor=0 must be a positive number"):
        ParallelConfig(moe_capacity_factor=0)
    mixtral = load_subject("transformers:mixtral")  # 4 experts per layer
    with pytest.raises(ConfigError, match=r"mixtral has 4 experts per MoE layer, not divisible by ep=3; choose ep "
                                          r"among \[1, 2, 4\]$"):  # no world: the experts alone
        plan_layout(build_meta_model(mixtral.config), ParallelConfig(ep=3), None, mixtral.registry)
    # in a world of 6 only ep 1 and 2 divide both (4 offered an ep the ranks then refused)
    with pytest.raises(ConfigError, match=r"not divisible by ep=3; choose ep among \[1, 2\] \(dividing both the "
                                          r"experts and dp\*cp = 6\)"):
        plan_layout(build_meta_model(mixtral.config), ParallelConfig(ep=3), 6, mixtral.registry)
    with pytest.raises(ConfigError, match=r"ep=2, but llama has no routed experts .*; use ep=1"):
        plan_layout(meta_model("llama"), ParallelConfig(ep=2), 2)
    llama4 = load_subject("transformers:llama4_text")  # expert-major experts: divided, each block whole
    ep = plan_layout(build_meta_model(llama4.config), ParallelConfig(ep=2), 2, llama4.registry).ep
    assert ep.expert_major and ep.modules[0] == "model.layers.0.feed_forward.experts" and ep.num_experts == 4
    assert not ep.owns("model.layers.0.feed_forward.router.weight")
    with pytest.raises(ConfigError, match=r"^moe_capacity_factor=1.5 has no effect on llama4_text: its experts "
                                          r"\(Llama4TextExperts\) compute every token, none is routed past a "
                                          r"capacity; drop it$"):
        plan_layout(build_meta_model(llama4.config), ParallelConfig(ep=2, moe_capacity_factor=1.5), 2, llama4.registry)
    jetmoe = load_subject("transformers:jetmoe")  # experts over tokens already grouped, in attention and MLP
    with pytest.raises(ConfigError, match=r"ep=2: model.layers.0.mlp.input_linear \(JetMoeParallelExperts\) holds "
                                          r"experts stacked on dim 0, but its forward\(inputs, expert_size\) takes no "
                                          r"routing .*; use ep=1 for jetmoe"):
        plan_layout(build_meta_model(jetmoe.config), ParallelConfig(ep=2), 2, jetmoe.registry)
    longcat = load_subject("transformers:longcat_flash")  # zero-compute experts beside the weighted ones
    with pytest.raises(ConfigError, match=r"\(LongcatFlashExperts\) takes routing .* but its parameters "
                                          r"\{'gate_up_proj': \(6, 64, 32\), 'down_proj': \(4, 32, 32\)\} are not"):
        plan_layout(build_meta_model(longcat.config), ParallelConfig(ep=2), 2, longcat.registry)
    dbrx = load_subject("transformers:dbrx")  # its own experts module: w1 / v1 / w2 [experts * ffn, hidden]
    ep = plan_layout(build_meta_model(dbrx.config), ParallelConfig(ep=2), 2, dbrx.registry).ep
    assert ep.modules[0] == "transformer.blocks.0.ffn.experts" and ep.num_experts == 4
    assert ep.owns("transformer.blocks.0.ffn.experts.mlp.w1") and not ep.owns("transformer.blocks.0.ffn.router.layer.weight")
    spec = ep.localize({"transformer.blocks.0.ffn.experts.mlp.w1": ShardSpec((256, 32))}, 1)
    assert spec["transformer.blocks.0.ffn.experts.mlp.w1"].local_shape == (128, 32)  # experts 2-3: rows 128-255


@pytest.mark.parametrize("pp, schedule, v, batch, expected", [
    (1, "1f1b", 1, 8, 1),  # no pipeline: one microbatch
    (2, "1f1b", 1, 8, 2),  # the smallest count >= pp dividing the batch
    (4, "1f1b", 1, 6, 6),
    (2, "interleaved-1f1b", 2, 6, 2),
    (4, "interleaved-1f1b", 2, 12, 4),  # rounds of pp: 4, not 6
])
def test_pipeline_alone_picks_its_microbatches(pp, schedule, v, batch, expected):
    from plait.run.train_args import TrainArgs

    args = TrainArgs(pipeline_parallel_size=pp, pipeline_schedule=schedule, virtual_pipeline_size=v,
                     per_device_train_batch_size=batch)
    args.validate()
    assert args.parallel_config().num_microbatches == expected
    assert TrainArgs(pipeline_parallel_size=pp, num_microbatches=1).parallel_config().num_microbatches == 1
