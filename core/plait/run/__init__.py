"""The application: ``plait train`` and ``plait prepare-data``. Flags (``train_args``), the model config they name,
the data entry (``train_data``), the loop (``trainer``), process start-up (``runtime``, ``torchrun``), heartbeats,
metrics and their console line, trackers and stopping on a signal.

Nothing below imports this package: the library (``plait.parallelize``, the optimizer, checkpoints) serves a
user's own loop as it serves this one.
"""
