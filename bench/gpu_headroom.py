"""What a GPU training process holds beside the tensors the planner traces, measured on one GPU, and what each
extra micro-batch costs: the figures behind a preset's reserve, fragmentation and ``microbatch_overhead``
(plait.costs.device). Run by hand on a GPU machine (CI has none):

    python bench/gpu_headroom.py [--steps 10] [--seq 2048] [--only b4-m1,b4-m4] [--hardware h100] [--tiny]
                                 [--model llama|gpt2]
    python bench/gpu_headroom.py --replan bench/results/gpu-headroom-h200-2026-11-27.jsonl --hardware h200
    python bench/gpu_headroom.py --replan ... --hardware calibration.json  # a GPU's `plait plan --calibrate` cache

``--hardware`` is the device model the planned step is computed on: a preset, ``calibrated`` (this GPU measured by
``plait plan --calibrate``'s routine, cached), or a calibration cache file copied from a GPU machine
(``$XDG_CACHE_HOME/plait/calibration.json``; each line of bench/results/gpu-calibrate-*.jsonl, saved alone, is one).

A variant is ``b<sequences>-m<micro-batches>[-ckpt][-expandable]``: ``plait train --bf16`` (bf16 parameters, fp32
master weights, gradients and AdamW state, fused AdamW, clipping) on bench/gpu.py's 1.24B Llama, ``sequences`` x
``seq`` tokens a step split into ``micro-batches`` (gradient accumulation); ``ckpt``: activation checkpointing;
``expandable``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Each variant runs in its own process (a fresh
context and allocator) and prints one JSON line with:

- ``total``: the memory the driver gives a program; ``context``: what the process holds outside torch's allocator
  once it has touched the device (total - free - reserved), and ``runtime`` the same after the timed steps (the
  kernels loaded since, cuBLAS and cuDNN handles); ``nccl``: what a one-rank NCCL group and one all-reduce add to it
  (NCCL refuses two ranks on one device, so its per-peer buffers at 8 ranks are not measured here);
- ``allocated`` (the allocator's peak of live tensors: what the planner predicts) and ``reserved`` (its peak of
  memory taken from the driver); their difference is the fragmentation;
- ``step_s``: the median of the timed steps; beside a variant of the same batch in one micro-batch, the difference
  per extra micro-batch and decoder layer is the device's ``microbatch_overhead``.

The parent adds the planner's peak and step time (on the ``--hardware`` preset) for each variant's layout and
prints the table. ``--tiny`` runs plait's tiny
Llama instead (a check of this script on any machine; the memory columns need an accelerator).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from plait.base import device

DEVICE = device.pick_device("auto")
GiB = 2**30


def parse_variant(name: str) -> tuple[int, int, set[str]]:
    """``b4-m2-ckpt`` -> (4 sequences, 2 micro-batches, {"ckpt"})."""
    match = re.fullmatch(r"b(\d+)-m(\d+)((?:-ckpt|-expandable)*)", name)
    if match is None or int(match.group(1)) % int(match.group(2)):
        raise SystemExit(f"unknown variant {name!r}: b<sequences>-m<micro-batches dividing them>[-ckpt][-expandable]")
    return int(match.group(1)), int(match.group(2)), set(filter(None, match.group(3).split("-")))


def model_config(tiny: bool, model: str = "llama"):
    """bench/gpu.py's 1.24B Llama, or under ``--tiny`` the bundled one ``plait train`` runs without --model_config;
    ``model="gpt2"``: a 0.76B GPT-2 (tanh GELU, three dropouts a layer, learned positions, a tied head), whose
    non-matmul work the planner counts by operation (``costs.traffic``) and whose attention dropout runs in the
    fused kernel on a GPU (plait's CPU preset takes sdpa's math path instead)."""
    if model == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(n_embd=64 if tiny else 1536, n_layer=2 if tiny else 24, n_head=4 if tiny else 16,
                          n_positions=4096, vocab_size=2048 if tiny else 50257)
    if tiny:
        from plait.run.model_config import read_model_config
        from plait.run.train_args import TrainArgs

        return read_model_config(TrainArgs())
    sys.path.insert(0, os.path.dirname(__file__))
    from gpu import llama_1b

    return llama_1b()


def memory_in_use() -> tuple[int, int] | None:
    """(what the device gives a program, what this process holds outside torch's allocator), or None on a CPU."""
    if DEVICE.type == "cpu":
        return None
    module = torch.get_device_module(DEVICE.type)
    free, total = module.mem_get_info()
    return total, total - free - module.memory_reserved()


def run_variant(name: str, steps: int, seq: int, tiny: bool, model: str = "llama") -> dict:
    from plait import ParallelConfig
    from plait.checkpoint.materialize import load_parallel_model
    from plait.optim import OptimizerStep, build_optimizer

    sequences, microbatches, options = parse_variant(name)
    torch.zeros(1, device=DEVICE)  # the context
    device.synchronize(DEVICE)
    at_start = memory_in_use()
    config = model_config(tiny, model)
    parallel = ParallelConfig(gradient_checkpointing="ckpt" in options)
    pmodel = load_parallel_model(config, parallel, dtype=torch.bfloat16, device=DEVICE)
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, fused=device.use_fused_adamw(DEVICE),
                                optimizer_dtype=torch.float32)
    optimizer_step = OptimizerStep(pmodel.grad_sync, optimizer, max_grad_norm=1.0)
    ids = torch.randint(0, config.vocab_size, (sequences, seq), device=DEVICE)
    items = ids.numel() - sequences  # shifted labels: one fewer per sequence

    def step() -> None:
        for chunk in ids.chunk(microbatches):
            loss = pmodel.train_step(chunk, chunk, num_items_in_batch=items)
        optimizer_step(loss)

    for _ in range(3):  # warm-up: the allocator's pools, lazily loaded kernels, the optimizer's state
        step()
    device.synchronize(DEVICE)
    device.reset_peak_memory(DEVICE)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        device.synchronize(DEVICE)
        seconds.append(time.perf_counter() - start)
    row = {"variant": name, "model": model, "seq": seq, "layers": config.num_hidden_layers, "step_s": statistics.median(seconds),
           "allocated": device.peak_memory_bytes(DEVICE)}
    after_steps = memory_in_use()
    if after_steps is not None:
        module = torch.get_device_module(DEVICE.type)
        row.update(total=at_start[0], context=at_start[1], runtime=after_steps[1],
                   reserved=module.max_memory_reserved())
        # NCCL's share: a one-rank group and an all-reduce of 256 MiB, after everything else is loaded
        dist.init_process_group(device.default_backend(DEVICE), store=dist.HashStore(), rank=0, world_size=1)
        dist.all_reduce(torch.ones(128 * 2**20, dtype=torch.bfloat16, device=DEVICE))
        device.synchronize(DEVICE)
        row["nccl"] = memory_in_use()[1] - after_steps[1]
        dist.destroy_process_group()
    return row


