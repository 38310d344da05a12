"""Generation from a laid-out model's shards: the decoding loop of ``ParallelModel.generate`` (decode.py)."""
