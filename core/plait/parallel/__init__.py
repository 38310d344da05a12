"""The mechanisms that are no folder of their own: gradient reduction (``grad_sync``),
ZeRO-2/3 on FSDP2 (``fsdp``), activation checkpointing, compilation, float8 and the MoE load-balancing loss over
the global batch. Tensor, context, expert and pipeline parallelism and LoRA have folders beside this one.
"""
