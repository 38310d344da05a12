"""scripts/vision_sweep.py's verdict: a cell passes on rounding and fails on what a wrong plan or a lost input does.

The numbers are the sweep's own (docs/architectures.md, the image-text section): Adam-grown fp32 rounding (glm4v's
2.5e-6 at step 3, its float64 run exact), transformers' fp32 casts inside a float64 run (glm4v_moe's 3.2e-9), and
Cohere Compass before pp and cp computed its grid positions (4e-4, gradients 8.5e3 units off)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sweep():
    spec = importlib.util.spec_from_file_location("vision_sweep", ROOT / "scripts" / "vision_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(fp32_losses, fp64_losses, fp64_grads, unmatched=()):
    ref = [4.0, 4.1, 4.2]
    fp32 = {"losses": [r * (1 + d) for r, d in zip(ref, fp32_losses)], "ref_losses": ref,
            "grad_error_by_step": [0.5, 3.0, 545.0], "unmatched": list(unmatched)}
    fp64 = {"losses": [r * (1 + d) for r, d in zip(ref, fp64_losses)], "ref_losses": ref,
            "grad_error_by_step": fp64_grads, "unmatched": list(unmatched)}
    return {"fp32": fp32, "float64": fp64}


def test_rounding_passes_and_a_lost_input_fails():
    verdict = sweep().verdict
    # fp32's Adam-grown rounding, float64's largest measured (float64 throughout) pass; the 3.2e-9 transformers' fp32
    # casts left in a float64 run before it was float64 throughout, and the Gemmas' 2e-11 before plait's embedding
    # scale was its float32 buffer's value, no longer do
    assert verdict(run([1e-7, 2e-7, 2.5e-6], [0, 2e-15, 8e-15], [0.003, 0.004, 0.055])).startswith("pass (")
    assert verdict(run([1e-7] * 3, [0, 1e-15, 2e-11], [0.003] * 3)).startswith("FAIL: float64 loss 2e-11 at step 3")
    lost = verdict(run([1e-7, 1e-5, 3.8e-4], [0, 1e-5, 3.8e-4], [0.003, 90.0, 8.5e3]))
    assert lost.startswith("FAIL: fp32 loss 0.00038 at step 3 (bound 1e-05); float64 loss 0.00038 at step 3 "
                           "(bound 3e-14); float64 grad 8.5e+03 at step 3 (bound 1)"), lost
    # a float64 gradient past its unit fails even where the losses agree (dots3_note's vision experts at tp=2)
    assert verdict(run([1e-7] * 3, [1e-15] * 3, [0.01, 0.02, 82.0])).startswith("FAIL: float64 grad 82 at step 3")
    unmatched = verdict(run([1e-7] * 3, [0] * 3, [0.01] * 3, unmatched=["lm_head.weight"]))
    assert unmatched.startswith("FAIL: fp32 gradients compared are not the trained ones: lm_head.weight")
