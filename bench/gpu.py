"""bf16 training of a ~1.2B Llama (Llama-3.2-1B shapes) on one GPU: tokens/s and MFU, plait beside a plain
transformers + torch loop on the same model shape, batch, attention kernel and precision recipe; then lazy load and
consolidate of the multi-GB checkpoint with device placement. Run by hand on a GPU machine (CI has none):

    python bench/gpu.py [--steps 10] [--batch 4] [--seq 2048] [--repeat 2] [--only plait-masters,hf-masters]
                        [--profile plait-masters-compile --out DIR] [--no-load]

A variant is <loop>-<recipe>[-options]: loop ``hf`` (the plain loop) or ``plait``; recipe ``autocast`` (fp32
parameters and AdamW, bf16 autocast), ``bf16`` (pure bf16: no masters) or ``masters`` (bf16 parameters, fp32 master
weights and AdamW state: ``plait train --bf16``); options ``compile`` (each decoder layer, and for plait its loss),
``ckpt`` (activation checkpointing), ``nomaingrad`` / ``eagerloss`` (switch one of plait's choices off, to measure
it), ``fp8`` / ``fp8row`` (plait only: ``--float8 tensorwise`` / ``rowwise``, compared with the plain loop without it). Each plait row is compared with the plain loop of the same recipe and compilation in the same run.
Each variant runs in its own process (clean GPU memory; compile caches persist on disk) and prints one JSON line;
the parent prints the table. MFU = tokens/s * (6 N + 12 L h s) / peak bf16 FLOP/s, the formula torchtitan
reports (N: every parameter, the tied embedding once, since it is also the LM head's matmul).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from mfu import flops_per_token, peak_flops
from plait.base import device

DEVICE = device.pick_device("auto")  # the accelerator torch finds (bench/gpu.py is run by hand on one)

# A precision recipe: (parameter dtype, autocast, fp32 master weights). Each runs in both loops, eager and compiled.
RECIPES = {
    "autocast": (torch.float32, True, False),  # fp32 parameters and AdamW, bf16 matmuls (torch.autocast)
    "bf16": (torch.bfloat16, False, False),  # pure bf16: parameters, gradients and AdamW state (no masters)
    "masters": (torch.bfloat16, False, True),  # bf16 parameters, fp32 master weights and AdamW state (--bf16)
}
VARIANTS = [f"{loop}-{recipe}{suffix}" for recipe in RECIPES for suffix in ("", "-compile") for loop in ("hf", "plait")]
VARIANTS += ["plait-masters-ckpt"]


def parse_variant(name: str) -> tuple[str, str, set[str]]:
    """``plait-masters-compile-ckpt`` -> ("plait", "masters", {"compile", "ckpt"})."""
    loop, recipe, *options = name.split("-")
    known = {"compile", "ckpt", "nomaingrad", "eagerloss", "fp8", "fp8row"}
    if loop not in ("hf", "plait") or recipe not in RECIPES or not set(options) <= known or \
            (loop == "hf" and {"fp8", "fp8row", "nomaingrad", "eagerloss"} & set(options)):
        raise SystemExit(f"unknown variant {name!r}: <hf|plait>-<{'|'.join(RECIPES)}>[-{'][-'.join(sorted(known))}]")
    return loop, recipe, set(options)


def llama_1b() -> LlamaConfig:
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    config._attn_implementation = "sdpa"
    return config


def device_name() -> str:
    return torch.get_device_module(DEVICE.type).get_device_name()


def plain_step(config: LlamaConfig, recipe: str, options: set[str], ids: torch.Tensor) -> tuple:
    """The loop a careful user writes with transformers and torch alone, for the recipe."""
    dtype, autocast, masters = RECIPES[recipe]
    with torch.device(ids.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if "ckpt" in options:
        model.gradient_checkpointing_enable()
    if "compile" in options:
        for layer in model.model.layers:
            layer.compile()
    params = list(model.parameters())
    stepped = [p.detach().float() for p in params] if masters else params
    optimizer = torch.optim.AdamW(stepped, lr=1e-4, fused=True)

    def step() -> torch.Tensor:
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if masters:
            for param, master in zip(params, stepped):
                master.grad = param.grad.float()
                param.grad = None
        torch.nn.utils.clip_grad_norm_(stepped, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(params, stepped)
        return loss.detach()

    return step, params


def plait_step(config: LlamaConfig, recipe: str, options: set[str], ids: torch.Tensor) -> tuple:
    """plait's own model, optimizer and step (what ``plait train`` runs) for the recipe."""
    import plait
    from plait.checkpoint.materialize import load_parallel_model
    from plait.optim import OptimizerStep, build_optimizer
    from plait.parallel.compile import compile_leaf_modules
    from plait.plugin.registry import default_registry

    dtype, autocast, masters = RECIPES[recipe]
    float8 = "tensorwise" if "fp8" in options else "rowwise" if "fp8row" in options else None
    parallel = plait.ParallelConfig(gradient_checkpointing="ckpt" in options, bf16_autocast=autocast, float8=float8)
    pmodel = load_parallel_model(config, parallel, dtype=dtype, device=ids.device)
    if "compile" in options:
        leaves = default_registry().leaf_modules(pmodel.adapter, config)
        if "eagerloss" in options:  # the layers alone, to measure what compiling the loss brings
            compile_leaf_modules(pmodel.module, leaves)
        else:
            pmodel.torch_compile(leaves)
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, fused=True,
                                optimizer_dtype=torch.float32 if masters else None,
                                main_grads="nomaingrad" not in options)
    optimizer_step = OptimizerStep(pmodel.grad_sync, optimizer, max_grad_norm=1.0)
    num_items = ids.numel() - ids.shape[0]

    def step() -> torch.Tensor:
        loss = pmodel.train_step(ids, ids, num_items_in_batch=num_items)
        optimizer_step(loss)
        return loss

    return step, list(pmodel.parameters())


