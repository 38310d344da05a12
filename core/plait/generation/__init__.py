"""Generation from a laid-out model's shards: ``plait.generate(pmodel, prompts, ...)`` (plait.generation.decode)."""

from plait.generation.decode import generate

__all__ = ["generate"]
