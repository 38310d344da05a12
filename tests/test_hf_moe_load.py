"""MoE model directories as transformers saves them (routed experts one by one, in the original names) load into
plait: exactly at one process, as each rank's slices at tp=2 and ep=2 (tests/workers/hf_moe_load.py, one world
of 2) with an ep rank reading only its experts' bytes, and through ``plait train``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

from plait.base.config import ConfigError, ParallelConfig
from plait.checkpoint.hf_conversion import converted
from plait.checkpoint.hf_dir import read_hf_index
from plait.checkpoint.load import CheckpointReader
from plait.checkpoint.materialize import load_parallel_model
from plait.checkpoint.st_io import SafetensorsFile
from plait.cli import main
from plait.run.metrics import read_metrics
from plait.testing import launch
from plait.testing.conformance_modes import load_subject

WORKER = str(Path(__file__).parent / "workers" / "hf_moe_load.py")
ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")
EXPERT = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's stored tensor (not DeepSeek's shared_experts)


def original(arch: str) -> torch.nn.Module:
    """The family's tiny model with seeded weights; DeepSeek-V3's router bias (a buffer) random too."""
    config = load_subject(f"transformers:{arch}").config
    if arch == "deepseek_v3":
        config.num_key_value_heads = 4  # as many as attention heads: tp=2 splits them
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.nn.Module]]:
    dirs = tmp_path_factory.mktemp("hf_moe")
    models = {arch: original(arch) for arch in ARCHS}
    for arch, model in models.items():
        model.save_pretrained(dirs / arch)
    return dirs, models


@pytest.fixture(scope="module")
def ranks(saved, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hf_moe_ranks")
    launch([WORKER, str(saved[0]), str(out)], 2, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def stored_sizes(path: Path) -> dict[str, int]:
    return {key: entry.nbytes for key, entry in SafetensorsFile(path / "model.safetensors").entries.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_one_process_load_is_bit_identical(saved, arch):
    dirs, models = saved
    assert any(EXPERT.search(key) for key in stored_sizes(dirs / arch)), "the directory stores experts one by one"
    pmodel = load_parallel_model(dirs / arch, ParallelConfig())
    want = {**dict(models[arch].named_parameters()), **dict(models[arch].named_buffers())}
    got = {**dict(pmodel.module.named_parameters()), **dict(pmodel.module.named_buffers())}
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_pieces_fit_the_stored_tensors(saved, arch):
    """One piece per expert and projection, each a box its (lower-rank) stored tensor holds."""
    dirs, models = saved
    paths, index = read_hf_index(dirs / arch)
    model = models[arch]
    names = [name for name, _ in model.named_parameters()]
    index = converted(index, get_model_conversion_mapping(model), names, model.base_model_prefix)
    CheckpointReader(paths, index).validate_files()
    experts = model.config.num_local_experts
    gate_up = next(name for name in names if name.endswith("experts.gate_up_proj"))
    assert len(index.tensors[gate_up].pieces) == 2 * experts
    assert [p.box[0] for p in index.tensors[gate_up].pieces[:experts]] == [(e, e + 1) for e in range(experts)]


def test_a_conversion_plait_cannot_slice_is_refused(saved):
    dirs, models = saved
    _, index = read_hf_index(dirs / "mixtral")
    renaming = get_checkpoint_conversion_mapping("mixtral")[0]  # block_sparse_moe -> mlp
    transposed = WeightConverter(".experts.*.w2.weight", ".experts.down_proj",
                                 operations=[MergeModulelist(dim=0), Transpose(1, 2)])
    names = [name for name, _ in models["mixtral"].named_parameters()]
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: .* Transpose"):
        converted(index, [renaming, transposed], names, "model")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_each_rank_holds_its_slices(ranks, arch, layout):
    for rank, found in enumerate(ranks):
        case = found[f"{arch}|{layout}"]
        assert case["mismatched"] == [] and case["checked"] > 0, (rank, case["mismatched"])


@pytest.mark.parametrize("arch", ARCHS)
def test_an_ep_rank_reads_only_its_experts(saved, ranks, arch):
    sizes = stored_sizes(saved[0] / arch)
    experts = {key: size for key, size in sizes.items() if EXPERT.search(key)}
    for rank, found in enumerate(ranks):
        case = found[f"{arch}|ep2"]
        (first, stop), = case["experts"]
        read = {key: size for key, size in case["read"].items() if key in experts}
        assert {int(EXPERT.search(key).group(1)) for key in read} == set(range(first, stop)), (rank, sorted(read))
        assert all(read[key] == experts[key] for key in read), rank  # each of its experts whole, once
        assert sum(read.values()) * 2 == sum(experts.values()), rank


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tp_rank_reads_half_of_each_gate_and_up(saved, ranks, arch):
    sizes = stored_sizes(saved[0] / arch)
    gate_up = [key for key in sizes if EXPERT.search(key) and re.search(r"(gate_proj|up_proj|w1|w3)\.weight$", key)]
    for rank, found in enumerate(ranks):
        read = found[f"{arch}|tp2"]["read"]
        assert {key: read.get(key) for key in gate_up} == {key: sizes[key] // 2 for key in gate_up}, rank


def test_plait_train_on_the_saved_mixtral(saved, tmp_path):
    """2 steps from the per-expert directory train exactly as from the same weights stored fused."""
    dirs, models = saved
    fused = tmp_path / "fused"
    models["mixtral"].config.save_pretrained(fused)
    save_file({k: v.contiguous() for k, v in models["mixtral"].state_dict().items()}, fused / "model.safetensors")
    losses = {}
    for source in (dirs / "mixtral", fused):
        out = tmp_path / f"out-{source.name}"
        main(["train", "--model_name_or_path", str(source), "--output_dir", str(out), "--max_steps", "2",
              "--block_size", "16"])
        losses[source.name] = [r["loss"] for r in read_metrics(out)]
    assert len(losses["mixtral"]) == 2 and losses["mixtral"] == losses["fused"], losses
