"""Reward functions in TRL's signature for the examples: ``vowels`` (examples/grpo_toy.py: the share of a completion's
letters that are vowels, a dense signal a tiny model from scratch climbs in a few dozen steps) and ``overlap``
(docs/post-training.md's walkthrough)."""


def vowels(prompts, completions, **columns):
    letters = [[c for c in text.lower() if c.isalpha()] for text in completions]
    return [sum(c in "aeiou" for c in chars) / len(chars) if chars else 0.0 for chars in letters]


def overlap(prompts, completions, chosen, **columns):
    """The share of the reference answer's words (the preference rows' ``chosen`` answer, passed on as a column) that
    the completion says: examples/preference/pairs.jsonl as prompts for docs/post-training.md's walkthrough."""
    def words(text):
        return {w.strip(".,!?").lower() for w in text.split() if w.strip(".,!?")}

    found = []
    for completion, answer in zip(completions, chosen):
        said = completion[0]["content"] if isinstance(completion, list) else completion
        wanted = words(answer[0]["content"] if isinstance(answer, list) else answer)
        found.append(len(words(said) & wanted) / len(wanted) if wanted else 0.0)
    return found
