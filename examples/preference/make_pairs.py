"""Write examples/preference/pairs.jsonl: preference pairs in TRL's conversational form, made from the bundled SFT
conversations (examples/sft/conversations.jsonl), for the DPO walkthrough in docs/post-training.md. Each pair's
prompt is a conversation's first user turn (with its system message, where it has one), ``chosen`` its own answer
and ``rejected`` the answer another conversation gives to a different question. Deterministic.

    python examples/preference/make_pairs.py [--out examples/preference/pairs.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CONVERSATIONS = Path(__file__).resolve().parent.parent / "sft" / "conversations.jsonl"


def pairs(conversations: list[list[dict]], seed: int = 0) -> list[dict]:
    """One pair per conversation, in its order."""
    rng = random.Random(seed)
    firsts = []
    for messages in conversations:
        user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        firsts.append((messages[:user + 1], messages[user + 1]))
    out = []
    for prompt, answer in firsts:
        other = rng.choice([a for p, a in firsts if p[-1]["content"] != prompt[-1]["content"]])
        out.append({"prompt": prompt, "chosen": [answer], "rejected": [other]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("pairs.jsonl")))
    args = parser.parse_args()
    conversations = [json.loads(line)["messages"] for line in CONVERSATIONS.read_text().splitlines() if line.strip()]
    with open(args.out, "w") as file:
        for pair in pairs(conversations):
            file.write(json.dumps(pair) + "\n")


if __name__ == "__main__":
    main()
