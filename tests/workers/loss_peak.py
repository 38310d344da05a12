"""Worker: the peak of a training step's activations on the CPU, measured beside ``plait.costs``'s prediction, for a
model whose loss dominates (vocabulary 8192, hidden 32), with and without activation checkpointing.

Run as a world of 1: ``loss_peak.py OUT.json``. glibc is told to map every allocation of 64 KiB or more on its own
and never to keep freed memory, so the process's resident set follows the live tensors and its high-water mark
(VmHWM, reset through /proc/self/clear_refs) is the step's peak; the baseline is taken after a first step, when
parameters and gradients are allocated, so the difference is activations and backward's working set, what the
planner predicts as ``activations.in_flight + transient``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from plait import ParallelConfig, parallelize
from plait.base.meta import build_meta_model
from plait.costs.activations import trace_activations
from plait.costs.estimate import Batch, estimate_layout
from plait.costs.memory import Precision
from plait.layout_plan import plan_layout
from plait.plugin.registry import default_registry

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
SEQUENCES, TOKENS = 4, 256


def high_water_mark() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(config: LlamaConfig, checkpointing: bool) -> dict:
    parallel = ParallelConfig(gradient_checkpointing=checkpointing)
    torch.manual_seed(0)
    pmodel = parallelize(AutoModelForCausalLM.from_config(config), parallel)
    ids = torch.randint(0, config.vocab_size, (SEQUENCES, TOKENS))
    pmodel.train_step(ids, ids)  # gradients allocated
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the resident set now
    baseline = high_water_mark()
    pmodel.train_step(ids, ids)
    measured = high_water_mark() - baseline
    registry = default_registry()
    meta = build_meta_model(config)
    plan = plan_layout(meta, parallel, 1, registry)
    trace = trace_activations(meta, TOKENS, registry, plan.adapter)
    rank = estimate_layout(meta, plan, Batch(SEQUENCES, TOKENS), Precision(), trace).ranks[0]
    return {"measured": measured, "predicted": rank.activations.in_flight + rank.transient,
            "log_probs": SEQUENCES * TOKENS * config.vocab_size * 4}


def main(out: str) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 0)
    config = LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS)
    config._attn_implementation = "sdpa"
    results = {"recompute" if c else "plain": measure(config, c) for c in (True, False)}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
