"""The conformance kit's full matrix over architectures served by the generic adapter (plait-transformers):
plans derived from transformers' declarations give one-process numbers under every parallel mode.

One launch per world size (2 and 4) runs every (architecture, mode) pair of this module (about 3 minutes on
2 cores). Families: per-head q/k norms (qwen3, gemma3_text), scaled embeddings and soft-capped logits with the
vocab-parallel loss (gemma, gemma2), biases everywhere (starcoder2), logit_scale (cohere), multipliers
(granite), no-rope layers (smollm3), partial rotary and a parallel residual (phi), tied heads (gemma*); and
where transformers' own plan gathers, plait's real splits: fused q|k|v and gate|up (phi3), per-head interleaved
qkv with partial rotary and a parallel residual (gpt_neox), full-width q/k norms (olmo2), fused experts split
on their intermediate dimension with a replicated router (mixtral, qwen3_moe).
"""

from __future__ import annotations

import pytest

from plait.testing.conformance_modes import LOSS_RTOL, MODES

pytest_plugins = ["plait.testing.pytest_plugin"]

ARCHITECTURES = ("qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "starcoder2", "cohere", "granite", "smollm3", "phi",
                 "phi3", "olmo2", "gpt_neox", "mixtral", "qwen3_moe")
# gemma3_text under tensor parallelism: exact in float64 (step-1 gradients within 4e-16 of one process, measured),
# but in fp32 its step-2/3 gradients exceed the kit's tolerance by 1.2-2.5x: Adam (eps 1e-6) amplifies the
# ~1e-7 reordering noise of step 1 about 200-fold in this model (7e-14 at step 2 from 4e-16 in float64).
FP32_SENSITIVE = {("gemma3_text", m) for m in ("tp2-sp", "tp2", "tp2-sp-tied", "tp2-sp-recompute", "consolidate-tp2")}
# The same at step 3 for mixtral under tp (step 1 at 0.02x the tolerance, measured with the kit at 1 step: a
# mis-split expert is off by 1e-4 there) and olmo2 at tp=4 (0.3x at step 1, its one-process noise level).
FP32_SENSITIVE |= {("mixtral", m) for m in ("tp2-sp", "tp2", "tp4-kv-replicated", "tp2-sp-recompute", "consolidate-tp2")}
FP32_SENSITIVE |= {("olmo2", m) for m in ("tp2-sp", "tp2", "tp4-kv-replicated", "tp2-sp-recompute", "consolidate-tp2")}
# Modes a tiny config cannot express, with the reason the kit must give.
SKIPPED = {("phi3", "tp4-kv-replicated"): "fused qkv with num_key_value_heads=2 < tp=4 is not supported",
           ("gpt_neox", "tp4-kv-replicated"): "no attention with fewer kv heads than tp=4"}


@pytest.fixture(scope="module")
def results(plait_conformance):
    from plait.testing.pytest_plugin import format_results

    found = plait_conformance(*(f"transformers:{a}" for a in ARCHITECTURES))
    print(format_results(list(found.values())))  # the table, for pytest -s
    return found


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generic_adapter_conforms(results, arch, mode):
    from plait.testing.pytest_plugin import format_results

    result = results[f"transformers:{arch}", mode]
    if (arch, mode) in SKIPPED:
        assert result.status == "skipped" and SKIPPED[arch, mode] in result.note, format_results([result])
        return
    if (arch, mode) in FP32_SENSITIVE and result.failed and "raised" not in result.note:
        assert result.loss_rel <= LOSS_RTOL and result.grad_tol < 5, format_results([result])
        pytest.xfail(f"fp32 noise amplified past the kit's gradient tolerance ({result.grad_tol:.1f}x), exact in float64")
    assert result.status == "pass", format_results([result])
    assert result.loss_rel is not None and result.loss_rel <= LOSS_RTOL
    assert result.grad_tol is not None and result.grad_tol <= 1