def planned(name: str, seq: int, tiny: bool, hardware: str, model: str = "llama") -> dict:
    """The planner's peak and step time (on the ``hardware`` device model) for the variant's layout: one process,
    ``--bf16`` with fp32 masters."""
    from plait import ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.costs.activations import trace_activations
    from plait.costs.estimate import Batch, estimate_layout
    from plait.costs.memory import Precision
    from plait.layout_plan import plan_layout
    from plait.plugin.registry import default_registry

    sequences, microbatches, options = parse_variant(name)
    registry = default_registry()
    meta = build_meta_model(model_config(tiny, model), torch.bfloat16)
    plan = plan_layout(meta, ParallelConfig(gradient_checkpointing="ckpt" in options), 1, registry)
    trace = trace_activations(meta, seq, registry, plan.adapter)
    batch = Batch(sequences // microbatches, seq, microbatches)
    estimate = estimate_layout(meta, plan, batch, Precision(torch.bfloat16, torch.float32), trace)
    return {"predicted": estimate.peak, "planned_step_s": estimate.step_time(device_model(hardware))}


def device_model(hardware: str):
    """``--hardware``: a preset's name, ``calibrated`` (this machine's accelerator measured by ``plait plan
    --calibrate``'s routine, cached), or the path of such a calibration's cache file."""
    from plait.costs import calibration
    from plait.costs.device import PRESETS

    if hardware in PRESETS:
        return PRESETS[hardware]
    return calibration.calibrate() if hardware == "calibrated" else calibration.cached_device(hardware)


def child(name: str, steps: int, seq: int, tiny: bool, model: str = "llama") -> dict:
    env = dict(os.environ)
    if "expandable" in parse_variant(name)[2]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    args = [sys.executable, __file__, "--variant", name, "--steps", str(steps), "--seq", str(seq),
            "--model", model]
    out = subprocess.run(args + (["--tiny"] if tiny else []), capture_output=True, text=True, env=env)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return {"variant": name, "error": lines[-1] if lines else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / GiB:.2f}"


def report(rows: list[dict], seq: int, hardware: str) -> None:
    print("\n| variant | step (s) | planned step (s) | planner peak | allocated peak | reserved peak | fragmentation "
          "(reserved - allocated) | outside the allocator: at start, after the steps | NCCL, one rank |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:100]} | | | | | | | |")
            continue
        lost = r["reserved"] - r["allocated"] if "total" in r else None
        fragmentation = f"{gib(lost)} ({lost / r['total']:.1%} of {gib(r['total'])})" if lost is not None else "n/a"
        print(f"| {r['variant']} | {r['step_s']:.3f} | {r['planned_step_s']:.3f} | {gib(r['predicted'])} | "
              f"{gib(r['allocated'])} | {gib(r.get('reserved'))} | {fragmentation} | {gib(r.get('context'))}, "
              f"{gib(r.get('runtime'))} | {gib(r.get('nccl'))} |")
    whole = {(parse_variant(r["variant"])[0], frozenset(parse_variant(r["variant"])[2])): r
             for r in rows if "error" not in r and parse_variant(r["variant"])[1] == 1}
    print(f"\nPer extra micro-batch and decoder layer ({seq} tokens a sequence): the split step's time over the same "
          "batch in one micro-batch")
    for r in rows:
        sequences, microbatches, options = parse_variant(r["variant"])
        one = whole.get((sequences, frozenset(options)))
        if microbatches > 1 and one is not None and "error" not in r:
            overhead = (r["step_s"] - one["step_s"]) / ((microbatches - 1) * r["layers"])
            print(f"- {r['variant']} vs {one['variant']}: {r['step_s']:.3f} vs {one['step_s']:.3f} s, "
                  f"{overhead * 1e3:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--only", default="b4-m1,b4-m4,b4-m1-expandable,b1-m1,b8-m1-ckpt,b8-m1-ckpt-expandable")
    parser.add_argument("--hardware", default="h100", help="the device model whose step time is printed beside: a "
                        "preset, calibrated (this machine measured, cached) or a calibration cache file")
    parser.add_argument("--tiny", action="store_true", help="plait's tiny Llama (a check of the script)")
    parser.add_argument("--replan", metavar="JSONL", help="no run: the rows of an earlier run (bench/results), with "
                        "the planner's figures of today")
    parser.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.variant:
        print(json.dumps(run_variant(ns.variant, ns.steps, ns.seq, ns.tiny, ns.model)))
        return
    if ns.replan:
        with open(ns.replan) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for row in rows:
            if "error" not in row:
                row.update(planned(row["variant"], row.get("seq", ns.seq), ns.tiny, ns.hardware,
                                   row.get("model", "llama")))
        report(rows, ns.seq, ns.hardware)
        return
    name = "cpu" if DEVICE.type == "cpu" else torch.get_device_module(DEVICE.type).get_device_name()
    print(f"{name}, torch {torch.__version__}, plait --bf16, {'tiny' if ns.tiny else 'full'} {ns.model}, {ns.seq} "
          f"tokens a sequence, {ns.steps} timed steps after 3 warm-up", flush=True)
    rows = []
    for variant in ns.only.split(","):
        row = child(variant, ns.steps, ns.seq, ns.tiny, ns.model)
        if "error" not in row:
            row.update(planned(variant, ns.seq, ns.tiny, ns.hardware, ns.model))
        print(json.dumps(row), flush=True)
        rows.append(row)
    report(rows, ns.seq, ns.hardware)


if __name__ == "__main__":
    main()
