"""Write examples/sft/conversations.jsonl: short generated conversations (public domain: made here from
templates), for the SFT and LoRA examples. Deterministic; lengths are skewed (mostly one exchange, some
several), as real chat data is.

    python examples/sft/make_conversations.py [--out examples/sft/conversations.jsonl] [--count 400]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "up": "down", "light": "dark", "early": "late",
             "happy": "sad", "full": "empty", "open": "closed", "old": "new", "high": "low", "wet": "dry"}
COLOURS = {"grass": "green", "the sky": "blue", "snow": "white", "coal": "black", "a lemon": "yellow",
           "a tomato": "red", "an orange": "orange", "a plum": "purple", "chocolate": "brown", "ash": "grey"}
ANIMALS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot",
           "lion": "roar", "frog": "croak", "horse": "neigh", "bee": "buzz"}
SYSTEM = ["You are a helpful assistant.", "Answer in one short sentence.", "You are a patient teacher."]


def exchange(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(7), rng.randrange(6)
        return f"What is {NUMBERS[a]} plus {NUMBERS[b]}?", f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    if kind == 1:
        word = rng.choice(sorted(OPPOSITES))
        return f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."
    if kind == 2:
        thing = rng.choice(sorted(COLOURS))
        return f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {COLOURS[thing]}."
    if kind == 3:
        animal = rng.choice(sorted(ANIMALS))
        return f"What does a {animal} say?", f"A {animal} says {ANIMALS[animal]}."
    n = rng.randrange(2, 7)
    return f"Count to {NUMBERS[n]}.", ", ".join(NUMBERS[1:n + 1]).capitalize() + "."


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEM)}] if rng.random() < 0.3 else []
    turns = 1 if rng.random() < 0.7 else rng.randrange(2, 6)  # skewed: most are one exchange
    for _ in range(turns):
        question, answer = exchange(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("conversations.jsonl")))
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(args.count)))
    tmp.rename(out)
    print(f"wrote {args.count} conversations to {out}")


if __name__ == "__main__":
    main()
