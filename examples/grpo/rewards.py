"""The toy reward of examples/grpo_toy.py, in TRL's signature: the share of a completion's letters that are vowels
(a dense signal a tiny model from scratch can climb in a few dozen steps)."""


def vowels(prompts, completions, **columns):
    letters = [[c for c in text.lower() if c.isalpha()] for text in completions]
    return [sum(c in "aeiou" for c in chars) / len(chars) if chars else 0.0 for chars in letters]
