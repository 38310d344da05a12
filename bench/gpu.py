"""bf16 training of a ~1.2B Llama (Llama-3.2-1B shapes) on one GPU: tokens/s and MFU, plait beside a plain
transformers + torch loop on the same model shape, batch and attention kernel; then lazy load and consolidate
of the multi-GB checkpoint with device placement. Run by hand on a GPU machine (CI has none):

    python bench/gpu.py [--steps 10] [--batch 4] [--seq 2048] [--only plait-bf16,hf-autocast] [--no-load]

Each variant runs in its own process (clean GPU memory and compile caches) and prints one JSON line; the
parent prints the table. MFU = tokens/s * (6 N + 12 L h s) / peak bf16 FLOP/s, the formula torchtitan
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
from transformers import AutoModelForCausalLM, LlamaConfig

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}  # dense, datasheet
VARIANTS = {
    # name: (loop, parameter dtype, autocast, activation checkpointing, torch.compile)
    "hf-autocast": ("hf", torch.float32, True, False, False),
    "plait-autocast": ("plait", torch.float32, True, False, False),
    "hf-bf16": ("hf", torch.bfloat16, False, False, False),
    "hf-bf16-compile": ("hf", torch.bfloat16, False, False, True),
    "plait-bf16": ("plait", torch.bfloat16, False, False, False),
    "plait-bf16-compile": ("plait", torch.bfloat16, False, False, True),
    "plait-bf16-ckpt": ("plait", torch.bfloat16, False, True, False),
}


def llama_1b() -> LlamaConfig:
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    config._attn_implementation = "sdpa"
    return config


def peak_flops() -> float:
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    raise SystemExit(f"no bf16 peak known for {name!r}; add it to PEAK_BF16")


def flops_per_token(config: LlamaConfig, params: int, seq: int) -> float:
    return 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq


def run_variant(name: str, steps: int, batch: int, seq: int) -> dict:
    loop, dtype, autocast, ckpt, compile_ = VARIANTS[name]
    config = llama_1b()
    device = torch.device("cuda")
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    if loop == "hf":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if ckpt:
            model.gradient_checkpointing_enable()
        if compile_:
            for layer in model.model.layers:
                layer.compile()
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step() -> float:
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()
    else:
        import plait
        from plait.compile import compile_leaf_modules
        from plait.materialize import load_parallel_model
        from plait.optim import OptimizerStep, build_optimizer
        from plait.registry import default_registry

        pmodel = load_parallel_model(config, plait.ParallelConfig(gradient_checkpointing=ckpt, bf16_autocast=autocast), dtype=dtype,
                                     device=device)
        if compile_:
            compile_leaf_modules(pmodel.module, default_registry().leaf_modules(pmodel.adapter, config))
        optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, optimizer_dtype=torch.float32, fused=True)
        optimizer_step = OptimizerStep(pmodel.grad_sync, optimizer, max_grad_norm=1.0)
        params = list(pmodel.parameters())
        num_items = batch * (seq - 1)

        def step() -> float:
            loss = pmodel.train_step(ids, ids, num_items_in_batch=num_items)
            optimizer_step()
            return loss

    n_params = sum(p.numel() for p in {id(p): p for p in params}.values())
    losses = [step() for _ in range(3)]  # warm-up (and compilation)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens_per_s = batch * seq / seconds
    tflops = tokens_per_s * flops_per_token(config, n_params, seq)
    return {"variant": name, "params": n_params, "step_s": seconds, "tokens_per_s": tokens_per_s,
            "tflops": tflops / 1e12, "mfu": tflops / peak_flops(),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
            "loss_first": float(losses[0]), "loss_last": float(losses[-1])}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_load(stage: str, workdir: Path) -> dict:
    """One step of the checkpoint life cycle, in its own process so that its peak RSS is its own."""
    import plait
    from plait.checkpoint import save_checkpoint
    from plait.checkpoint.consolidate import consolidate
    from plait.materialize import load_parallel_model
    from plait.optim import OptimizerStep, build_optimizer

    baseline = peak_rss_mib()
    device = torch.device("cuda")
    start = time.perf_counter()
    if stage == "save":  # a bf16 model with fp32 masters and AdamW state after one step: the training checkpoint
        pmodel = load_parallel_model(llama_1b(), plait.ParallelConfig(), dtype=torch.bfloat16, device=device)
        optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, optimizer_dtype=torch.float32, fused=True)
        ids = torch.randint(0, 128256, (1, 512), device=device)
        pmodel.train_step(ids, ids)
        OptimizerStep(pmodel.grad_sync, optimizer, 1.0)()
        start = time.perf_counter()
        save_checkpoint(workdir / "checkpoint-1", pmodel, optimizer, None, 1, {})
    elif stage == "consolidate":
        consolidate(workdir / "checkpoint-1", workdir / "hf")
    elif stage == "lazy-load":
        pmodel = load_parallel_model(workdir / "hf", plait.ParallelConfig(), dtype=torch.bfloat16, device=device)
        torch.cuda.synchronize()
    elif stage == "from_pretrained":
        model = AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.bfloat16).to(device)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    gib = sum(f.stat().st_size for f in workdir.rglob("*") if f.is_file()) / 2**30
    return {"stage": stage, "seconds": seconds, "peak_rss_over_baseline_mib": peak_rss_mib() - baseline,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30, "bytes_on_disk_gib": gib}


def child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}",
                "variant": args[1], "stage": args[1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument("--no-load", action="store_true", help="skip the checkpoint life-cycle measurements")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.variant:
        print(json.dumps(run_variant(ns.variant, ns.steps, ns.batch, ns.seq)))
        return
    if ns.stage:
        print(json.dumps(run_load(ns.stage, Path(ns.workdir))))
        return

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Llama-3.2-1B shapes, batch {ns.batch} x "
          f"{ns.seq}, sdpa, fused AdamW, {ns.steps} timed steps after 3 warm-up", flush=True)
    rows = []
    for name in ns.only.split(","):
        row = child(["--variant", name, "--steps", str(ns.steps), "--batch", str(ns.batch), "--seq", str(ns.seq)])
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
    base = {r["variant"]: r for r in rows if "error" not in r}
    print("\n| variant | step (s) | tokens/s | TFLOP/s | MFU | peak GPU GiB | vs hf same precision |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:80]} | | | | | |")
            continue
        peer = base.get("hf-autocast" if "autocast" in r["variant"] else
                        "hf-bf16-compile" if "compile" in r["variant"] else "hf-bf16")
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.3f}" if peer else "-"
        print(f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
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
