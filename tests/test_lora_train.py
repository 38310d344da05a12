"""`plait train --lora_r`: a checkpoint holds only the adapters plus a reference to the base, resumes exactly
(and at tp=2), and `plait consolidate --lora adapter|merged` gives a peft directory and a merged model that
agree with each other on the unmodified base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from plait.base.config import ConfigError
from plait.checkpoint.lora_export import consolidate_lora
from plait.cli import main
from plait.run.metrics import read_metrics
from plait.testing import launch
import processes
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "model"
    tiny_model("llama", vocab_size=300).save_pretrained(path)  # 300: room for a BPE tokenizer
    return path


def flags(base, out, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(base), "--output_dir", str(out), "--max_steps", "4", "--block_size", "16",
            "--per_device_train_batch_size", "4", "--save_steps", "2", "--lr_scheduler_type", "constant",
            "--learning_rate", "1e-2", "--lora_r", "4", "--lora_alpha", "8", *extra]


def run(argv: list[str]) -> list[dict]:
    main(["train", *argv])
    return read_metrics(argv[argv.index("--output_dir") + 1])


@pytest.fixture(scope="module")
def straight(base_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_run")
    return out, run(flags(base_dir, out))


def test_checkpoint_holds_only_adapters_and_the_base_reference(base_dir, straight):
    out, records = straight
    index = json.loads((out / "checkpoint-2" / "shards" / "index.json").read_text())
    params = [n for n, t in index["tensors"].items() if t["kind"] == "param"]
    assert params and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in params), params
    assert len(params) == 2 * 7 * 2  # 7 projections x 2 layers, A and B
    base = index["extra"]["lora"]["base"]
    assert base["kind"] == "hf" and base["path"] == str(base_dir.resolve()) and base["identity"]


def test_lora_resume_is_exact_and_reshards_to_tp2(base_dir, straight, tmp_path):
    out, records = straight
    argv = flags(base_dir, tmp_path / "tp1", "--resume_from_checkpoint", str(out / "checkpoint-2"))
    for flag in ("--model_name_or_path", "--lora_r", "--lora_alpha"):  # the checkpoint names its base and LoRA
        at = argv.index(flag)
        del argv[at:at + 2]
    resumed = run(argv)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records[2:]]
    launch(["-m", "plait", "train", *flags(base_dir, tmp_path / "tp2", "--tensor_parallel_size", "2",
                                            "--resume_from_checkpoint", str(out / "checkpoint-2"))], 2, timeout=240)
    tp2 = read_metrics(tmp_path / "tp2")
    assert [r["loss"] for r in tp2] == pytest.approx([r["loss"] for r in records[2:]], rel=1e-5)


def test_consolidate_adapter_and_merged_agree_on_the_base(base_dir, straight, tmp_path):
    out, _ = straight
    main(["consolidate", str(out / "checkpoint-4"), str(tmp_path / "adapter"), "--lora", "adapter"])
    main(["consolidate", str(out / "checkpoint-4"), str(tmp_path / "merged"), "--lora", "merged"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == str(base_dir.resolve())
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=ids).logits
    assert (adapted - merged).abs().max() <= 1e-5
    assert (adapted - plain).abs().max() > 1e-3  # the adapters learned something
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_a_tied_head_merges_as_its_adapter_computes(tmp_path):
    """LoRA on GPT-2's head, which is tied to the input embedding: the merged model computes the peft adapter's
    logits (the update was written into the one tied tensor, moving the embedding too: 0.32 off in an audit)."""
    base_dir = tmp_path / "gpt2"
    tiny_model("gpt2", vocab_size=300).save_pretrained(base_dir)
    argv = flags(base_dir, tmp_path / "run", "--lora_target_modules", "c_attn,lm_head", "--max_steps", "2")
    run(argv)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    main(["consolidate", str(checkpoint), str(tmp_path / "adapter"), "--lora", "adapter"])
    main(["consolidate", str(checkpoint), str(tmp_path / "merged"), "--lora", "merged"])
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(tmp_path / "adapter"))
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert (adapted(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() <= 1e-5
        base = AutoModelForCausalLM.from_pretrained(base_dir)
    assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)  # untouched


def test_consolidate_writes_the_adapter_of_a_lora_checkpoint_by_default(straight, tmp_path, capsys):
    """A LoRA checkpoint holds no base weights: without --lora, plait consolidate writes what --lora adapter
    writes and says how to get the merged model; the Python consolidate refuses it by name."""
    from plait.checkpoint import consolidate

    ckpt = straight[0] / "checkpoint-4"
    main(["consolidate", str(ckpt), str(tmp_path / "default")])
    printed = capsys.readouterr().out
    assert f"{ckpt} is a LoRA checkpoint: wrote its adapters as a peft directory, {tmp_path / 'default'}" in printed
    assert f"run `plait consolidate {ckpt} NEW_DIR --lora merged`" in printed
    main(["consolidate", str(ckpt), str(tmp_path / "adapter"), "--lora", "adapter"])
    default, adapter = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("default", "adapter"))
    assert default.keys() == adapter.keys() and all(torch.equal(default[k], adapter[k]) for k in default)
    assert ((tmp_path / "default" / "adapter_config.json").read_text()
            == (tmp_path / "adapter" / "adapter_config.json").read_text())
    with pytest.raises(ConfigError, match=r"is a LoRA checkpoint \(the adapters and a reference to the base\); "
                                          r"write it with plait.checkpoint.lora_export.consolidate_lora"):
        consolidate(ckpt, tmp_path / "whole")
    assert not (tmp_path / "whole").exists()


def weights(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each weight file of a consolidated directory (safetensors or torch.save) by name: its tensors."""
    return {f.name: load_file(f) if f.suffix == ".safetensors" else torch.load(f, weights_only=True)
            for f in sorted(folder.iterdir()) if f.suffix in (".safetensors", ".bin")}


