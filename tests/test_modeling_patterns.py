"""plait takes modeling code as transformers writes it, on architectures that need it (the OPT example adapter
shows both patterns too: tests/test_out_of_tree_adapter.py):
- a block that flattens [batch, seq, hidden] to [tokens, hidden] before a tensor-parallel layer: Qwen2-MoE's
  shared expert, split over tp under sequence parallelism (the SP gather and reduce-scatter act on dim -2);
- a neutralised module called with the model's own arguments on a later pipeline stage: BioGPT's
  ``embed_positions(attention_mask, past_length, position_ids=...)``.
Both through the conformance kit (3 AdamW steps against one process), one launch.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["plait.testing.pytest_plugin"]

CASES = {"qwen2_moe-shared-split": ("tp2-sp", "tp2-sp-recompute"), "biogpt-pipeline": ("pp2-1f1b", "pp2-interleaved-v2")}


@pytest.fixture(scope="module")
def results(plait_conformance):
    return plait_conformance("pattern_adapters.qwen2_moe_shared_split", "pattern_adapters.biogpt_pipeline",
                             modes=sorted({m for modes in CASES.values() for m in modes}))


@pytest.mark.parametrize("adapter,mode", [(a, m) for a, modes in CASES.items() for m in modes])
def test_modeling_pattern_matches_one_process(results, adapter, mode):
    from plait.testing.pytest_plugin import format_results

    assert results[adapter, mode].status == "pass", format_results([results[adapter, mode]])


def test_flattened_block_is_split_for_real():
    """The shared expert is column/row-parallel in this plan, not kept whole (else the test proves nothing)."""
    import plait_transformers
    from pattern_adapters import qwen2_moe_shared_split as adapter

    from plait.tp.styles import Column, Row

    config = plait_transformers.plait_tiny_config("qwen2_moe")
    styles = {r.pattern: type(r) for r in adapter.plait_tp_plan(config).rules}
    assert styles["model.layers.*.mlp.shared_expert.gate_proj"] is Column
    assert styles["model.layers.*.mlp.shared_expert.down_proj"] is Row
    assert not any("shared_expert." in n for n in adapter.plait_sp_plan(config).norms)
