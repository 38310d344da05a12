"""Tensor-parallel rules of the generic adapter for attention that transformers' plans do not describe, each with
one-process parity at tp=2 with sequence parallelism and through the tp=2 save -> consolidate -> from_pretrained
round trip (the kit's 3 AdamW steps, fp32), and each refusing on the meta model what it cannot place:

- CTRL: q/k/v projections named Wq/Wk/Wv, reading the forward's arguments ``v, k, q``, which the decoder layer
  passes as one tensor (the region enters that tensor wherever it is passed);
- CodeGen: a fused qkv laid out in ``mp_num`` chunks of [q | v | k] of several heads (a run of whole chunks per
  rank);
- Moshi: q/k/v/o projections each wrapped in a module holding one Linear (``q_proj.linear``), which the wrapper's
  forward returns as is: the Linear is split, the block's input enters the region and holds the local head counts;
  its gating MLP's fc1 output, viewed as gate | up halves, a FusedColumn;
- LFM3: a gate per head read inline, ``attn_output * torch.sigmoid(self.g_proj(hidden_states)).unsqueeze(-1)``,
  split with the q heads as AFMoE's named one;
- BitNet: RMSNorms over all heads' outputs before ``o_proj`` and over the gated product before ``down_proj``
  (``attn_sub_norm``, ``ffn_sub_norm``), split with their features, the sum of squares all-reduced (SplitNorm).

One launch of 2 ranks runs every pair, in float64: BitNet's norms compute in float32 whatever the model's dtype
(transformers' and SplitRMSNorm alike), so in fp32 its step 2 is reordering noise Adam amplifies (3x tolerance, as
LFM3's); in float64 everything else shrinks to 1e-16 and a mis-split layer still stays off by 1e-4.
"""

from __future__ import annotations

import pytest
from packaging.version import Version
from torch import nn

from plait.testing.conformance_modes import LOSS_RTOL
from plait.tp.sharding import TPSizeError
from plait.tp.styles import FusedColumn, HeadInterleavedAttention, SplitNorm, WholeSequence
from plait_transformers import plait_tiny_config
from plait_transformers.attention import _check_one_input, _linear_path
from plait_transformers.common import Refusal
from plait_transformers.derivation import derive
from plait_transformers.mlp import split_sub_norm

from releases import TRANSFORMERS

pytest_plugins = ["plait.testing.pytest_plugin"]

ARCHITECTURES = ("ctrl", "codegen", "moshi", "lfm3", "bitnet")
MODES = ("tp2-sp", "consolidate-tp2-sp")


@pytest.fixture(scope="module")
def results(plait_conformance):
    return plait_conformance(*(f"transformers:{a}" for a in ARCHITECTURES), modes=list(MODES), dtype="float64")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tp_rule_parity(results, arch, mode):
    from plait.testing.pytest_plugin import format_results

    result = results[f"transformers:{arch}", mode]
    assert result.status == "pass", format_results([result])
    assert result.loss_rel is not None and result.loss_rel <= LOSS_RTOL
    assert result.grad_tol is not None and result.grad_tol <= 1


class _Attention(nn.Module):
    """CTRL's attention shape: projections read the forward's ``v``, ``k`` and ``q``."""

    def __init__(self) -> None:
        super().__init__()
        self.Wq, self.Wk, self.Wv = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, v, k, q):
        return self.Wq(q) + self.Wk(k) + self.Wv(v)


class _OneTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x):
        return self.attn(x, x, x, mask=None)


class _TwoTensors(_OneTensor):
    def forward(self, x, memory):
        return self.attn(memory, memory, x)


@pytest.mark.parametrize("layer, refused", [(_OneTensor, False), (_TwoTensors, True)])
def test_projections_reading_other_arguments_need_one_tensor_passed(layer, refused):
    """The tensor-parallel region enters the attention's first argument (and the same tensor wherever it is passed
    again): projections reading another tensor (cross-attention's memory) would see a sequence shard."""
    model = nn.Sequential(layer())
    model.config = type("Config", (), {"model_type": "toy"})()
    check = lambda: _check_one_input(model, "0.attn", "*.attn", model[0].attn, ["Wq", "Wk", "Wv"])  # noqa: E731
    if refused:
        with pytest.raises(Refusal, match=r"toy: \*\.attn: its projections read the forward arguments \['v', 'k', "
                                          r"'q'\]"):
            check()
    else:
        check()


def test_cross_attention_on_another_input_is_refused():
    """Mllama's cross-attention layers project the image states (a forward argument of their own, replicated, not
    on sequence shards): their gradient would not be summed over tp. Refused, as context parallelism refuses them."""
    refusal = derive(plait_tiny_config("mllama")).tp
    assert isinstance(refusal, Refusal)
    assert "cross_attn: its projections read the forward arguments ['hidden_states', 'cross_attention_states']" in \
        str(refusal)


