"""float8 training of the decoder layers' linear layers with torchao's float8 linear (``ParallelConfig(float8=...)``,
``plait train --float8 {tensorwise,rowwise}``).

What is converted: every ``nn.Linear`` inside the adapter's leaf modules (the decoder layers: attention projections
and MLP), whether tensor parallelism splits it or not. Embeddings and the LM head stay in high precision, as in
torchtitan (the output layer is the most sensitive to quantization, and its vocab width often not a multiple of 16).

How, per layer kind (``apply_float8``, planned by ``plan_float8`` before any process group):

- a layer tensor parallelism leaves an ``nn.Linear`` (tp=1, or a module kept whole on every tp rank) becomes
  torchao's ``Float8Linear`` (``convert_to_float8_training`` with a filter naming exactly these modules);
- plait's ``ColumnParallelLinear`` / ``RowParallelLinear`` keep their communication and call torchao's own float8
  matmul (``matmul_with_hp_or_float8_args``, the autograd function ``Float8Linear.forward`` calls, with the
  ``LinearMMConfig`` torchao derives from the recipe) on the rank's local shard (``Float8Matmul``).

Both keep the weight a plain high-precision parameter under its name: gradients, gradient sync, ZeRO-1, master
weights, checkpoints (layout-free) and consolidation see the model they see without float8. Each matmul casts its
operands to float8 (e4m3 forward; tensorwise: e5m2 gradients) with dynamic scales and computes in the input's
precision (fp32 or bf16 parameters, or bf16 under ``bf16_autocast``).

Scales under tensor parallelism are per shard. torchtitan's float8 TP computes a tensorwise scale from the amax
of the whole (DTensor-sharded) tensor; here each rank scales the tensors it holds: a column-parallel layer's
weight shard and output-gradient columns, a row-parallel layer's weight shard and input features. Rowwise scales
are per row of what the rank holds, so a split row gets one scale per shard. A shard's amax is at most the whole
tensor's, so its scale is as large or larger (no value saturates, fewer underflow); tp=2 therefore matches one
process in float8 only to within float8's rounding, not bitwise (tests/test_float8.py states by how much). With
rowwise's power-of-2 scales the rounding of a value does not depend on its scale (except below e4m3's
smallest normal), so rowwise at tp=2 follows one process to within fp32 noise.

torchao is optional: it is imported only when float8 is asked for, and a missing torchao is a ConfigError naming
``pip install 'plait[float8]'``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from plait.base import device
from plait.base.config import ConfigError, ParallelConfig
from plait.base.patterns import leaf_module_names
from plait.base.words import setting
from plait.ep.layout import other_experts, routed_experts
from plait.tp.layers import ColumnParallelLinear, RowParallelLinear
from plait.tp.sharding import ShardSpec

if TYPE_CHECKING:
    from peft import LoraConfig
    from torchao.float8 import Float8LinearConfig

ALIGN = 16  # torch._scaled_mm: both operands' dims, and the tokens of the weight-gradient matmul, multiples of 16


def installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def require_torchao(recipe: str) -> None:
    """ConfigError (one line, naming the extra) when torchao is not installed."""
    if not installed():
        raise ConfigError(f"float8={recipe} needs torchao, not installed here; pip install 'plait[float8]'")


def torchao_config(config: ParallelConfig) -> Float8LinearConfig:
    """torchao's ``Float8LinearConfig`` of ``config.float8``'s recipe (``emulate`` set from ``float8_emulate``)."""
    require_torchao(config.float8)
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(config.float8), emulate=config.float8_emulate)


def plan_float8(
    model: nn.Module, config: ParallelConfig, leaf_patterns: Sequence[str],
    specs_by_rank: Sequence[dict[str, ShardSpec]], lora: LoraConfig | None = None,
) -> tuple[str, ...]:
    """The names of the linear layers ``apply_float8`` converts (empty without float8), after every refusal:
    torchao missing, LoRA, mixture-of-experts models, transformers ``Conv1D`` layers, ``nn.Linear`` subclasses,
    and weights whose local shard (any tp rank's) is not a multiple of 16 on both dims. Pure: no collective, no
    weight read (runs on the meta model)."""
    if config.float8 is None:
        return ()
    what = f"float8={config.float8}"
    require_torchao(config.float8)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if lora is not None:
        raise ConfigError(f"{what} with LoRA is not supported (peft's LoRA layers wrap the linear layers float8 would "
                          f"convert, and the frozen base would be cast every step); train LoRA without float8")
    experts = next(iter(routed_experts(model)), None) or other_experts(model)
    if experts is not None:
        raise ConfigError(f"{what}: {model_type} is a mixture-of-experts model ({experts}: routed experts computed "
                          f"with grouped matmuls, which torchao's float8 linear does not cover); train it without "
                          f"float8")
    names = []
    for leaf in leaf_module_names(model, leaf_patterns, what):
        for child, module in model.get_submodule(leaf).named_modules():
            name = f"{leaf}.{child}" if child else leaf
            if isinstance(module, Conv1D):
                raise ConfigError(f"{what}: {name} is a transformers Conv1D (GPT-2's transposed linear), which "
                                  f"torchao's float8 linear does not convert; float8 runs models built of nn.Linear "
                                  f"(Llama, Mistral, Qwen, ...); train {model_type} without float8")
            if isinstance(module, nn.Linear):
                if type(module) is not nn.Linear:
                    raise ConfigError(f"{what}: {name} is a {type(module).__name__}, an nn.Linear subclass with its "
                                      f"own forward, which float8 would replace; train {model_type} without float8")
                names.append(name)
    if not names:
        raise ConfigError(f"{what}: the decoder layers of {model_type} ({leaf_patterns}) hold no nn.Linear to "
                          f"convert; train it without float8")
    for rank, specs in enumerate(specs_by_rank):
        for name in names:
            shape = specs[f"{name}.weight"].local_shape if f"{name}.weight" in specs else None
            shape = shape or tuple(model.get_submodule(name).weight.shape)
            if any(size % ALIGN for size in shape):
                where = f" on tp rank {rank} of tp={config.tp}" if config.tp > 1 else ""
                fix = "choose a tp that keeps them so, or train without float8" if config.tp > 1 else \
                    "train this model without float8"
                raise ConfigError(
                    f"{what}: {name}'s weight is {list(shape)} [out, in]{where}; float8 matmuls (torch._scaled_mm) "
                    f"need both dims to be multiples of {ALIGN} (checked under float8_emulate too, so that an "
                    f"emulated run is one a GPU can run); {fix}"
                )
    return tuple(names)


def check_float8_device(config: ParallelConfig, where: torch.device | str) -> None:
    """Real float8 matmuls need a GPU with float8 tensor cores (``plait.base.device.float8_unsupported``); elsewhere
    float8 runs only emulated."""
    if config.float8 is None or config.float8_emulate:
        return
    why = device.float8_unsupported(torch.device(where))
    if why is not None:
        raise ConfigError(f"float8={config.float8}: {why}: add {setting('float8_emulate', True)} to check float8 "
                          f"numerics there, without the speed-up, or train without {setting('float8')}")


def check_float8_tokens(config: ParallelConfig, tokens: int) -> None:
    """A training forward's matmuls see ``tokens`` rows per rank (a microbatch's rows x its sequence slice); the
    weight-gradient matmul contracts over them, so torch._scaled_mm needs a multiple of 16."""
    if config.float8 is not None and tokens % ALIGN:
        raise ConfigError(
            f"float8={config.float8}: a training microbatch holds {tokens} tokens per rank (rows x sequence length"
            f"{' / cp' if config.cp > 1 else ''}); float8's weight-gradient matmul (torch._scaled_mm) needs a multiple "
            f"of {ALIGN} (checked under float8_emulate too); use a sequence length that is a multiple of "
            f"{ALIGN * config.cp}"
        )


class Float8Matmul:
    """``x @ weight.T`` (``weight`` [out, in], as an ``nn.Linear``'s) in float8 through torchao's own autograd
    function, as ``Float8Linear.forward`` computes it: what plait's column- and row-parallel layers call on their
    local shards (scales per shard: see the module docstring). Under autocast the input is cast to the autocast
    dtype first, as ``Float8Linear`` does, so the output has the dtype a bf16 matmul would give."""

    def __init__(self, config: Float8LinearConfig) -> None:
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

        with torch.device("meta"):  # torchao's own derivation of the three gemms' configs from the recipe
            probe = Float8Linear(ALIGN, ALIGN, bias=False, config=config)
        self.config, self.linear_mm_config = config, probe.linear_mm_config
        self.function = matmul_with_hp_or_float8_args

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        # torchao flattens the float8 input with reshape, which a rowwise-scaled float8 tensor allows only as a view:
        # an input gathered from sequence shards (SP) is not contiguous, so it is made so before the cast.
        return self.function.apply(x.contiguous(), weight.t(), self.linear_mm_config, self.config)

    def describe(self) -> str:
        granularity = self.config.cast_config_weight.scaling_granularity.value
        return f"float8={granularity}" + (" (emulated)" if self.config.emulate else "")


def apply_float8(model: nn.Module, names: Iterable[str], config: ParallelConfig) -> int:
    """Convert the planned linear layers ``names`` (those this rank holds) of ``model``, after tensor parallelism
    and before anything else installs hooks on them; returns how many were converted."""
    names = set(names)
    if not names:
        return 0
    from torchao.float8 import convert_to_float8_training

    float8 = torchao_config(config)
    matmul = Float8Matmul(float8)
    linears = set()
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if module.transposed:  # planning refuses Conv1D, the only transposed layer
                raise AssertionError(f"{name}: a transposed tensor-parallel layer cannot be float8")
            module.float8 = matmul
        elif type(module) is nn.Linear:
            if _hooks(module):  # a swap would drop them: float8 must come before whatever installs them
                raise AssertionError(f"{name} has hooks {_hooks(module)}; apply float8 before installing them")
            linears.add(name)
        else:
            raise AssertionError(f"{name}: planned for float8 but is a {type(module).__name__} after tensor parallelism")
    if linears:
        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in linears, config=float8)
    return len(names)


def _hooks(module: nn.Module) -> list[str]:
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    return [kind for kind in kinds if getattr(module, kind, None)]


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` computes its matmul in float8 (a torchao ``Float8Linear`` or a plait TP layer given one)."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return module.float8 is not None
    torchao_linear = sys.modules.get("torchao.float8.float8_linear")  # not imported: nothing can be float8
    return torchao_linear is not None and isinstance(module, torchao_linear.Float8Linear)


def float8_modules(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules that compute in float8 (for logs and tests)."""
    return [name for name, module in model.named_modules() if is_float8(module)]
