"""`plait consolidate --dtype float32` of a `plait train --bf16` checkpoint writes the fp32 master weights saved beside
the bf16 parameters (the trained values; the parameters are only them rounded, and upcasting those kept the
rounding): at one process and at tp=2 x ZeRO-1 (masters split like the weights, saved by the dp ranks owning them),
in both formats, whole or in shards, and for `--lora merged`, whose merge adds the adapters' masters in float32.
`--dtype bfloat16` still writes the saved bf16 weights; `--dtype float16` rounds the masters (finer than bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from plait.checkpoint.format import full_box, read_index
from plait.checkpoint.load import CheckpointReader
from plait.checkpoint.lora_export import ADAPTER_WEIGHTS, PEFT_PREFIX, merge_into
from plait.checkpoint.st_io import DTYPES
from plait.checkpoint.state import optimizer_key
from plait.cli import main
from plait.lora.base import saved_lora
from plait.testing import launch
from tiny_models import tiny_config, tiny_model


def flags(out: Path, *extra: str) -> list[str]:
    """Two bf16 steps (fp32 masters), saved at the second."""
    return ["--output_dir", str(out), "--max_steps", "2", "--block_size", "16", "--per_device_train_batch_size", "4",
            "--save_steps", "2", "--lr_scheduler_type", "constant", "--bf16", *extra]


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama", vocab_size=300).to_json_string())  # 300: room for a BPE tokenizer
    return str(path)


@pytest.fixture(scope="module")
def one(model_config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one")
    main(["train", "--model_config", model_config, *flags(out)])
    return out / "checkpoint-2"


@pytest.fixture(scope="module")
def tp2_zero1(model_config, tmp_path_factory) -> Path:
    """tp=2 x dp=2 with ZeRO-1: each master is split like its weight over tp, and saved by the dp rank owning it."""
    out = tmp_path_factory.mktemp("tp2_zero1")
    argv = flags(out, "--tensor_parallel_size", "2", "--zero_stage", "1")
    launch(["-m", "plait", "train", "--model_config", model_config, *argv], 4, timeout=240)
    return out / "checkpoint-2"


def saved(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The checkpoint's parameters and their masters (by parameter name), each whole."""
    paths, index = read_index(checkpoint)
    reader = CheckpointReader(paths, index)

    def whole(logical: str) -> torch.Tensor:
        entry = index.tensors[logical]
        out = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
        reader.read(logical, full_box(entry.shape), out)
        return out

    weights = {name: whole(name) for name in index.params()}
    return weights, {name: whole(optimizer_key(name, "master")) for name in weights}


def written(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a consolidated directory's weight files (safetensors or torch.save), by name."""
    tensors = {}
    for file in folder.iterdir():
        if file.suffix in (".safetensors", ".bin"):
            tensors.update(load_file(file) if file.suffix == ".safetensors" else torch.load(file, weights_only=True))
    return tensors


@pytest.mark.parametrize("layout, options", [
    ("one", ["--format", "safetensors"]),  # whole files copied from the optimizer's
    ("one", ["--format", "pytorch", "--max_shard_size", "10KB"]),
    ("tp2_zero1", ["--format", "safetensors", "--max_shard_size", "10KB"]),  # column-split masters assembled
])
def test_float32_writes_the_fp32_masters(layout, options, request, tmp_path):
    checkpoint = request.getfixturevalue(layout)
    weights, masters = saved(checkpoint)
    assert masters.keys() == weights.keys() and all(w.dtype == torch.bfloat16 for w in weights.values())
    main(["consolidate", str(checkpoint), str(tmp_path / "fp32"), "--dtype", "float32", *options])
    main(["consolidate", str(checkpoint), str(tmp_path / "bf16"), "--dtype", "bfloat16", *options])
    main(["consolidate", str(checkpoint), str(tmp_path / "fp16"), "--dtype", "float16", *options])
    fp32, bf16, fp16 = written(tmp_path / "fp32"), written(tmp_path / "bf16"), written(tmp_path / "fp16")
    assert fp32.keys() == bf16.keys() == fp16.keys() == weights.keys()
    if "--max_shard_size" in options:
        assert len(list((tmp_path / "fp32").glob("*.index.json"))) == 1
    for name, master in masters.items():
        assert fp32[name].dtype == torch.float32 and torch.equal(fp32[name], master), name
        assert not torch.equal(fp32[name], weights[name].float()), name  # trained below bf16's resolution
        assert torch.equal(bf16[name], weights[name]) and torch.equal(master.to(torch.bfloat16), weights[name]), name
        # float16 has 3 more mantissa bits than bf16: rounded from the master, not from the bf16 weight
        assert torch.equal(fp16[name], master.to(torch.float16)), name


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> tuple[Path, Path]:
    """A bf16 LoRA run on a saved base: its checkpoint holds the adapters and their masters."""
    base = tmp_path_factory.mktemp("base") / "model"
    tiny_model("llama", vocab_size=300).save_pretrained(base)
    out = tmp_path_factory.mktemp("lora")
    main(["train", "--model_name_or_path", str(base), *flags(out, "--lora_r", "4", "--lora_alpha", "8",
                                                              "--learning_rate", "1e-2")])
    return base, out / "checkpoint-2"


def test_lora_merged_adds_the_adapters_fp32_masters(lora, tmp_path):
    """The merged model adds the adapters' masters (the adapter written in float32 is them too)."""
    base, checkpoint = lora
    weights, masters = saved(checkpoint)
    main(["consolidate", str(checkpoint), str(tmp_path / "adapter"), "--lora", "adapter", "--dtype", "float32"])
    adapter = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert adapter.keys() == {PEFT_PREFIX + name for name in masters}
    assert all(torch.equal(adapter[PEFT_PREFIX + name], master) for name, master in masters.items())
    main(["consolidate", str(checkpoint), str(tmp_path / "merged"), "--lora", "merged", "--dtype", "float32"])
    merged = written(tmp_path / "merged")
    config = saved_lora(read_index(checkpoint)[1].extra)[0]
    expected = merge_into(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), masters, config)
    rounded = merge_into(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), weights, config)
    adapted = [name for name, t in expected.state_dict().items() if not torch.equal(t, rounded.state_dict()[name])]
    assert adapted and all(".self_attn." in name or ".mlp." in name for name in adapted)
    assert merged.keys() == expected.state_dict().keys()
    assert all(torch.equal(merged[name], t) for name, t in expected.state_dict().items())


def test_a_lora_checkpoint_is_no_model_to_start_from(lora, tmp_path, capsys):
    """--model_name_or_path a LoRA checkpoint (adapters and a reference to their base) is refused in one line naming
    the two ways on, rather than its adapters read as a model's weights."""
    _, checkpoint = lora
    with pytest.raises(SystemExit) as end:
        main(["train", "--model_name_or_path", str(checkpoint), "--output_dir", str(tmp_path / "out"), "--max_steps",
              "1", "--block_size", "16"])
    assert end.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        f"{checkpoint} is a LoRA checkpoint (adapters and a reference to their base), not a model to start from; "
        f"resume it with --resume_from_checkpoint, or give the directory `plait consolidate {checkpoint} DIR --lora "
        f"merged` writes")
