"""``plait train --method cpo`` (SimPO as ``--loss_type simpo --cpo_alpha 0``) and ``--method orpo`` held to TRL
1.16's CPOTrainer and ORPOTrainer on one process: the same tiny Llama, pairs and order as tests/test_dpo.py, fp32
(bf16 off), 2 steps; the loss and every logged metric within 5e-7 (a reward against beta x the log-probs it is made
of, as there). Their layouts run in tests/test_dpo.py's world beside DPO's. The rows they train on are TRL's own
tokenization's (``tokenize_legacy``: no special tokens, BOS before the prompt, EOS after each completion), held here
to TRL's ``tokenize_row`` for plain and conversational rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.base.config import ConfigError
from plait.data import GlobalBatchSampler
from plait.run.methods.preference_loss import METRICS
from plait.run.methods.reference_free import read_legacy_pairs
from plait.run.train_args import TrainArgs
from test_dpo import BATCH, BLOCK, LR, STEPS, build_root, flags, plait_history, scale

CASES = {"cpo_sigmoid": dict(method="cpo"), "cpo_hinge": dict(method="cpo", loss_type="hinge", cpo_alpha=0.5),
         "cpo_ipo": dict(method="cpo", loss_type="ipo"),
         "simpo": dict(method="cpo", loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.7, beta=2.0),
         "simpo_smoothed": dict(method="cpo", loss_type="simpo", cpo_alpha=0.0, label_smoothing=0.1, beta=2.0),
         "orpo": dict(method="orpo", beta=0.2)}
EXTRA = {"cpo": ("nll_loss",), "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen")}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return build_root(tmp_path_factory.mktemp("free"))


def worst(got: list[dict], expected: list[dict], keys: tuple[str, ...], beta: float) -> tuple[float, str]:
    """The largest difference over steps and ``keys``, relative to test_dpo's ``scale``; ORPO's log odds against the
    two mean log-probs they are a difference of (fp32 leaves them 1e-7 of those, however small the difference)."""
    def against(record: dict, key: str) -> float:
        if key.startswith("log_odds"):
            return abs(record["logps/chosen"]) + abs(record["logps/rejected"])
        return scale(record, key, beta)

    return max((abs(g[k] - e[k]) / against(e, k) if against(e, k) else float(g[k] != e[k]),
                f"step {e['step']} {k}: {g[k]} vs {e[k]}") for g, e in zip(got, expected, strict=True) for k in keys)


def trl_history(root: Path, out: Path, method: str, **settings) -> list[dict]:
    """TRL's trainer for ``method`` (CPO or ORPO) on the pairs in plait's sampler order."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    rows = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()]
    sampler = GlobalBatchSampler(len(rows), BATCH, 0)
    order = [rows[i] for step in range(STEPS) for i in sampler.indices(step).tolist()]
    config_class, trainer_class = (CPOConfig, CPOTrainer) if method == "cpo" else (ORPOConfig, ORPOTrainer)
    config = config_class(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
                          logging_steps=1, report_to=[], max_length=BLOCK, use_cpu=True, save_strategy="no",
                          bf16=False, train_sampling_strategy="sequential", seed=0, **settings)
    model = root / "model"
    trainer = trainer_class(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), args=config,
                            train_dataset=Dataset.from_list(order),
                            processing_class=AutoTokenizer.from_pretrained(model))
    trainer.train()
    return [record for record in trainer.state.log_history if "loss" in record]


@pytest.mark.parametrize("case", CASES)
def test_each_loss_matches_trls_trainer(root, tmp_path, case):
    settings = dict(CASES[case])
    method = settings.pop("method")
    expected = trl_history(root, tmp_path / "trl", method, **settings)
    got = plait_history(root, tmp_path / "plait", method=method, validation_file=None, **settings)
    difference, where = worst(got, expected, ("loss", *METRICS, *EXTRA[method]), beta=settings.get("beta", 0.1))
    assert difference <= 5e-7, where


