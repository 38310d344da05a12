"""Issue 24: causal LMs for which transformers declares no tp plan (OPT, BLOOM, Falcon, GPT-BigCode, GPT-Neo,
StableLM, MPT, DBRX, Persimmon) train through the generic adapter: ZeRO-1 over data-parallel ranks, pipeline
stages cut from the module tree, and tp=2 with sequence parallelism on a plan read from the module tree (the
styles transformers declares for the same structures), each with one-process parity (the kit's 3 AdamW steps,
fp32). ALiBi's bias (Bloom, Falcon, MPT) goes to each layer beside the hidden states, but the model builds it before
its loop over the layers, so every pipeline stage builds it again, as it does the mask.

One launch of 2 ranks runs every pair (about 10 s on 2 cores).
"""

from __future__ import annotations

import pytest

from plait.testing.conformance_modes import LOSS_RTOL

pytest_plugins = ["plait.testing.pytest_plugin"]

ARCHITECTURES = ("opt", "bloom", "falcon", "gpt_bigcode", "gpt_neo", "stablelm", "mpt", "dbrx", "persimmon")
MODES = ("zero1-dp2", "pp2-1f1b", "tp2-sp")
# Multi-query attention's fused projection, with its own kernel (Falcon) or through transformers' attention functions
# (GPT-BigCode's c_attn: q heads | one k | one v head), is split: q heads per rank, the kv head replicated with its
# rows' gradients summed (tests/test_generic_attention_rules.py checks their consolidation in float64). DBRX's
# blocks (its class declares a plan for the LM head alone) are kept whole and run on the whole sequence under SP:
# exact, and the vocabulary is still split. Persimmon's query_key_value is laid out head by head as GPT-NeoX's, and
# split so; Bloom's too, and MPT's Wqkv as q | k | v, their ALiBi bias sliced to each rank's heads (float64 there too).


@pytest.fixture(scope="module")
def results(plait_conformance):
    return plait_conformance(*(f"transformers:{a}" for a in ARCHITECTURES), modes=list(MODES))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_undeclared_architecture(results, arch, mode):
    from plait.testing.pytest_plugin import format_results

    result = results[f"transformers:{arch}", mode]
    assert result.status == "pass", format_results([result])
    assert result.loss_rel is not None and result.loss_rel <= LOSS_RTOL
    assert result.grad_tol is not None and result.grad_tol <= 1
