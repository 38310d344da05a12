"""SFT data that --block_size truncation mostly cuts away: a step whose global batch has no token to train on
contributes zero (logged, never a divergence), at one process and at tp=2 + SP, pp=2 and ZeRO-1 dp=2 with the
one-process losses and gradient norms step by step (and ZeRO-3 dp=2: SFT on FSDP2's shards); --overlong drop skips what has nothing left to train on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.data.chat_tokenizer import save_chat_tokenizer
from plait.run.train_args import TrainArgs
from plait.run.trainer import Trainer
from plait.testing import launch

WORKER = str(Path(__file__).parent / "workers" / "trainers.py")
STEPS = 8
LAYOUTS = {"tp2_sp": dict(tensor_parallel_size=2, per_device_train_batch_size=4),
           "pp2": dict(pipeline_parallel_size=2, num_microbatches=2, per_device_train_batch_size=4),
           "zero1_dp2": dict(zero_1=True, per_device_train_batch_size=2),
           "zero3_dp2": dict(zero_stage=3, per_device_train_batch_size=2)}


def conversations() -> list[dict]:
    """Long questions and short answers: at 30 tokens two in three answers are cut away whole, some survive."""
    out = []
    for i in range(24):
        question = " ".join(["tell me about the sea and the sky"] * (1 + 4 * (i % 3 != 0)))
        out.append({"messages": [{"role": "user", "content": question},
                                 {"role": "assistant", "content": f"blue {i % 5}"}]})
    return out


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trunc")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations()))
    tokenizer = save_chat_tokenizer([c["messages"][0]["content"] + " blue 0 1 2 3 4" for c in conversations()], 300,
                                    root / "tokenizer")
    config = root / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 320, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 64}))
    return dict(model_config=str(config), train_file=str(data), tokenizer_name=str(tokenizer), block_size=30,
                max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="constant",
                data_cache_dir=str(root / "cache"), output_dir=str(root / "one"), device="cpu")


@pytest.fixture(scope="module")
def one(flags) -> list[dict]:
    return Trainer(TrainArgs(**flags)).train()


def test_empty_steps_contribute_zero_and_are_no_divergence(flags, one):
    empty = [r["step"] for r in one if r["trainable_tokens"] == 0]
    assert empty and len(empty) < STEPS, f"the data must give both kinds of step: empty steps {empty}"
    for r in one:
        if r["step"] in empty:
            assert r["loss"] == 0.0 and r["grad_norm"] == 0.0 and r["empty_steps"] == empty.index(r["step"]) + 1
            assert r["tokens_per_s"] == 0  # it ran nothing (an audit saw 112,677 tokens/s on such steps)
        else:
            assert r["loss"] > 0 and torch.isfinite(torch.tensor(r["grad_norm"]))
    assert "skipped_steps" not in one[-1]  # nothing was taken for a non-finite step


def test_an_empty_step_applies_nothing(flags, tmp_path, capsys):
    trainer = Trainer(TrainArgs(**{**flags, "output_dir": str(tmp_path / "run")}))
    err = capsys.readouterr().err  # the counts printed are those after truncation, with a warning
    assert ("24 of 24 examples kept, 24 truncated to --block_size=30, 16 with no token left to train on; "
            "24 tokens trained on, 96 (80%) lost to truncation") in err
    assert "warning: --block_size=30 truncation loses 80% of the tokens to train on" in err
    step = next(s for s in range(STEPS)
                if trainer.blocks.labels[trainer.sampler.indices(s)][:, 1:].ne(-100).sum() == 0)
    before = {n: p.detach().clone() for n, p in trainer.pmodel.named_parameters()}
    state = [dict(s) for s in trainer.optimizer.state.values()]
    record = trainer.step(step)
    assert record["trainable_tokens"] == 0
    for name, p in trainer.pmodel.named_parameters():
        assert torch.equal(p, before[name]), name
    assert [dict(s) for s in trainer.optimizer.state.values()] == state


def test_every_layout_matches_one_process_through_empty_steps(flags, one, tmp_path):
    out = tmp_path / "out.json"
    cases = {name: {**flags, **layout, "output_dir": str(tmp_path / name)} for name, layout in LAYOUTS.items()}
    (tmp_path / "flags.json").write_text(json.dumps(cases))
    launch([WORKER, str(out), str(tmp_path / "flags.json")], 2, timeout=300)
    for layout, ranks in json.loads(out.read_text()).items():
        history = ranks[0]["history"]
        assert [r["trainable_tokens"] for r in history] == [r["trainable_tokens"] for r in one], layout
        assert [r["loss"] for r in history] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=1e-7), layout
        assert [r["grad_norm"] for r in history] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5,
                                                                   abs=1e-7), layout


def test_overlong_drop_skips_what_has_nothing_to_train_on(flags, tmp_path, capsys):
    history = Trainer(TrainArgs(**{**flags, "overlong": "drop", "output_dir": str(tmp_path / "drop")})).train()
    assert all(r["trainable_tokens"] > 0 for r in history)
    assert " dropped" in capsys.readouterr().err