def test_consolidate_flags_act_on_the_merged_model(straight, tmp_path):
    """--dtype, --max_shard_size and --format reach --lora merged (they were once dropped there, writing one fp32
    safetensors file): bf16 files of at most 20 KB each (the tiny model is 151 KB in fp32), the same bytes as
    torch.save files under transformers' names, both loading with from_pretrained as the bf16 merge."""
    ckpt = straight[0] / "checkpoint-4"
    main(["consolidate", str(ckpt), str(tmp_path / "fp32"), "--lora", "merged"])
    cast = ["--lora", "merged", "--dtype", "bfloat16", "--max_shard_size", "20KB"]
    main(["consolidate", str(ckpt), str(tmp_path / "st"), *cast])
    main(["consolidate", str(ckpt), str(tmp_path / "pt"), *cast, "--format", "pytorch"])
    full = weights(tmp_path / "fp32")["model.safetensors"]
    assert all(t.dtype == torch.float32 for t in full.values())  # without --dtype: the merge's precision
    st, pt = weights(tmp_path / "st"), weights(tmp_path / "pt")
    assert len(st) > 1 and (tmp_path / "st" / "model.safetensors.index.json").is_file(), list(st)
    for name, tensors in st.items():
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000, name
        assert all(torch.equal(t, full[key].to(torch.bfloat16)) for key, t in tensors.items()), name
    as_bin = {n: "pytorch_" + n.removesuffix(".safetensors") + ".bin" for n in st}  # transformers' names
    assert list(pt) == list(as_bin.values()) and (tmp_path / "pt" / "pytorch_model.bin.index.json").is_file()
    for name, tensors in st.items():
        torch_saved = pt[as_bin[name]]
        assert torch_saved.keys() == tensors.keys() and all(torch.equal(torch_saved[k], t) for k, t in tensors.items())
    for folder in ("st", "pt"):
        assert json.loads((tmp_path / folder / "config.json").read_text())["dtype"] == "bfloat16"
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / folder, output_loading_info=True)
        assert model.dtype == torch.bfloat16 and not info["missing_keys"] and not info["unexpected_keys"], folder
        assert all(torch.equal(t, full[k].to(torch.bfloat16)) for k, t in model.state_dict().items()), folder


