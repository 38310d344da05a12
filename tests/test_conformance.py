"""The adapter conformance kit: the built-in adapters pass every mode plait can run, broken adapters fail
the modes their bug shows in, with the measured errors in the message.

One launch per world size (2 and 4) runs every (adapter, mode) pair of this module.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
import types

import pytest

from plait import AdapterError, AdapterInfo, Capabilities, ConfigError, hookimpl
from plait.testing import conformance
from plait.testing.conformance import check_adapter_command, run_conformance
from plait.testing.conformance_modes import LOSS_RTOL, MODES

# The plait_conformance fixture, as an adapter package uses it. pytest imports the plugin after this module,
# so the tests below import from it inside their bodies.
pytest_plugins = ["plait.testing.pytest_plugin"]

BUILTIN = ("llama", "gpt2", "mistral")
WRONG_KV, O_PROJ_COLUMN = "llama-wrong-kv-heads", "llama-o-proj-column"
BROKEN = ("broken_adapters.wrong_kv_heads", "broken_adapters.o_proj_column")
TP_ROWS = ("tp2-sp", "tp2", "tp2-sp-tied", "tp4-kv-replicated")
# cp2 and cp2-tp2 run through the kit in test_generic_conformance (17 architectures); the bundled adapters run
# every cp layout directly in test_cp_parity. The kit's ring mode runs here.
KIT_MODES = [m for m in MODES if m not in ("cp2", "cp2-tp2")]
# The broken adapters' bugs act in the tp modes; dp2 shows the kit blames only those.
BROKEN_MODES = [*TP_ROWS, "dp2"]
# GPT2 with wpe not neutralised: its pipeline modes raise on the later stage only, while the first stage waits in
# a collective. Interleaved with passing modes, each of which must still report its own result.
ONE_RANK = "gpt2-wpe-not-neutralized"
ONE_RANK_MODES = ["pp2-1f1b", "tp2-sp", "pp2-tied", "dp2"]


# Mistral's adapter re-exports Llama's plans; its tiny config differs by one kv head (replicated at every tp) and a
# sliding window. Modes that split no heads (data parallel, ZeRO, the pipeline variants beyond pp2-1f1b, which runs
# the window's mask on every stage) run Llama's plans on it as on Llama, so they run on llama and gpt2 only; the
# ring at cp2 runs on mistral in tests/test_cp_parity.py (the window, tiled and packed, at cp 2 and 4).
MISTRAL_AS_LLAMA = ("dp2", "zero1-dp2", "zero2-dp2", "zero3-dp2", "consolidate-zero3-dp2", "pp2-zero3-dp2",
                    "pp2-interleaved-v2", "pp2-tied", "pp2-recompute", "consolidate-pp2", "cp2-ring")
PAIRS = [(a, m) for a in BUILTIN for m in KIT_MODES if a != "mistral" or m not in MISTRAL_AS_LLAMA]


@pytest.fixture(scope="module")
def results(plait_conformance) -> dict[tuple[str, str], conformance.ModeResult]:
    """The built-in adapters' pairs and the broken adapters' modes, in one launch per world size."""
    from plait.testing.pytest_plugin import format_results

    found = plait_conformance(pairs=[*PAIRS, *((a, m) for a in BROKEN for m in BROKEN_MODES)])
    print(format_results(list(found.values())))  # the table, for pytest -s
    return found


@pytest.fixture(scope="module")
def one_rank_results(plait_conformance) -> tuple[dict[tuple[str, str], conformance.ModeResult], float]:
    start = time.monotonic()
    found = plait_conformance("broken_adapters.wpe_not_neutralized", modes=ONE_RANK_MODES)
    return found, time.monotonic() - start


def expected_skip(adapter: str, mode: str) -> str | None:
    """Why a built-in adapter's mode may not run: GPT2's lack of GQA; dense models have no experts to divide."""
    if adapter == "gpt2" and mode == "tp4-kv-replicated":
        return "no attention with fewer kv heads than tp=4 (kv heads: [4])"
    if mode.startswith("ep2"):
        return "has no routed experts plait can divide"
    return None


@pytest.mark.parametrize("adapter, mode", PAIRS)
def test_builtin_adapter_conforms(results, adapter, mode):
    from plait.testing.pytest_plugin import format_results

    result = results[adapter, mode]
    skip = expected_skip(adapter, mode)
    if skip:
        assert result.status == "skipped" and skip in result.note, format_results([result])
        return
    assert result.status == "pass", format_results([result])
    assert result.loss_rel is not None and result.loss_rel <= LOSS_RTOL
    assert result.grad_tol is not None and result.grad_tol <= 1


@pytest.mark.parametrize("mode", TP_ROWS)
def test_wrong_kv_heads_fails_with_the_numbers(results, mode):
    result = results[WRONG_KV, mode]
    assert result.status == "FAIL"
    assert result.loss_rel > 1e-3 and result.grad_tol > 1
    assert re.search(r"step 1 loss \d\.\d{6} vs \d\.\d{6}: rel err \d\.\d\de-0\d > 1e-05", result.note), result.note
    assert re.search(r"step 1 grad model\.\S+: max \|Δ\| \d\.\d\de-\d\d \(\d\.\de\+\d\dx tolerance\)", result.note)


def test_wrong_kv_heads_passes_where_its_bug_does_not_act(results):
    """Without tensor parallelism the kv-head count is never used: the kit blames only the broken modes."""
    assert results[WRONG_KV, "dp2"].status == "pass"


@pytest.mark.parametrize("mode", ("tp2-sp", "tp2", "tp2-sp-tied"))
def test_o_proj_column_raises_and_the_world_goes_on(results, mode):
    result = results[O_PROJ_COLUMN, mode]
    assert result.status == "FAIL" and "raised RuntimeError" in result.note, result.note
    assert results[O_PROJ_COLUMN, "dp2"].status == "pass"  # later pairs in the same world still ran
    # Written without an Attention rule, it has no kv heads the kit could replicate: that mode cannot run.
    assert results[O_PROJ_COLUMN, "tp4-kv-replicated"].status == "skipped"


def test_a_mode_failing_on_one_rank_shows_every_rank_and_the_others_still_run(one_rank_results):
    """The later stage raises; the first, inside a collective, is either told the peer left or asked for its
    stack. Either way both ranks' parts are in the note, the cause first, and the modes after it still run."""
    found, seconds = one_rank_results
    for mode in ("pp2-1f1b", "pp2-tied"):
        note = found[ONE_RANK, mode].note
        assert found[ONE_RANK, mode].status == "FAIL"
        assert note.startswith("rank 1: raised RuntimeError: transformer.wpe belongs to pipeline stage 0"), note
        assert re.search(r"rank 0(?: did not finish: still inside the mode after another rank had failed, at "
                         r"\S+\.py:\d+|: raised RuntimeError: .*closed by peer)", note), note
    assert found[ONE_RANK, "tp2-sp"].status == "pass" and found[ONE_RANK, "dp2"].status == "pass"
    # seconds per failing mode, never the watchdog's minutes (240 s + 5 s a pair before the first result)
    assert seconds < 120, seconds


