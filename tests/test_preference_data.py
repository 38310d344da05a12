"""Preference rows tokenize to TRL 1.16's token ids: plait's tokenize_pair against TRL's own DPOTrainer preprocessing
(``_prepare_dataset``: the implicit prompt, EOS on plain completions, prompt and prompt+completion tokenized whole, the
completion from their common prefix) on plain, conversational and implicit-prompt rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from datasets import Dataset
from trl.trainer.dpo_trainer import DPOTrainer

from plait.base.config import ConfigError
from plait.data.chat_tokenizer import chat_tokenizer
from plait.run.methods.preference_data import tokenize_pair

WORDS = ["what is two plus two", "four", "five", "name a colour", "blue", "green", "hello there", "hi"]

PLAIN = [{"prompt": "what is two plus two", "chosen": " four", "rejected": " five"},
         {"prompt": "name a colour", "chosen": " blue", "rejected": " green<|im_end|>"}]
CHAT = [{"prompt": [{"role": "user", "content": "what is two plus two"}],
         "chosen": [{"role": "assistant", "content": "four"}],
         "rejected": [{"role": "assistant", "content": "five"}]}]
IMPLICIT = [{"chosen": "name a colour blue", "rejected": "name a colour green"},
            {"chosen": "hello there hi", "rejected": "hello there hi there"}]
IMPLICIT_CHAT = [{"chosen": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}],
                  "rejected": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "four"}]}]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(WORDS * 20, 300)


def trl_ids(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    trainer = SimpleNamespace(_tokenizer=tokenizer)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    done = DPOTrainer._prepare_dataset(trainer, Dataset.from_list(rows), tokenizer, args, "train")
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in done]


@pytest.mark.parametrize("rows", [PLAIN, CHAT, IMPLICIT, IMPLICIT_CHAT], ids=["plain", "chat", "implicit",
                                                                             "implicit_chat"])
def test_rows_tokenize_to_trls_ids(tokenizer, rows):
    expected = trl_ids(tokenizer, rows)
    got = [tokenize_pair(tokenizer, dict(row), f"rows.jsonl line {i + 1}") for i, row in enumerate(rows)]
    assert got == expected
    assert all(chosen and rejected for _, chosen, rejected in got)


def test_a_row_without_chosen_is_refused_naming_it(tokenizer):
    with pytest.raises(ConfigError, match=r"^pairs.jsonl line 3: a preference row needs 'chosen' and 'rejected' .*"
                                          r"missing \['rejected'\], found \['chosen', 'prompt'\]$"):
        tokenize_pair(tokenizer, {"prompt": "hi", "chosen": " four"}, "pairs.jsonl line 3")
