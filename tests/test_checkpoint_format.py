"""Single-process checks of the checkpoint building blocks: safetensors slice I/O, box math, seeded init,
rotation, and consolidation options and failures (multi-process behaviour: test_checkpoint_dist.py)."""

import errno
import itertools
import json
import math
import os
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from plait import ParallelConfig, default_registry
from plait.base.config import ConfigError
from plait.checkpoint import (
    CheckpointError, checkpoint_path, consolidate, latest_checkpoint, list_checkpoints, load_checkpoint,
    rotate_checkpoints, save_checkpoint, should_save,
)
from plait.checkpoint import st_io
from plait.checkpoint.format import flat_range_boxes, spec_boxes, uncovered
from plait.checkpoint.materialize import SeededInit, load_parallel_model
from plait.checkpoint.state import LocalTensor, torch_optimizer_state
from plait.tp.sharding import ShardSpec

TINY = dict(vocab_size=61, bos_token_id=0, eos_token_id=1)


def llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, **{**TINY, **overrides})


# -- safetensors I/O ------------------------------------------------------------------------------------


def test_writer_output_is_read_by_safetensors(tmp_path):
    tensors = {"w": torch.randn(5, 7), "h": torch.randn(3, 4).to(torch.bfloat16), "step": torch.tensor(3.0),
               "ids": torch.arange(6, dtype=torch.int64), "mask": torch.tensor([True, False])}
    sums = st_io.write_tensors(tmp_path / "a.safetensors", tensors)
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor), name
    parsed = st_io.SafetensorsFile(tmp_path / "a.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(parsed.read(name), tensor), name
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert sums[name] == parsed.checksum(name) == xxhash.xxh3_64_intdigest(raw), name


@pytest.mark.parametrize("refusal", [None, errno.EOPNOTSUPP, errno.EINVAL])
def test_writes_are_uncached_where_taken_and_plain_where_refused(tmp_path, monkeypatch, refusal):
    """Checkpoint files are written with RWF_DONTCACHE (bench/async_save.py: 1.04-1.05x a run without saves with
    it, 1.08-1.12x without); a kernel or file system that refuses the flag gets plain writes, the same bytes."""
    monkeypatch.setattr(st_io, "UNCACHED", True)
    flags, real = [], os.pwritev

    def pwritev(fd, buffers, offset, flag=0):
        flags.append(flag)
        if refusal is not None:
            raise OSError(refusal, os.strerror(refusal))
        return real(fd, buffers, offset, flag)

    monkeypatch.setattr(os, "pwritev", pwritev)
    tensors = {"w": torch.randn(300, 70), "b": torch.randn(9)}
    sums = st_io.write_tensors(tmp_path / "a.safetensors", tensors)
    parsed = st_io.SafetensorsFile(tmp_path / "a.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(parsed.read(name), tensor) and sums[name] == parsed.checksum(name), name
    assert set(flags) == {st_io.RWF_DONTCACHE}
    if refusal is None:
        assert st_io.UNCACHED and len(flags) == 3  # the header and each tensor
    else:
        assert not st_io.UNCACHED and len(flags) == 1  # refused once, plain writes from then on
    with pytest.raises(OSError, match="No space left"):  # any other error is the write's own, raised
        monkeypatch.setattr(st_io, "UNCACHED", True)
        monkeypatch.setattr(os, "pwritev", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
        st_io.write_tensors(tmp_path / "b.safetensors", tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]  # no partial file left


@pytest.mark.parametrize("small_chunks", [False, True])
def test_read_box_equals_slicing(tmp_path, monkeypatch, small_chunks):
    if small_chunks:  # force the chunked and the one-read-per-row paths on small tensors
        monkeypatch.setattr(st_io, "CHUNK_BYTES", 64)
        monkeypatch.setattr(st_io, "MIN_RUN_BYTES", 8)
    gen = torch.Generator().manual_seed(0)
    tensors = {"m": torch.randn(9, 12, generator=gen), "c": torch.randn(4, 5, 6, generator=gen),
               "v": torch.randn(17, generator=gen), "b": torch.randn(6, 8, generator=gen).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "t.safetensors")
    parsed = st_io.SafetensorsFile(tmp_path / "t.safetensors")
    for name, full in tensors.items():
        for _ in range(12):
            box = []
            for size in full.shape:
                a = int(torch.randint(0, size, (), generator=gen))
                box.append((a, int(torch.randint(a + 1, size + 1, (), generator=gen))))
            want = full[tuple(slice(a, b) for a, b in box)]
            out = torch.empty(want.shape, dtype=full.dtype)
            parsed.read_box(name, box, out)
            assert torch.equal(out, want), (name, box)
            wide = torch.zeros((*want.shape[:-1], want.shape[-1] + 3), dtype=torch.float64)  # strided, converted
            parsed.read_box(name, box, wide[..., 1:-2])
            assert torch.equal(wide[..., 1:-2], want.double()), (name, box)


def test_damaged_safetensors_files_are_named(tmp_path):
    save_file({"w": torch.randn(8, 8)}, tmp_path / "ok.safetensors")
    raw = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(raw[:-5])
    (tmp_path / "garbage.safetensors").write_bytes(raw[:8] + b"{" * (len(raw) - 8))
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    for name, message in [("short", "truncated"), ("garbage", "not valid JSON"), ("tiny", "too short"),
                          ("missing", "missing")]:
        with pytest.raises(st_io.SafetensorsError, match=message) as info:
            st_io.SafetensorsFile(tmp_path / f"{name}.safetensors")
        assert f"{name}.safetensors" in str(info.value)


# -- box math --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_flat_range_boxes_cover_exactly_the_range(shape):
    total = math.prod(shape)
    flat = torch.arange(total)
    full = flat.view(shape)
    for start, stop in itertools.combinations(range(total + 1), 2):
        boxes = flat_range_boxes(shape, start, stop)
        got = torch.cat([full[tuple(slice(a, b) for a, b in box)].reshape(-1) for box, _, _ in boxes])
        assert torch.equal(got, flat[start:stop]), (shape, start, stop, boxes)
        assert [(a, b) for _, a, b in boxes] == sorted((a, b) for _, a, b in boxes)
        for box, a, b in boxes:  # each box is exactly its own contiguous flat range
            assert torch.equal(full[tuple(slice(x, y) for x, y in box)].reshape(-1), flat[a:b])


def test_uncovered_finds_the_hole():
    target = ((0, 8), (0, 4))
    assert uncovered(target, [((0, 4), (0, 4)), ((4, 8), (0, 4))]) is None
    assert uncovered(target, [((0, 8), (0, 2)), ((0, 8), (2, 4))]) is None
    assert uncovered(target, [((0, 4), (0, 4)), ((0, 8), (0, 2))]) == ((4, 8), (2, 4))
    assert uncovered((), [()]) is None


def test_spec_boxes_skip_padding_and_follow_ranges():
    spec = ShardSpec((10, 4), 0, ((8, 10),), pad=1)  # last rank of a padded vocab
    assert spec_boxes(spec) == [(((8, 10), (0, 4)), (0, 0))]
    fused = ShardSpec((4, 12), 1, ((0, 2), (4, 6), (8, 10)))  # GPT2 c_attn: q|k|v ranges of one rank
    assert [at for _, at in spec_boxes(fused)] == [(0, 0), (0, 2), (0, 4)]
    assert spec_boxes(ShardSpec((3,))) == [(((0, 3),), (0,))]


# -- seeded init -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter,config,name,shape", [
    ("llama", llama_config(), "model.layers.0.mlp.up_proj.weight", (64, 32)),
    ("llama", llama_config(), "model.norm.weight", (32,)),
    ("gpt2", GPT2Config(n_embd=32, n_layer=2, n_head=4, **TINY), "transformer.h.0.mlp.c_proj.weight", (128, 32)),
])
def test_seeded_init_slices_one_full_tensor(monkeypatch, adapter, config, name, shape):
    import plait.checkpoint.materialize as loading

    monkeypatch.setattr(loading, "INIT_CHUNK_ELEMENTS", 100)  # many row blocks
    registry = default_registry()
    init = SeededInit(registry, [a for a in registry.adapters if a.name == adapter][0], config, seed=3)
    full = torch.empty(shape)
    init.fill(name, ShardSpec(shape), full)
    if len(shape) == 1:
        assert torch.equal(full, torch.ones(shape))
        return
    assert 0.005 < full.std().item() < 0.03
    rows, cols = shape
    for spec in [ShardSpec(shape, 0, ((rows // 2, rows),), pad=2), ShardSpec(shape, 1, ((0, 8), (16, 24)))]:
        local = torch.full(spec.local_shape, -1.0)
        init.fill(name, spec, local)
        assert torch.equal(spec.slice_full(full)[: local.shape[0] - spec.pad], local[: local.shape[0] - spec.pad])


# -- rotation ----------------------------------------------------------------------------------------------


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (5, 10, 15, 20):
        (checkpoint_path(tmp_path, step) / "shards").mkdir(parents=True)
        (checkpoint_path(tmp_path, step) / "shards" / "index.json").write_text("{}")
    (tmp_path / "checkpoint-25.tmp" / "shards").mkdir(parents=True)  # an interrupted save
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-5", "checkpoint-10", "checkpoint-15",
                                                           "checkpoint-20"]
    assert rotate_checkpoints(tmp_path, 2, rank=1) == []
    assert [p.name for p in rotate_checkpoints(tmp_path, 2)] == ["checkpoint-5", "checkpoint-10"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-20"
    assert [should_save(s, 5) for s in (0, 4, 5, 10)] == [False, False, True, True]
    assert not should_save(5, 0)


# -- single-process save / load / consolidate ---------------------------------------------------------------


def train_steps(pmodel, opt, steps: int) -> None:
    for step in range(steps):
        ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(step))
        pmodel(ids, labels=ids).backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained tp=1 Llama checkpoint with a tokenizer, and the model that wrote it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("single")
    pmodel = load_parallel_model(llama_config(), ParallelConfig(), seed=1)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
    train_steps(pmodel, opt, 2)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), unk_token="[UNK]")
    path = save_checkpoint(root / "checkpoint-2", pmodel, opt, step=2, tokenizer=tokenizer)
    return path, pmodel


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
        return out.logits if hasattr(out, "logits") else out


def test_consolidate_sharded_bf16_with_tokenizer(saved, tmp_path):
    path, pmodel = saved
    out = consolidate(path / "shards", tmp_path / "hf", dtype="bfloat16", max_shard_size="10KB")
    files = set(os.listdir(out))
    assert {"model.safetensors.index.json", "tokenizer.json", "config.json", "generation_config.json"} <= files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for name, param in pmodel.module.named_parameters():
        assert torch.equal(model.state_dict()[name], param.detach().to(torch.bfloat16)), name


def test_consolidate_pytorch_format(saved, tmp_path):
    path, pmodel = saved
    out = consolidate(path, tmp_path / "pt", format="pytorch")
    assert "pytorch_model.bin" in os.listdir(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 61, (2, 8))
    torch.testing.assert_close(logits(model, ids), logits(pmodel, ids), rtol=0, atol=1e-5)


def test_consolidate_command_passes_every_flag(saved, tmp_path):
    """`plait consolidate` of a whole checkpoint: --format, --dtype and --max_shard_size all reach the files
    (pytorch shards of bf16 tensors, each at most 10 KB), and the model loads as the trained one in bf16."""
    from plait.cli import main

    path, pmodel = saved
    main(["consolidate", str(path), str(tmp_path / "pt"), "--format", "pytorch", "--dtype", "bfloat16",
          "--max_shard_size", "10KB"])
    files = sorted(f for f in os.listdir(tmp_path / "pt") if f.endswith(".bin"))
    assert len(files) > 2 and all(f.startswith("pytorch_model-") for f in files), files
    assert (tmp_path / "pt" / "pytorch_model.bin.index.json").is_file()
    for f in files:
        tensors = torch.load(tmp_path / "pt" / f, weights_only=True)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 10_000, f
        assert all(t.dtype == torch.bfloat16 for t in tensors.values()), f
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pt", dtype=torch.bfloat16)
    for name, param in pmodel.module.named_parameters():
        assert torch.equal(model.state_dict()[name], param.detach().to(torch.bfloat16)), name


def test_consolidate_refuses_bad_arguments(saved, tmp_path):
    path, _ = saved
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not empty"):
        consolidate(path, tmp_path / "full")
    with pytest.raises(ConfigError, match="format='onnx'"):
        consolidate(path, tmp_path / "x", format="onnx")
    with pytest.raises(ConfigError, match="dtype='int3'"):
        consolidate(path, tmp_path / "x", dtype="int3")
    with pytest.raises(CheckpointError, match="holds checkpoints"):
        consolidate(path.parent, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_consolidate_lora_of_a_full_checkpoint_is_one_line(saved, tmp_path, capsys):
    from plait.cli import main

    path, _ = saved
    with pytest.raises(SystemExit) as exit_info:
        main(["consolidate", str(path), str(tmp_path / "adapter"), "--lora", "adapter"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"{path} is a full checkpoint, not a LoRA one; consolidate it without --lora" in err
    assert not (tmp_path / "adapter").exists()


def damage(path: Path, how: str) -> None:
    shards = path / "shards"
    if how == "missing":
        (shards / "model-rank00000.safetensors").unlink()
    elif how == "truncated":
        f = shards / "model-rank00000.safetensors"
        f.write_bytes(f.read_bytes()[:-8])
    elif how == "corrupted":
        f = shards / "model-rank00000.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif how == "config":
        index = json.loads((shards / "index.json").read_text())
        index["model_config"]["num_hidden_layers"] = 3
        (shards / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("how,message", [
    ("missing", "model-rank00000.safetensors is missing"),
    ("truncated", "model-rank00000.safetensors has"),
    ("corrupted", "is corrupted"),
    ("config", r"does not match its model config: missing \['model.layers.2"),
])
def test_consolidate_of_a_bad_checkpoint_writes_nothing(saved, tmp_path, how, message):
    import shutil

    copy = tmp_path / "checkpoint-2"
    shutil.copytree(saved[0], copy)
    damage(copy, how)
    with pytest.raises(CheckpointError, match=message):
        consolidate(copy, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]


def test_weights_load_without_the_optimizer_files(saved, tmp_path):
    import shutil

    copy = shutil.copytree(saved[0], tmp_path / "checkpoint-2")
    (copy / "shards" / "optim-rank00000.safetensors").unlink()
    pmodel = load_parallel_model(llama_config(), ParallelConfig(), seed=5)
    load_checkpoint(copy, pmodel)
    for (name, a), b in zip(pmodel.named_parameters(), saved[1].parameters()):
        assert torch.equal(a, b), name
    consolidate(copy, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="optim-rank00000.safetensors is missing"):
        load_checkpoint(copy, pmodel, torch.optim.AdamW(pmodel.parameters()))


def test_optimizer_mismatch_and_unshardable_state(saved, tmp_path):
    path, _ = saved
    pmodel = load_parallel_model(llama_config(), ParallelConfig(), seed=2)
    with pytest.raises(CheckpointError, match="checkpoint optimizer is AdamW, this run uses SGD"):
        load_checkpoint(path, pmodel, torch.optim.SGD(pmodel.parameters(), lr=0.1))
    masters = [p.detach().clone().requires_grad_() for p in pmodel.parameters()]
    with pytest.raises(CheckpointError, match="not a parameter of the model .fp32 master weights"):
        save_checkpoint(tmp_path / "checkpoint-1", pmodel, torch.optim.AdamW(masters), step=1)
    factored = torch.optim.Adafactor(pmodel.parameters(), lr=1e-2)
    train_steps(pmodel, factored, 1)
    with pytest.raises(CheckpointError, match="row_var.*plait cannot shard it"):
        save_checkpoint(tmp_path / "checkpoint-1", pmodel, factored, step=1)
    assert not os.listdir(tmp_path)


class HalvesAdamW(torch.optim.AdamW):
    """Saves every moment as the two flat halves that two ZeRO-1 dp ranks would hold (the extension point)."""

    def plait_state(self, names, specs):
        tensors, meta = torch_optimizer_state(self, names, specs)
        out = []
        for t in tensors:
            if t.tensor.dim() == 0:
                out.append(t)
                continue
            flat = t.tensor.reshape(-1)
            for a, b in ((0, flat.numel() // 2 + 1), (flat.numel() // 2 + 1, flat.numel())):
                for box, fa, fb in flat_range_boxes(t.full_shape, a, b):
                    view = flat[fa:fb].view([hi - lo for lo, hi in box])
                    out.append(LocalTensor(t.logical, "optim", t.full_shape, view, [(box, (0,) * len(box))]))
        return out, {**meta, "class": "AdamW"}  # the update rule, so plain AdamW can resume it


def test_flat_optimizer_slices_regroup_on_load(tmp_path):
    pmodel = load_parallel_model(llama_config(), ParallelConfig(), seed=6)
    sliced = HalvesAdamW(pmodel.parameters(), lr=1e-2)
    train_steps(pmodel, sliced, 2)
    path = save_checkpoint(tmp_path / "checkpoint-2", pmodel, sliced, step=2)
    index = json.loads((path / "shards" / "index.json").read_text())
    pieces = index["tensors"]["optimizer/model.layers.0.mlp.up_proj.weight/exp_avg"]["pieces"]
    assert len(pieces) == 4 and pieces[1]["key"].endswith("#1"), pieces  # rows, partial row | partial row, rows
    fresh = load_parallel_model(llama_config(), ParallelConfig(), seed=7)
    plain = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(path, fresh, plain)
    for p_saved, p_loaded in zip(pmodel.parameters(), fresh.parameters()):
        for key, value in sliced.state[p_saved].items():
            assert torch.equal(plain.state[p_loaded][key], value), key


def test_save_replaces_an_older_checkpoint_atomically(tmp_path):
    pmodel = load_parallel_model(llama_config(), ParallelConfig(), seed=4)
    first = save_checkpoint(tmp_path / "checkpoint-1", pmodel, step=1)
    with torch.no_grad():
        pmodel.module.model.norm.weight.add_(1.0)
    save_checkpoint(tmp_path / "checkpoint-1", pmodel, step=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]
    fresh = load_parallel_model(first, ParallelConfig())
    assert torch.equal(fresh.module.model.norm.weight, pmodel.module.model.norm.weight)


def test_resume_with_the_trainers_scheduler_is_exact(tmp_path):
    """transformers' get_scheduler (what ``plait train`` uses) round-trips; one process, same layout."""
    from transformers import get_scheduler

    def setup(seed):
        pmodel = load_parallel_model(llama_config(), ParallelConfig(), seed=seed)
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2, weight_decay=0.1)
        return pmodel, opt, get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=6)

    def steps(pmodel, opt, sched, start, stop):
        losses = []
        for step in range(start, stop):
            ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(step))
            loss = pmodel(ids, labels=ids)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    pmodel, opt, sched = setup(0)
    steps(pmodel, opt, sched, 0, 3)
    path = save_checkpoint(tmp_path / "checkpoint-3", pmodel, opt, sched, step=3)
    straight = steps(pmodel, opt, sched, 3, 6)
    pmodel, opt, sched = setup(1)
    state = load_checkpoint(path, pmodel, opt, sched)
    assert steps(pmodel, opt, sched, state.step, 6) == straight


def test_bf16_with_fp32_master_weights_resumes_exactly(tmp_path):
    """plait.optim's master weights (bf16 parameters, fp32 masters and moments) through the trainer's step."""
    from plait.optim import OptimizerStep, build_optimizer

    def setup(seed):
        pmodel = load_parallel_model(llama_config(), ParallelConfig(), seed=seed, dtype=torch.bfloat16)
        opt = build_optimizer(pmodel, torch.optim.AdamW, optimizer_dtype=torch.float32, lr=1e-2)
        return pmodel, opt, OptimizerStep(pmodel.grad_sync, opt)

    def steps(pmodel, step, start, stop):
        losses = []
        for i in range(start, stop):
            ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(i))
            losses.append(pmodel.train_step(ids, ids).item())
            step()
        return losses

    pmodel, opt, step = setup(0)
    steps(pmodel, step, 0, 2)
    path = save_checkpoint(tmp_path / "checkpoint-2", pmodel, opt, step=2)
    masters = [m.clone() for m in opt.masters]
    straight = steps(pmodel, step, 2, 4)
    pmodel, opt, step = setup(1)
    load_checkpoint(path, pmodel, opt)
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, masters))  # fp32, not re-rounded from bf16
    assert steps(pmodel, step, 2, 4) == straight


def test_hub_style_gpt2_names_load(tmp_path):
    """Hub GPT2 files name tensors without the ``transformer.`` prefix and omit the tied head."""
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **TINY)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in reference.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp_path)
    pmodel = load_parallel_model(tmp_path, ParallelConfig())
    assert pmodel.module.lm_head.weight is pmodel.module.transformer.wte.weight
    ids = torch.randint(0, 61, (2, 8))
    torch.testing.assert_close(logits(pmodel, ids), logits(reference, ids), rtol=0, atol=1e-6)


def test_hf_directory_without_safetensors_is_refused(tmp_path):
    llama_config().save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="plait loads safetensors only"):
        load_parallel_model(tmp_path, ParallelConfig())