def test_summary_says_how_much_ran(results):
    rows = [results["gpt2", m] for m in KIT_MODES] + [results[WRONG_KV, m] for m in BROKEN_MODES]
    text = conformance.summary(rows)
    ran = sum(results["gpt2", m].status != "skipped" for m in KIT_MODES)
    assert f"gpt2: {ran} of {len(KIT_MODES)} modes ran: {ran} passed, 0 failed; " in text
    assert "tp4-kv-replicated (the tiny config has no attention with fewer kv heads than tp=4" in text
    assert (f"{WRONG_KV}: 5 of 5 modes ran: 1 passed, 4 failed (tp2-sp, tp2, tp2-sp-tied, tp4-kv-replicated)"
            in text)


def test_modes_without_sp_run_for_an_adapter_that_declares_no_sp():
    """tp without sp still has its tied, recompute and consolidation modes; pp has its own."""
    from plait.testing.conformance_modes import load_subject

    subject = load_subject("llama")
    no_sp = dataclasses.replace(subject, adapter=dataclasses.replace(
        subject.adapter, info=dataclasses.replace(subject.adapter.info, capabilities=Capabilities(sp=False))))
    runs = {m for m in MODES if conformance._skip_reason(no_sp, MODES[m]) is None}
    assert {"tp2", "tp2-tied", "tp2-recompute", "consolidate-tp2", "pp2-1f1b", "pp2-tied", "pp2-recompute",
            "consolidate-pp2", "dp2", "zero1-dp2"} <= runs
    assert not {m for m in runs if MODES[m].layout.get("sp")}