def test_consolidate_flags_act_on_the_adapter_or_are_refused(base_dir, straight, tmp_path, capsys):
    """--dtype and --format reach the peft adapter (bf16 tensors in adapter_model.bin, which peft loads); peft reads
    one file, so --max_shard_size is refused in one line, before any weight is read (the weights are deleted)."""
    ckpt = straight[0] / "checkpoint-4"
    main(["consolidate", str(ckpt), str(tmp_path / "fp32"), "--lora", "adapter"])
    main(["consolidate", str(ckpt), str(tmp_path / "bf16"), "--lora", "adapter", "--dtype", "bfloat16", "--format",
          "pytorch"])
    full = weights(tmp_path / "fp32")["adapter_model.safetensors"]
    saved = weights(tmp_path / "bf16")
    assert list(saved) == ["adapter_model.bin"] and saved["adapter_model.bin"].keys() == full.keys()
    assert all(torch.equal(t, full[k].to(torch.bfloat16)) for k, t in saved["adapter_model.bin"].items())
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(tmp_path / "bf16"))
    loaded = peft.get_submodule("base_model.model.model.layers.0.self_attn.q_proj").lora_A["default"].weight
    assert torch.equal(loaded.float(), saved["adapter_model.bin"][key].float())
    weightless = shutil.copytree(ckpt, tmp_path / "ckpt")
    for file in (weightless / "shards").glob("*.safetensors"):
        file.unlink()
    capsys.readouterr()  # from_pretrained's progress bars
    for lora in ([], ["--lora", "adapter"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["consolidate", str(weightless), str(tmp_path / "out"), *lora, "--max_shard_size", "1MB"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, err
        assert ("--max_shard_size 1MB with --lora adapter (a LoRA checkpoint's default): a peft adapter is one "
                "weights file (peft reads no shards); drop --max_shard_size, or write one model with --lora merged") in err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changed, message", [
    (["--lora_r", "8"], "holds LoRA adapters of --lora_r 4, which it brings back; leave out --lora_r (a LoRA "
                        "checkpoint gives its own)"),
    (["--lora_alpha", "64"], "holds LoRA adapters of --lora_alpha 8.0, which it brings back; leave out --lora_alpha"),
])
def test_other_lora_settings_beside_a_lora_resume_are_refused(base_dir, straight, tmp_path, capsys, changed, message):
    """Before any data or weight is read (a changed rank failed the load after the data; a changed alpha was
    ignored); the checkpoint's own values (the straight run's --lora_r 4 --lora_alpha 8) resume, as above."""
    out, _ = straight
    argv = flags(base_dir, tmp_path / "out", "--resume_from_checkpoint", str(out / "checkpoint-2"), *changed)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err.strip().splitlines()[-1], err
    assert not (tmp_path / "out").exists()


def test_lora_flags_beside_a_whole_model_resume_are_refused(base_dir, tmp_path, capsys):
    """A whole-model checkpoint has no adapters to go on with: --lora_r is refused naming the way to train adapters
    on its weights, and another --lora_* flag alone has no effect (it was ignored whenever a resume was given)."""
    whole = flags(base_dir, tmp_path / "whole")
    for flag in ("--lora_r", "--lora_alpha"):
        at = whole.index(flag)
        del whole[at:at + 2]
    whole[whole.index("--max_steps") + 1] = "2"
    run(whole)
    for extra, message in ((["--lora_r", "4"], "holds a whole model, no LoRA adapters; resume without --lora_r"),
                           (["--lora_alpha", "64"], "--lora_alpha has no effect without LoRA (--lora_r 0); drop it")):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", *whole, "--output_dir", str(tmp_path / "next"), "--resume_from_checkpoint",
                  str(tmp_path / "whole" / "checkpoint-2"), *extra])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err.strip().splitlines()[-1], err


def test_a_changed_base_is_refused(base_dir, straight, tmp_path):
    out, _ = straight
    moved = tmp_path / "base"
    shutil.copytree(base_dir, moved)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / "checkpoint-4", ckpt)
    index_path = ckpt / "shards" / "index.json"
    index = json.loads(index_path.read_text())
    index["extra"]["lora"]["base"]["path"] = str(moved)
    index_path.write_text(json.dumps(index))
    weights = load_file(moved / "model.safetensors")
    weights["model.norm.weight"] += 1
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="weight files changed"):
        consolidate_lora(ckpt, tmp_path / "merged", "merged")


@pytest.mark.timeout(240)  # a hang fails here; the script's subprocess goes with it
def test_lora_chat_example_ends_in_models_generate_uses(tmp_path, capfd, monkeypatch):
    """examples/lora_chat.py, 2 steps on one process: base, LoRA chat SFT, adapter and merged exports, generate.
    The script runs in this process (its own imports paid already), and so do its plait commands (plait.cli.main)."""
    root = Path(__file__).resolve().parent.parent
    processes.run_script(root / "examples" / "lora_chat.py", ["--output_dir", tmp_path, "--max_steps", "2",
                                                              "--nproc", "1"], monkeypatch)
    out = capfd.readouterr().out
    assert "assistant (peft adapter on the base):" in out and "assistant (merged model):" in out, out[-3000:]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()