def test_ctrl_and_codegen_attention_are_split_by_heads():
    ctrl = next(r for r in derive(plait_tiny_config("ctrl")).tp.rules if r.pattern.endswith("multi_head_attention"))
    assert (ctrl.q, ctrl.k, ctrl.v, ctrl.o) == ("Wq", "Wk", "Wv", "dense")
    codegen = next(r for r in derive(plait_tiny_config("codegen")).tp.rules if r.pattern.endswith(".attn"))
    if TRANSFORMERS < Version("5.24"):  # the CodeGen before 5.24's rewrite computes its own attention: kept whole
        assert isinstance(codegen, WholeSequence), codegen
        return
    assert isinstance(codegen, HeadInterleavedAttention) and codegen.groups == 4


def test_codegen_chunks_refuse_a_tp_that_cuts_one():
    """A rank must hold whole [q | v | k] chunks: the forward views its output as (-1, 3 * embed_dim / mp_num)."""
    rule = HeadInterleavedAttention("attn", qkv="qkv", o="o", num_heads=8, num_kv_heads=8, head_dim=2, groups=4)
    module = nn.Module()
    module.qkv, module.o = nn.Linear(16, 48), nn.Linear(16, 16)
    assert len(rule.shards("attn", module, 4, 0)) == 2
    with pytest.raises(TPSizeError, match="laid out in 4 chunks of q, k and v"):
        rule.shards("attn", module, 8, 0)


def test_bitnet_sub_norms_are_split_with_their_features():
    rules = {r.pattern: r for r in derive(plait_tiny_config("bitnet")).tp.rules}
    for name in ("model.layers.*.self_attn.attn_sub_norm", "model.layers.*.mlp.ffn_sub_norm"):
        assert isinstance(rules[name], SplitNorm)
    with pytest.raises(TPSizeError, match="features = 6 is not divisible by tp=4"):
        SplitNorm("norm").shards("norm", nn.RMSNorm(6), 4, 0)


class _SubNormAttention(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.sub_norm, self.o_proj = norm, nn.Linear(8, 4)

    def forward(self, attn_output):
        attn_output = self.sub_norm(attn_output)
        attn_output = self.o_proj(attn_output)
        return attn_output


def test_only_an_rms_norm_feeding_the_row_projection_is_a_split_norm():
    """A LayerNorm (a mean to subtract, a bias) or an RMSNorm of another width is no split norm."""
    from transformers.models.bitnet.modeling_bitnet import BitNetRMSNorm

    assert split_sub_norm(_SubNormAttention(BitNetRMSNorm(8)), "sub_norm", "o_proj")
    assert not split_sub_norm(_SubNormAttention(nn.LayerNorm(8)), "sub_norm", "o_proj")
    assert not split_sub_norm(_SubNormAttention(BitNetRMSNorm(4)), "sub_norm", "o_proj")
    lfm3 = next(r for r in derive(plait_tiny_config("lfm3")).tp.rules if r.pattern.endswith("self_attn"))
    assert lfm3.head_columns == ("g_proj",)  # one sigmoid gate per head: split with the heads, not a stray module


class _Wrapper(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        if extra:
            self.norm = nn.LayerNorm(4)

    def forward(self, x, layer_idx=None):
        return self.linear(x)


class _Scaling(_Wrapper):
    def forward(self, x, layer_idx=None):
        return 2 * self.linear(x)


def test_a_projection_wrapping_one_linear_is_split_as_that_linear():
    """Only a wrapper that returns its one Linear of its input: anything else it holds or does refuses the block."""
    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj, block.o_proj = _Wrapper(), _Wrapper(True), _Scaling(), nn.Linear(4, 4)
    assert [_linear_path(block, c) for c in ("q_proj", "k_proj", "v_proj", "o_proj")] == [
        "q_proj.linear", None, None, "o_proj"]
    moshi = next(r for r in derive(plait_tiny_config("moshi")).tp.rules if r.pattern.endswith("self_attn"))
    assert (moshi.q, moshi.o) == ("q_proj.linear", "o_proj.linear")
    assert moshi.local_attrs["num_key_value_groups"] == "kv_groups"
    mlp = {r.pattern: r for r in derive(plait_tiny_config("moshi")).tp.rules}["model.layers.*.mlp.fc1"]
    assert isinstance(mlp, FusedColumn) and mlp.chunks == 2
    from plait.base.meta import build_meta_model

    model = build_meta_model(plait_tiny_config("moshi"))
    shards = moshi.shards("model.layers.0.self_attn", model.get_submodule("model.layers.0.self_attn"), 2, 1)
    entered = [shard for shard in shards if shard.entered_by_parent]
    assert [shard.name.rpartition(".")[0] for shard in entered] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert {shard.owner for shard in entered} == {"model.layers.0.self_attn"}  # its input enters, it gets the heads
    assert entered[0].local_attrs == {"num_heads": 2, "num_key_value_heads": 1, "num_key_value_groups": 2}