def test_help_lists_every_mode_on_one_line(capsys):
    from plait.cli import main

    with pytest.raises(SystemExit):
        main(["check-adapter", "--help"])
    out = capsys.readouterr().out
    for name, mode in MODES.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(mode.summary)}$", out, re.M), name


def test_check_adapter_command_prints_table_and_exit_code(results, monkeypatch, capsys):
    modes = ["tp2", "dp2"]
    for adapter, code in ((WRONG_KV, 1), ("llama", 0)):
        monkeypatch.setattr(conformance, "run_conformance",
                            lambda names, modes, dtype: [results[adapter, r] for r in modes])
        assert check_adapter_command(adapter, modes) == code
        out = capsys.readouterr().out
        assert adapter in out and ("FAIL" in out) == (code == 1) and "pass" in out


def test_assert_conformance_shows_the_failing_rows(results, monkeypatch):
    from plait.testing import pytest_plugin
    from plait.testing.pytest_plugin import assert_conformance

    monkeypatch.setattr(pytest_plugin, "run_conformance", lambda adapters, modes: [results[WRONG_KV, r] for r in modes])
    with pytest.raises(AssertionError, match=r"conformance failed for llama-wrong-kv-heads tp2:\n(.|\n)*rel err"):
        assert_conformance("broken_adapters.wrong_kv_heads", modes=["tp2", "dp2"])


def test_unknown_adapter_exits_2_naming_installed_ones(capsys):
    assert check_adapter_command("no-such-adapter", None) == 2
    err = capsys.readouterr().err
    assert "no installed adapter is named 'no-such-adapter'" in err and "llama" in err


def test_unknown_row_is_refused_before_launching():
    with pytest.raises(ConfigError, match="unknown conformance mode.*tp3.*choose from tp2-sp"):
        run_conformance(["llama"], ["tp3"])


def test_unknown_dtype_is_refused_before_launching():
    with pytest.raises(ConfigError, match="conformance dtype 'float16' is not one of float32, float64"):
        run_conformance(["llama"], ["tp2-sp"], dtype="float16")


def test_adapter_without_tiny_config_is_told_to_implement_it(monkeypatch):
    import plait_llama

    module = types.ModuleType("plait_no_tiny")
    module.plait_tp_plan, module.plait_sp_plan = plait_llama.plait_tp_plan, plait_llama.plait_sp_plan
    module.plait_leaf_modules = plait_llama.plait_leaf_modules
    module.plait_adapter_info = hookimpl(lambda: AdapterInfo(name="no-tiny", architectures=("llama",)))
    monkeypatch.setitem(sys.modules, "plait_no_tiny", module)
    with pytest.raises(AdapterError, match="'no-tiny' does not implement plait_tiny_config; implement it"):
        run_conformance(["plait_no_tiny"])