def run_variant(name: str, steps: int, batch: int, seq: int, profile: Path | None = None) -> dict:
    loop, recipe, options = parse_variant(name)
    config = llama_1b()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=DEVICE)
    step, params = (plain_step if loop == "hf" else plait_step)(config, recipe, options, ids)
    n_params = sum(p.numel() for p in {id(p): p for p in params}.values())
    losses = [step() for _ in range(3)]  # warm-up (and compilation)
    device.synchronize(DEVICE)
    device.reset_peak_memory(DEVICE)
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    device.synchronize(DEVICE)
    seconds = (time.perf_counter() - start) / steps
    row = {"variant": name, "params": n_params, "step_s": seconds, "tokens_per_s": batch * seq / seconds,
           "peak_gpu_gib": device.peak_memory_bytes(DEVICE) / 2**30,
           "loss_first": float(losses[0]), "loss_last": float(losses[-1])}
    row["tflops"] = row["tokens_per_s"] * flops_per_token(n_params, config.num_hidden_layers, config.hidden_size,
                                                          seq) / 1e12
    peak = peak_flops(device_name())
    if peak is None:
        raise SystemExit(f"no bf16 peak known for {device_name()!r}; add it to bench/mfu.py's PEAK_BF16")
    row["mfu"] = row["tflops"] * 1e12 / peak
    if profile is not None:
        row["profile"] = profile_steps(step, profile / f"{name}.txt")
    return row