def test_rows_are_trls_tokenization(root, tmp_path):
    """Plain, implicit-prompt and conversational rows give the ids TRL's CPO trainer trains on (its tokenize_row after
    its chat-template step): prompt | chosen and prompt | rejected, labelled on the completion."""
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    rows = [{"prompt": "what is two plus two", "chosen": " four", "rejected": " five five"},
            {"chosen": "hello there hi", "rejected": "hello there a cat"},
            {"prompt": [{"role": "user", "content": "name a colour"}],
             "chosen": [{"role": "assistant", "content": "blue"}],
             "rejected": [{"role": "assistant", "content": "green green"}]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = CPOConfig(output_dir=str(tmp_path / "trl"), max_length=BLOCK, report_to=[], use_cpu=True, bf16=False)
    trainer = CPOTrainer(model=AutoModelForCausalLM.from_pretrained(root / "model"), args=config,
                         train_dataset=Dataset.from_list(rows[:1]), processing_class=tokenizer)
    for row, pair in zip(rows, read_legacy_pairs(tmp_path / "rows.jsonl", tokenizer, BLOCK), strict=True):
        row = maybe_apply_chat_template(maybe_extract_prompt(row), tokenizer)
        expected = trainer.tokenize_row(row)
        for side, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            assert expected[f"{side}_input_ids"] == pair.prompt + completion, (row, side)
            assert expected[f"{side}_labels"] == [-100] * len(pair.prompt) + completion, (row, side)


@pytest.mark.parametrize(("extra", "message"), [
    (dict(method="cpo", loss_type="robust"), "--loss_type robust is not one of --method cpo's: sigmoid, hinge, ipo, "
                                             "simpo (SimPO: --loss_type simpo --cpo_alpha 0)"),
    (dict(method="orpo", loss_type="hinge"), "--loss_type has no effect without --method dpo or --method cpo or "
                                             "--method grpo (--method orpo); drop it, or use --method dpo or --method "
                                             "cpo or --method grpo"),
    (dict(method="dpo", simpo_gamma=1.0), "--simpo_gamma has no effect without --method cpo (--method dpo); drop it, "
                                          "or use --method cpo"),
    (dict(method="orpo", beta=0.0), "--beta=0.0 must be positive"),
    (dict(method="cpo", dataset_name="tests"), "--method cpo does not take --dataset_name yet"),
])
def test_bad_flags_are_one_line(root, tmp_path, extra, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        TrainArgs(**{**flags(root, output_dir=str(tmp_path / "out")), **extra}).validate()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["dpo", "cpo"])
def test_sft_data_flags_are_refused_for_preference_pairs(root, tmp_path, method):
    """--train_on_prompt and --overlong shape SFT examples; a preference method never reads them (they were accepted
    without effect). Refused when the data is read, before any process group (``check_before_launch``)."""
    from plait.run.trainer import check_before_launch

    args = TrainArgs(**flags(root, output_dir=str(tmp_path / "out"), method=method, train_on_prompt=True,
                             overlong="drop"))
    with pytest.raises(ConfigError, match=f"^--train_on_prompt, --overlong have no effect: --method {method} trains "
                                          f"on each pair's completions"):
        check_before_launch(args, 1)


def test_a_prompt_that_fills_the_block_is_dropped_and_said(root, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    rows = [{"prompt": "hello " * 40, "chosen": " four", "rejected": " five"},
            {"prompt": "hello", "chosen": " four", "rejected": " five"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len(read_legacy_pairs(tmp_path / "rows.jsonl", tokenizer, BLOCK)) == 1
    assert "dropped 1 preference row(s)" in capsys.readouterr().err
    (tmp_path / "same.jsonl").write_text(json.dumps({"prompt": "hi", "chosen": " a", "rejected": " a"}) + "\n")
    with pytest.raises(ConfigError, match="line 1: 'chosen' and 'rejected' are the same completion"):
        read_legacy_pairs(tmp_path / "same.jsonl", tokenizer, BLOCK)
