"""LoRA under tensor, sequence and pipeline parallelism and ZeRO-1, in peft's semantics and format.

``config`` (peft's ``LoraConfig`` from plait's flags), ``layout`` (what each tp rank holds, pure: LoRA's part of
the layout plan), ``layers`` (the adapters on plait's layers), ``base`` (the frozen weights a LoRA checkpoint
refers to), ``export`` (peft adapter directory, merged model). docs/lora.md says how the adapters are sharded
and why.
"""

from plait.lora.config import lora_config
from plait.lora.layout import LoraPlan

__all__ = ["LoraPlan", "lora_config"]
