"""LoRA under tensor, sequence and pipeline parallelism and ZeRO-1, in peft's semantics and format.

``config`` (peft's ``LoraConfig`` from plait's flags), ``plan`` (what each tp rank holds, pure), ``layers``
(the adapters on plait's layers), ``export`` (peft adapter directory, merged model). docs/lora.md says how
the adapters are sharded and why.
"""

from plait.lora.config import lora_config
from plait.lora.plan import LoraPlan

__all__ = ["LoraPlan", "lora_config"]
