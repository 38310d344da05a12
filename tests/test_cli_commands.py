"""`plait plan`, `plait adapters`, and the hook contract's documentation."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from plait.cli import main
from plait.plan_command import parameter_bytes_per_rank
from plait.plugin import hookspecs
from tiny_models import tiny_config


@pytest.fixture
def llama_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return path


def test_adapters_json(capsys):
    main(["adapters", "--json"])
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert {"llama", "gpt2", "mistral"} <= set(rows)
    assert rows["gpt2"]["architectures"] == ["gpt2", "gpt-sw3", "GPT2LMHeadModel"]
    assert rows["llama"]["version"] == "0.1.0"
    assert "plait_tp_plan" in rows["mistral"]["hooks"]


def test_adapters_table(capsys):
    main(["adapters"])
    out = capsys.readouterr().out
    assert "llama" in out and "tied_embeddings" in out and "sp_plan" in out


def test_plan_prints_styles_and_bytes_per_rank(llama_config_file, capsys):
    main(["plan", "--model_config", str(llama_config_file), "--tensor_parallel_size", "2", "--block_size", "32"])
    out = capsys.readouterr().out
    for text in ("model.layers.*.self_attn.q_proj", "vocab_embedding", "vocab_head", "row", "column", "parameter bytes"):
        assert text in out
    # vocab 61 pads to 62 rows (31 per rank): the local embedding shape shows the padding
    assert "(31, 32)" in out


def test_plan_shows_pipeline_stages(llama_config_file, capsys):
    main(["plan", "--model_config", str(llama_config_file), "--tensor_parallel_size", "2", "--block_size", "32",
          "--pipeline_parallel_size", "2", "--num_microbatches", "2"])
    out = capsys.readouterr().out
    assert "model.layers.1" in out and "every stage" in out and "pp rank" in out


def test_plan_bytes_add_up():
    """Bytes per rank: sharded parameters split, replicated ones (norms) counted on every rank."""
    import torch
    from transformers import AutoModelForCausalLM

    from plait.plugin.registry import default_registry
    from plait.tp.layout import param_specs, plan_tensor_parallel

    config = tiny_config("llama")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    registry = default_registry()
    plan = registry.tp_plan(registry.resolve(config), config)
    specs = [param_specs(model, plan_tensor_parallel(model, plan, 2, r)) for r in range(2)]
    per_rank = parameter_bytes_per_rank(model, specs)
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    total = sum(p.numel() * 4 for p in model.parameters())
    padding = 2 * 1 * 32 * 4  # embedding and head: one padding row of 32 floats on rank 1 each
    assert per_rank[0] + per_rank[1] == total + norms + padding


def test_plan_refuses_a_tp_plan_the_adapter_cannot_derive(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "doge", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 16}))
    with pytest.raises(SystemExit):
        main(["plan", "--model_config", str(path), "--tensor_parallel_size", "2"])
    assert "dt_proj: transformers' style 'rowwise' inside attention has no plait rule" in capsys.readouterr().err


@pytest.mark.parametrize("name", [n for n in dir(hookspecs) if n.startswith("plait_")])
def test_every_hook_is_documented(name):
    doc = inspect.getdoc(getattr(hookspecs, name))
    assert doc and len(doc) > 80, f"hook {name} needs a docstring: it is the plugin author's reference"


def test_plan_refuses_what_train_refuses(llama_config_file, capsys):
    """`plait plan` renders the LayoutPlan `parallelize` applies: a schedule train refuses is refused here too."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model_config", str(llama_config_file), "--pipeline_parallel_size", "2",
              "--num_microbatches", "1", "--block_size", "32"])
    assert exit_info.value.code == 2
    assert "needs num_microbatches >= pp, got num_microbatches=1 < pp=2" in capsys.readouterr().err


def test_the_command_starts_without_transformers_model_code():
    """``import plait.cli`` (the parser, the launcher process, ``plait --help``) leaves transformers' modeling_utils
    unimported: plait's public names load on first use (PEP 562), which took its import from 8.7-10.3 s to 4.5-5.2 s
    here. The names still resolve, and ``plait.parallelize`` stays the function once its module is imported. And
    what that import of transformers' model code logs with torchao installed (the float8 extra: kernel libraries
    this build lacks, enum registrations), which no plait user can act on, is quieted: without plait's quieting
    (those loggers set to WARNING first) 4 such lines appear here."""
    code = ("import sys, plait.cli; print('transformers.modeling_utils' in sys.modules); "
            "import plait, plait.parallelize as m; print(callable(plait.parallelize), m is plait.parallelize, "
            "plait.ParallelConfig.__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True", "True", "ParallelConfig"], result.stdout
    assert "Failed to load" not in result.stderr and "_pytree" not in result.stderr, result.stderr
    import plait

    assert sorted(plait.__all__) == sorted(plait._EXPORTS)  # the written-out list names what loads
