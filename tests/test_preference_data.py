"""Preference rows tokenize to TRL 1.16's token ids: plait's tokenize_pair against TRL's own DPOTrainer preprocessing
(``_prepare_dataset``: the implicit prompt, EOS on plain completions, prompt and prompt+completion tokenized whole, the
completion from their common prefix) on plain, conversational and implicit-prompt rows."""

from __future__ import annotations

import json
import re
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


GOOD = {"prompt": "hi", "chosen": " four", "rejected": " five"}
USER, ASSISTANT = [{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "four"}]
# rows TRL's preprocessing stops on with a bare Python error (AttributeError, TypeError, jinja's UndefinedError)
BAD_ROWS = {
    "chosen_null": ({**GOOD, "chosen": None}, r"'chosen' is null; give it as a text, or as a list of chat messages"),
    "chosen_int": ({**GOOD, "chosen": 5}, r"'chosen' is a number \(5\); give it as a text, or as a list of chat"),
    "mixed_forms": ({**GOOD, "prompt": USER}, r"'prompt' is a list of chat messages but 'chosen' is a text; give "
                                              r"'prompt', 'chosen', 'rejected' all as texts or all as lists of chat"),
    "message_without_content": ({"prompt": USER, "chosen": [{"role": "assistant", "text": "four"}],
                                 "rejected": ASSISTANT},
                                r"'chosen' message 1 has no 'content' \(its keys: \['role', 'text'\]\); a chat message "
                                r"is \{\"role\": \.\.\., \"content\": \.\.\.\}"),
}


@pytest.mark.parametrize("method", ["dpo", "cpo"])
@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_value_is_one_line_naming_file_line_and_field(tokenizer, tmp_path, case, method):
    """DPO's reader and CPO's / ORPO's (TRL's older tokenization) both refuse before any training, naming the row."""
    from plait.run.methods.preference_data import read_pairs
    from plait.run.methods.reference_free import read_legacy_pairs

    row, message = BAD_ROWS[case]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(row) + "\n")
    read = (lambda: read_pairs(path, tokenizer, 32, "keep_start")) if method == "dpo" else \
        (lambda: read_legacy_pairs(path, tokenizer, 32))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))} line 2: {message}"):
        read()
