"""``plait train`` end to end: metrics, layout-independent data and losses, clear errors for bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli import main
from plait.run.metrics import read_metrics
from plait.run.train_args import TrainArgs
from plait.run.trainer import train
from plait.testing import launch
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return path


def common_flags(model_config: Path, out: Path) -> list[str]:
    return ["--model_config", str(model_config), "--output_dir", str(out), "--max_steps", "3",
            "--per_device_train_batch_size", "4", "--block_size", "16", "--learning_rate", "1e-3"]


@pytest.fixture(scope="module")
def single_process_losses(model_config, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("single")
    flags = common_flags(model_config, out)
    args = TrainArgs(**{flags[i][2:]: flags[i + 1] for i in range(0, len(flags), 2)})
    args.max_steps, args.per_device_train_batch_size, args.block_size = 3, 4, 16
    args.learning_rate = 1e-3
    history = train(args)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    return [r["loss"] for r in history]


def test_metrics_written(single_process_losses):
    assert len(single_process_losses) == 3
    assert single_process_losses[-1] < single_process_losses[0]


@pytest.mark.parametrize("flags", [["--tensor_parallel_size", "2"],
                                   ["--tensor_parallel_size", "2", "--disable_sequence_parallel"],
                                   ["--pipeline_parallel_size", "2", "--num_microbatches", "2"],
                                   ["--pipeline_parallel_size", "2", "--num_microbatches", "2", "--virtual_pipeline_size",
                                    "2", "--pipeline_schedule", "interleaved-1f1b", "--model_config_layers", "4"]])
def test_tp2_under_launcher_matches_single_process(model_config, tmp_path, single_process_losses, flags):
    """tp=2 and pp=2 see the same tokens and (fp32) the same losses as one process: the batch depends only on
    the seed."""
    if "--model_config_layers" in flags:  # interleaved v=2 over 2 ranks needs 4 layers: its own reference
        flags = flags[:-2]
        config = tmp_path / "config4.json"
        config.write_text(tiny_config("llama", num_hidden_layers=4).to_json_string())
        args = TrainArgs(model_config=str(config), output_dir=str(tmp_path / "ref"), max_steps=3,
                         per_device_train_batch_size=4, block_size=16, learning_rate=1e-3)
        single_process_losses = [r["loss"] for r in train(args)]
        model_config = config
    launch(["-m", "plait", "train", *common_flags(model_config, tmp_path), *flags], 2, timeout=180)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert losses == pytest.approx(single_process_losses, rel=1e-5)


@pytest.mark.parametrize("flags", [[], ["--zero_1", "--gradient_checkpointing"]])
def test_dp2_halves_per_device_batch_same_losses(model_config, tmp_path, single_process_losses, flags):
    """dp=2 with half the per-device batch has the same global batch, so the same losses (ZeRO-1 too)."""
    flags = common_flags(model_config, tmp_path) + flags
    flags[flags.index("--per_device_train_batch_size") + 1] = "2"
    launch(["-m", "plait", "train", *flags], 2, timeout=180)
    assert [r["loss"] for r in read_metrics(tmp_path)] == pytest.approx(single_process_losses, rel=1e-5)


def test_jsonl_train_file(model_config, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"document number {i} " * 20}) for i in range(20)))
    args = TrainArgs(model_config=str(model_config), train_file=str(data), output_dir=str(tmp_path / "out"),
                     max_steps=2, per_device_train_batch_size=2, block_size=16)
    assert len(train(args)) == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--block_size", "128"], "--block_size=128 is larger than the model's max_position_embeddings=64"),
        (["--tensor_parallel_size", "2", "--block_size", "15"], "--block_size=15 is not divisible by --tensor_parallel_size=2"),
        (["--train_file", "/nonexistent/x.txt"], "--train_file '/nonexistent/x.txt' does not exist"),
        (["--model_name_or_path", "/tmp"], "not both"),
        (["--learning_rate", "-1"], "--learning_rate=-1.0 must be a finite number >= 0"),
        (["--max_steps", "-1"], "--max_steps=-1 must be >= 0"),
        (["--optimizer_dtype", "float16"], "--optimizer_dtype='float16' is unknown; choose float32 or bfloat16"),
        (["--max_grad_norm", "-1"], "--max_grad_norm=-1.0 must be >= 0"),
        (["--bf16", "--bf16_autocast"], "not both"),
        (["--pipeline_schedule", "fast"], "pipeline_schedule='fast' is unknown"),
        (["--pipeline_parallel_size", "3", "--num_microbatches", "4"], "layers"),
        (["--tensor_parallel_size", "2"], "world size 1 is not divisible by tp*pp = 2*1 = 2"),
        (["--tensor_parallel_size", "3", "--disable_sequence_parallel"], "num_attention_heads=4 is not divisible by --tensor_parallel_size 3"),
        (["--float8", "rowwise", "--device", "cpu"], "this run is on cpu: add --float8_emulate"),
        (["--float8", "rowwise", "--float8_emulate", "--block_size", "24"], "--block_size=24 is not a multiple of 16"),
    ],
)
def test_bad_flags_fail_fast_with_message(model_config, tmp_path, capsys, extra, message):
    flags = common_flags(model_config, tmp_path / "out") + extra  # later flags override earlier ones
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_model_name_or_path_uses_its_weights_and_tokenizer(tmp_path):
    """A local HF model dir: its weights are loaded and its own tokenizer makes the tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from plait.data import GlobalBatchSampler, default_corpus_path, train_bpe_tokenizer
    from plait.data.blocks import training_blocks

    text = tmp_path / "small.txt"
    text.write_text(default_corpus_path().read_text()[:20000])
    model_dir = tmp_path / "model"
    torch.manual_seed(123)  # not the trainer's seed: the loaded weights must win over random init
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=300))
    model.save_pretrained(model_dir)
    train_bpe_tokenizer([text], 300).save_pretrained(model_dir)

    args = TrainArgs(model_name_or_path=str(model_dir), train_file=str(text), output_dir=str(tmp_path / "out"),
                     max_steps=1, per_device_train_batch_size=2, block_size=16, seed=0)
    loss = train(args)[0]["loss"]
    blocks, tokenizer = training_blocks([text], 16, 300, tokenizer_dir=model_dir)
    batch = blocks[GlobalBatchSampler(len(blocks), 2, 0).indices(0)]
    expected = model(input_ids=batch, labels=batch).loss.item()
    assert tokenizer is not None and len(tokenizer) == 300
    assert loss == pytest.approx(expected, rel=1e-5)


def test_bf16_close_to_fp32(model_config, tmp_path, single_process_losses):
    """bf16 parameters with fp32 master weights follow the fp32 curve within 2e-2."""
    args = TrainArgs(model_config=str(model_config), output_dir=str(tmp_path), max_steps=3,
                     per_device_train_batch_size=4, block_size=16, learning_rate=1e-3, bf16=True)
    losses = [r["loss"] for r in train(args)]
    assert losses == pytest.approx(single_process_losses, rel=2e-2)
    assert all("grad_norm" in r and "lr" in r for r in read_metrics(tmp_path))
