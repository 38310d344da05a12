"""Trainer features: TOML config, schedules, accumulation, evaluation, datasets dirs, plots, self-launch."""

from __future__ import annotations


import pytest

from plait.cli import build_parser, main
from plait.run.train_args import TrainArgs, from_namespace
from plait.run.trainer import train
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return str(path)


def tiny_args(model_config, out, **overrides) -> TrainArgs:
    values = dict(model_config=model_config, output_dir=str(out), max_steps=3, per_device_train_batch_size=4,
                  block_size=16, learning_rate=1e-3)
    return TrainArgs(**{**values, **overrides})


def parse(*argv: str) -> TrainArgs:
    return from_namespace(build_parser().parse_args(["train", *argv]))


def test_toml_config_and_flag_override(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('learning_rate = 0.01\nmax_steps = 7\ntensor_parallel_size = 2\ndisable_sequence_parallel = true\n')
    args = parse("--config", str(config), "--max_steps", "9")
    assert (args.learning_rate, args.max_steps, args.tensor_parallel_size, args.disable_sequence_parallel) == (0.01, 9, 2, True)
    assert args.block_size == TrainArgs().block_size  # untouched keys keep their defaults


def test_toml_unknown_key_lists_valid_keys(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("learnin_rate = 0.01\n")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(config)])
    err = capsys.readouterr().err
    assert "unknown key(s) learnin_rate" in err and "learning_rate" in err


def test_toml_wrong_type(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('max_steps = "ten"\n')
    with pytest.raises(SystemExit):
        main(["train", "--config", str(config)])
    assert "max_steps = 'ten' should be of type int" in capsys.readouterr().err


def test_bad_scheduler_lists_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--lr_scheduler_type", "cosine_restarts"])
    assert "choose one of linear, cosine, constant, constant_with_warmup" in capsys.readouterr().err


def test_warmup_and_cosine_schedule(model_config, tmp_path, capsys):
    history = train(tiny_args(model_config, tmp_path, max_steps=4, lr_scheduler_type="cosine", warmup_steps=2,
                              logging_steps=3))
    shown = [line.split(" | ")[0] for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert shown == ["step 3/4", "step 4/4"], shown  # every 3rd step, and the last (it was not printed)
    lrs = [r["lr"] for r in history]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(5e-4) and lrs[2] == pytest.approx(1e-3)
    assert lrs[3] < lrs[2]


def test_accumulation_equals_one_big_batch(model_config, tmp_path):
    """2 micro-steps of 2 sequences == 1 step of 4 sequences: same global batch, same update."""
    big = train(tiny_args(model_config, tmp_path / "big", per_device_train_batch_size=4))
    accumulated = train(tiny_args(model_config, tmp_path / "acc", per_device_train_batch_size=2,
                                  gradient_accumulation_steps=2))
    assert [r["loss"] for r in accumulated] == pytest.approx([r["loss"] for r in big], rel=1e-5)


def test_eval_loss_perplexity_and_plot(model_config, tmp_path, capsys):
    val = tmp_path / "val.txt"
    val.write_text("to be or not to be, that is the question. " * 30)
    history = train(tiny_args(model_config, tmp_path / "out", validation_file=str(val), eval_steps=2, max_steps=3,
                              logging_steps=2))
    evals = {r["step"]: r for r in history if "eval_loss" in r}
    assert sorted(evals) == [2, 3]  # every 2 steps, and at the end
    # the console shows every evaluation, the last step's too though it is no logging step (it was not printed)
    shown = [line.split(" | ")[0] for line in capsys.readouterr().err.splitlines()
             if line.startswith("step ") and " | eval_loss " in line]
    assert shown == ["step 2/3", "step 3/3"], shown
    assert evals[3]["eval_ppl"] == pytest.approx(__import__("math").exp(evals[3]["eval_loss"]))
    assert all(r["peak_rss_mb"] > 0 for r in history)
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000


def test_fewer_validation_blocks_than_microbatches_are_evaluated_whole(model_config, tmp_path):
    """3 validation blocks under 4 microbatches: padded with label-less rows to whole microbatches (once refused as
    fewer than dp x num_microbatches), the same eval loss as 1 microbatch."""
    val = tmp_path / "val.txt"
    val.write_text("to be or not to be " * 3)
    evals = [train(tiny_args(model_config, tmp_path / str(m), validation_file=str(val), max_steps=1, save_final=False,
                             num_microbatches=m))[-1]["eval_loss"] for m in (1, 4)]
    assert evals[1] == pytest.approx(evals[0], rel=1e-6), evals


def test_dataset_name_local_dir(model_config, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [f"line {i} of a tiny local dataset" * 5 for i in range(40)]}).save_to_disk(
        str(tmp_path / "ds"))
    history = train(tiny_args(model_config, tmp_path / "out", dataset_name=str(tmp_path / "ds"), max_steps=2))
    assert len(history) == 2


def test_dataset_without_text_column(model_config, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(SystemExit):
        main(["train", "--model_config", model_config, "--dataset_name", str(tmp_path / "ds"), "--block_size", "16",
              "--output_dir", str(tmp_path / "out")])
    assert "no 'text' column" in capsys.readouterr().err


def test_exclude_embeddings_from_weight_decay_flag(model_config, tmp_path):
    from plait.run.trainer import Trainer

    args = parse("--model_config", model_config, "--output_dir", str(tmp_path / "out"), "--block_size", "16",
                 "--weight_decay", "0.1", "--exclude_embeddings_from_weight_decay")
    trainer = Trainer(args)
    embedding = trainer.pmodel.module.get_parameter("model.embed_tokens.weight")
    decayed, kept = trainer.optimizer.param_groups
    assert any(p is embedding for p in kept["params"]) and not any(p is embedding for p in decayed["params"])


def test_a_cpu_trainer_keeps_freed_memory_for_the_next_step(model_config, tmp_path, monkeypatch):
    """On the CPU the trainer tells glibc to keep what a step frees (``plait.base.host_memory``: CPU steps page-faulted
    their activations in again every step: up to 24% of a step on the 2-core VM)."""
    from plait.run import trainer

    calls: list[int] = []
    monkeypatch.setattr(trainer, "keep_freed_memory", lambda: calls.append(1) or True)
    trainer.Trainer(parse("--model_config", model_config, "--output_dir", str(tmp_path / "out"), "--block_size", "16"))
    assert calls == [1]