def profile_steps(step, path: Path) -> dict:
    """Two steps under torch.profiler: GPU time by kind of kernel (the table goes to ``path``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        device.synchronize(DEVICE)
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    kinds: dict[str, float] = {}
    for e in events:
        name = e.key.lower()
        # attention first: cuDNN's attention kernels carry "sm90" in their names too
        kind = ("attention" if any(k in name for k in ("flash", "attention", "fmha", "efficient", "sdpa")) else
                "gemm" if any(k in name for k in ("gemm", "nvjet", "cutlass", "sm90", "matmul")) else
                "optimizer" if any(k in name for k in ("adam", "multi_tensor", "foreach")) else
                "nccl" if "nccl" in name else "triton" if "triton" in name else "other")
        kinds[kind] = kinds.get(kind, 0.0) + e.device_time_total / 2 / 1e3
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by="device_time_total", row_limit=40))
    return {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}  # ms per step


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_load(stage: str, workdir: Path) -> dict:
    """One step of the checkpoint life cycle, in its own process so that its peak RSS is its own."""
    import plait
    from plait.checkpoint import save_checkpoint
    from plait.checkpoint.consolidate import consolidate
    from plait.checkpoint.materialize import load_parallel_model
    from plait.optim import OptimizerStep, build_optimizer

    baseline = peak_rss_mib()
    start = time.perf_counter()
    if stage == "save":  # a bf16 model with fp32 masters and AdamW state after one step: the training checkpoint
        pmodel = load_parallel_model(llama_1b(), plait.ParallelConfig(), dtype=torch.bfloat16, device=DEVICE)
        optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, optimizer_dtype=torch.float32, fused=True)
        ids = torch.randint(0, 128256, (1, 512), device=DEVICE)
        pmodel.train_step(ids, ids)
        OptimizerStep(pmodel.grad_sync, optimizer, 1.0)()
        start = time.perf_counter()
        save_checkpoint(workdir / "checkpoint-1", pmodel, optimizer, None, 1, {})
    elif stage == "consolidate":
        consolidate(workdir / "checkpoint-1", workdir / "hf")
    elif stage == "lazy-load":
        pmodel = load_parallel_model(workdir / "hf", plait.ParallelConfig(), dtype=torch.bfloat16, device=DEVICE)
        device.synchronize(DEVICE)
    elif stage == "from_pretrained":
        AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.bfloat16).to(DEVICE)
        device.synchronize(DEVICE)
    seconds = time.perf_counter() - start
    gib = sum(f.stat().st_size for f in workdir.rglob("*") if f.is_file()) / 2**30
    return {"stage": stage, "seconds": seconds, "peak_rss_over_baseline_mib": peak_rss_mib() - baseline,
            "peak_gpu_gib": device.peak_memory_bytes(DEVICE) / 2**30, "bytes_on_disk_gib": gib}


def child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}",
                "variant": args[1], "stage": args[1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def peer_of(name: str) -> str:
    """The plain loop of the same recipe and compilation: what a plait variant is compared with."""
    _, recipe, options = parse_variant(name)
    return f"hf-{recipe}" + ("-compile" if "compile" in options else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument("--repeat", type=int, default=2, help="runs of each variant (all variants, then again)")
    parser.add_argument("--profile", default="", help="variants to profile (two steps each, after the timed ones)")
    parser.add_argument("--out", default="bench-gpu-out", help="folder for profiler tables")
    parser.add_argument("--no-load", action="store_true", help="skip the checkpoint life-cycle measurements")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.variant:
        profile = Path(ns.out) if ns.variant in ns.profile.split(",") else None
        print(json.dumps(run_variant(ns.variant, ns.steps, ns.batch, ns.seq, profile)))
        return
    if ns.stage:
        print(json.dumps(run_load(ns.stage, Path(ns.workdir))))
        return

    print(f"{device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"Llama-3.2-1B shapes, batch {ns.batch} x {ns.seq}, sdpa, fused AdamW, clipping 1.0, {ns.steps} timed "
          f"steps after 3 warm-up, {ns.repeat} runs", flush=True)
    rows = []
    for run in range(ns.repeat):
        for name in ns.only.split(","):
            row = child(["--variant", name, "--steps", str(ns.steps), "--batch", str(ns.batch), "--seq",
                         str(ns.seq), "--profile", ns.profile, "--out", ns.out])
            row["run"] = run + 1
            print(json.dumps(row), flush=True)
            rows.append(row)
    if not ns.no_load:
        workdir = Path(tempfile.mkdtemp(prefix="plait-gpu-bench-"))
        load_rows = []
        for stage in ("save", "consolidate", "lazy-load", "from_pretrained"):
            row = child(["--stage", stage, "--workdir", str(workdir)])
            print(json.dumps(row), flush=True)
            load_rows.append(row)
        shutil.rmtree(workdir, ignore_errors=True)
    base = {(r["variant"], r["run"]): r for r in rows if "error" not in r}
    print("\n| variant | run | step (s) | tokens/s | TFLOP/s | MFU | peak GPU GiB | vs plain loop, same recipe and run |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['run']} | error: {r['error'][:80]} | | | | | |")
            continue
        peer = base.get((peer_of(r["variant"]), r["run"]))
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.3f}" if peer and r["variant"].startswith("plait") else ""
        print(f"| {r['variant']} | {r['run']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
              f"{r['mfu']:.1%} | {r['peak_gpu_gib']:.1f} | {ratio} |")
    if not ns.no_load:
        print("\n| stage | seconds | peak host RSS over baseline (MiB) | peak GPU GiB | on disk (GiB) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for r in load_rows:
            if "error" in r:
                print(f"| {r['stage']} | error: {r['error'][:80]} | | | |")
                continue
            print(f"| {r['stage']} | {r['seconds']:.1f} | {r['peak_rss_over_baseline_mib']:,.0f} | "
                  f"{r['peak_gpu_gib']:.2f} | {r['bytes_on_disk_gib']:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
