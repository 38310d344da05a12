"""Linears no tensor-parallel rule splits, kept whole on every rank, and the per-token inputs a model hands its layers
beside the hidden states, split on the sequence under SP (plait_transformers.layer_linears, ``SPPlan.side_inputs``):

- Zamba, Zamba2: ``linear`` on the hybrid layer after the shared attention block, and the shared block's MLP (Zamba2's
  with low-rank adapters beside its fused gate | up), Linears only, token by token; ``original_hidden_states`` (the
  embeddings, concatenated into the shared block's input) split like the hidden states;
- Gemma 4 (text and composite): ``per_layer_input_gate`` and ``per_layer_projection`` around the per-layer inputs,
  which are split like the hidden states.

One launch of 2 ranks runs every architecture at tp=2 with SP in float64: Gemma 4 computes its norms in float32
whatever the model's dtype, and in fp32 its gradients miss the kit's tolerance at step 1 already with or without SP
(tp2: the same misses, to three digits), reordering noise of the split attention; in float64 a mis-split layer stays
off by 1e-4. Then what stays refused, on the meta device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.base.config import ConfigError
from plait.testing.conformance_modes import LOSS_RTOL
from plait.tp.sequence_parallel import SideInputScatter
from plait_transformers import plait_tiny_config
from plait_transformers.derivation import derive
from plait_transformers.layer_linears import in_linear_block, replicated_linear

pytest_plugins = ["plait.testing.pytest_plugin"]

ARCHITECTURES = ("zamba", "zamba2", "gemma4_text", "gemma4")


@pytest.fixture(scope="module")
def results(plait_conformance):
    return plait_conformance(*(f"transformers:{a}" for a in ARCHITECTURES), modes=["tp2-sp"], dtype="float64")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layer_linears_parity(results, arch):
    from plait.testing.pytest_plugin import format_results

    result = results[f"transformers:{arch}", "tp2-sp"]
    assert result.status == "pass", format_results([result])
    assert result.loss_rel is not None and result.loss_rel <= LOSS_RTOL
    assert result.grad_tol is not None and result.grad_tol <= 1


@pytest.mark.parametrize("arch, layers, side, kept", [
    ("zamba", "model.layers", "original_hidden_states", ("linear", "shared_transf.feed_forward.gate_proj")),
    ("zamba2", "model.layers", "original_hidden_states",
     ("linear", "shared_transformer.feed_forward.gate_up_proj_adapter_list.0.1")),
    ("gemma4_text", "model.layers", "per_layer_input", ("per_layer_input_gate", "per_layer_projection")),
    ("gemma4", "model.language_model.layers", "per_layer_input", ("per_layer_input_gate", "per_layer_projection")),
])
def test_derived_sp_plan_splits_side_inputs_and_sums_kept_linears(arch, layers, side, kept):
    derived = derive(plait_tiny_config(arch))
    assert derived.sp.side_inputs == (side,)
    assert {f"{layers}.*.{leaf}" for leaf in kept} <= set(derived.sp.norms)
    assert not any(rule.pattern.endswith(".linear") or "per_layer" in rule.pattern for rule in derived.tp.rules)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.memory_proj, self.mixed = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, hidden_states, memory):
        hidden_states = self.proj(hidden_states)
        return hidden_states + self.memory_proj(memory) + self.mixed(hidden_states.transpose(1, 2))


def _model(layer: nn.Module) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    return model


def test_only_a_linear_on_a_name_of_the_layer_is_kept_whole():
    """``memory`` comes whole beside the hidden states (cross-attention's), ``mixed`` reads an expression (here one
    that mixes tokens): both stay refused; ``proj`` reads the hidden states."""
    model = _model(_Layer())
    assert replicated_linear(model, "layers", "layers.0.proj")
    assert not replicated_linear(model, "layers", "layers.0.memory_proj")
    assert not replicated_linear(model, "layers", "layers.0.mixed")


class _MixingMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)).cumsum(1))


class _TokenMLP(_MixingMLP):
    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _TokenMLP()

    def forward(self, x):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self.mlp(x))  # noqa: F821 (read, never run)


class _Block(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


@pytest.mark.parametrize("mlp, kept", [(_TokenMLP, True), (_MixingMLP, False), (_Attention, False)])
def test_a_block_of_linears_is_kept_whole_only_token_by_token(mlp, kept):
    """A cumulative sum along the sequence mixes tokens; a block inside softmax attention sees the whole sequence."""
    model = _model(_Block(mlp()))
    name = "layers.0.mlp.mlp.up" if mlp is _Attention else "layers.0.mlp.up"
    assert in_linear_block(model, "layers", name) is kept


def test_a_side_input_without_a_token_dimension_is_refused_when_it_arrives():
    """A bias over heads and pairs of tokens handed beside the hidden states: ConfigError, not a slice."""
    hook = SideInputScatter("layers.0", _Layer(), ("memory",), None)
    hidden = torch.zeros(2, 6, 4)
    args, _ = hook(None, (hidden, torch.ones(2, 6, 3)), {})
    assert args[1].shape == (2, 6, 3)
    with pytest.raises(ConfigError, match=r"layers.0: its argument memory has shape \(2, 3, 6, 6\), not one value per "
                                          r"token"):
        hook(None, (hidden,), {"memory": torch.ones(2, 3, 6, 6)})