def test_a_noise_shaped_fp32_miss_is_decided_in_float64(monkeypatch):
    """An fp32 miss only in a later step's gradients (Adam-amplified reordering noise: which pairs it hits depends on
    the CPU's kernels) is run again in float64 and that result stands, the fp32 one kept beside it; a step-1 miss far
    over the tolerance (a mis-split layer) is not rerun and stays a failure."""
    subject = types.SimpleNamespace(ref="opt")
    noisy, broken = MODES["tp2-sp"], MODES["pp2-1f1b"]
    results = {("opt", "tp2-sp"): conformance.ModeResult("opt", "tp2-sp", "", "FAIL", "step 3 grad w: max |Δ| 3.1e-05 "
                                                         "(3.1e+01x tolerance)", 1e-7, 3.1e-5, 31.0),
               ("opt", "pp2-1f1b"): conformance.ModeResult("opt", "pp2-1f1b", "", "FAIL", "step 1 grad w: max |Δ| "
                                                           "4e-04 (4.0e+01x tolerance)", 1e-7, 4e-4, 40.0)}
    launched = []

    def run_world(world, pairs, dtype, timeout, found):
        launched.append((world, [m.name for _, m in pairs], dtype))
        for s, m in pairs:
            found[s.ref, m.name] = conformance.ModeResult(s.ref, m.name, "", "pass", "", 1e-15, 1e-12, 0.02,
                                                          dtype=dtype)

    monkeypatch.setattr(conformance, "_run_world", run_world)
    conformance.recheck_float64([(subject, noisy), (subject, broken)], results)
    assert launched == [(noisy.world, ["tp2-sp"], "float64")]
    decided = results["opt", "tp2-sp"]
    assert decided.status == "pass" and decided.dtype == "float64" and decided.fp32.grad_tol == 31.0
    assert ("float64 recheck of fp32: loss 1e-07, grad 31.00; step 1 within tolerance, step 3 grad w over it"
            in decided.note)
    assert results["opt", "pp2-1f1b"].failed and results["opt", "pp2-1f1b"].fp32 is None


def test_float64_runs_keep_float64_throughout():
    """In a float64 run every float32 a torch function is asked for is float64 (transformers' RMSNorm, softmax and
    Mamba2's scan upcast to fp32 even in a float64 model), and nothing else changes: bit views keep their dtype."""
    import torch

    from plait.testing.conformance_worker import Float64Throughout

    x = torch.ones(2, 4, dtype=torch.float64)
    with Float64Throughout():
        assert x.float().dtype == x.to(torch.float32).dtype == x.to(dtype=torch.float32).dtype == torch.float64
        assert torch.zeros(3, dtype=torch.float32).dtype == torch.arange(3).float().dtype == torch.float64
        assert x.to(torch.float16).dtype == torch.float16 and x.long().dtype == torch.int64
        assert torch.ones(2, dtype=torch.int32).view(torch.float32).dtype == torch.float32
        assert torch.tensor(2.5).dtype == torch.get_default_dtype() == torch.float64  # Gemma's embed_scale buffer
        assert torch.tensor(2.5, dtype=torch.float32).dtype == torch.float64  # plait's scaled embedding's scale
        y = torch.ones(3, dtype=torch.float64, requires_grad=True)
        recomputed = []

        def upcast(t):  # what activation checkpointing runs again in backward, where a function mode is off
            recomputed.append(t.float().dtype)
            return t.float() * t.float()

        torch.utils.checkpoint.checkpoint(upcast, y, use_reentrant=False).sum().backward()
        assert recomputed == [torch.float64, torch.float64]
    assert x.float().dtype == torch.tensor(2.5).dtype == torch.float32  # outside it, as torch does


def test_float64_throughout_passes_fp32_internals_and_still_fails_a_mis_split():
    """mamba2 at tp2-sp: its mixer's fp32 scan left a float64 run 1.6x the tolerance off at step 2 (one process alone,
    one batch vs 4 microbatches, differs as much); in float64 throughout it is 1e-8 of the tolerance. A mis-split
    layer (wrong kv heads) stays far off at step 1 in the same run."""
    found = {(r.adapter, r.mode): r for r in run_conformance(
        ["transformers:mamba2", "broken_adapters.wrong_kv_heads"], ["tp2-sp"], dtype="float64", recheck=False)}
    mamba2, broken = found["transformers:mamba2", "tp2-sp"], found[WRONG_KV, "tp2-sp"]
    assert mamba2.status == "pass" and mamba2.grad_tol < 1e-3, mamba2.note
    assert broken.status == "FAIL" and broken.grad_tol > 10 and broken.note.startswith("step 1 loss"), broken.note
