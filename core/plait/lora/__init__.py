"""LoRA under tensor, sequence, pipeline and expert parallelism and ZeRO-1, in peft's semantics and format.

``config`` (peft's ``LoraConfig`` from plait's flags), ``layout`` (what each tp rank holds, pure: LoRA's part of
the layout plan), ``layers`` (the adapters on plait's layers), ``experts`` (the update of a routed expert weight,
peft's ``target_parameters``), ``base`` (the frozen weights a LoRA checkpoint
refers to), ``export`` (peft adapter directory, merged model). docs/lora.md says how the adapters are sharded
and why.
"""

from plait.lora.config import lora_config
from plait.lora.layout import LoraPlan

__all__ = ["LoraPlan", "lora_config"]
