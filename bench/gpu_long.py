"""Long packed context on one GPU: one block of 32k tokens holding many SFT documents, trained as ``plait train
--packing`` trains it (bf16 with fp32 masters, activation checkpointing, compiled layers and loss), for each
attention kernel transformers offers here. Run by hand on a GPU machine (CI has none):

    python bench/gpu_long.py [--block 32768] [--attn sdpa,flex_attention] [--steps 5]
    python bench/gpu_long.py --tiny --device cpu      # the plumbing, on the CPU in seconds

Documents (log-normal lengths, as bench/sft_packing.py draws them) are laid out by plait's own ``lay_out``: one
packed row whose position ids restart at each document, from which transformers builds a block-diagonal causal
mask, so a document attends only within itself. That is checked first: the per-document losses of the packed
forward against each document run alone (a padded layout's rows), before any training step. Then tokens/s
(real tokens: the block holds no padding but its tail) and peak memory over timed steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from gpu import llama_1b

import plait
from plait.base import device
from plait.checkpoint.materialize import load_parallel_model
from plait.data.sft_blocks import Example, count_labels, lay_out
from plait.optim import OptimizerStep, build_optimizer
from plait.plugin.registry import default_registry
from plait.tp.loss import IGNORE_INDEX

PAD = 0


def documents(block: int, vocab: int, median: float, seed: int) -> list[Example]:
    """Documents of log-normal length (capped at a quarter block) until one block is full."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < block:
        n = int(min(max(16, rng.lognormal(np.log(median), 0.8)), block // 4, block - total))
        ids = rng.integers(1, vocab, n)
        out.append(Example(ids, np.arange(n) >= n // 4, f"document {len(out)}"))  # the last 3/4: the answer
        total += n
    return out


def model_config(args: argparse.Namespace, attn: str):
    config = llama_1b()
    if args.tiny:
        config.update({"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2})
    config.max_position_embeddings = args.block
    config._attn_implementation = attn
    return config


def per_document_losses(pmodel, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None) -> list[float]:
    """Mean loss of each document's trainable tokens in one forward of ``ids`` [1, seq] (no gradient)."""
    with torch.no_grad():
        logits = pmodel(ids, position_ids=positions)
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        token = F.cross_entropy(logits[0].float(), targets[0], ignore_index=IGNORE_INDEX, reduction="none")
        del logits
    starts = [0] if positions is None else (positions[0] == 0).nonzero().flatten().tolist()
    bounds = list(zip(starts, starts[1:] + [ids.shape[1]]))
    losses = []
    for a, b in bounds:
        mask = targets[0, a:b] != IGNORE_INDEX
        losses.append(float(token[a:b][mask].mean()) if mask.any() else float("nan"))
    return losses


def run(args: argparse.Namespace, attn: str) -> dict:
    dev = device.pick_device(args.device)
    config = model_config(args, attn)
    docs = documents(args.block, config.vocab_size, args.median, args.seed)
    packed = lay_out(docs, args.block, PAD, packing=True, overlong="truncate")
    rows = torch.arange(1)
    ids = packed.input_ids[rows].long().to(dev)
    labels = packed.labels[rows].long().to(dev)
    positions = packed.position_ids[rows].long().to(dev)
    real = int((ids != PAD).sum())
    torch.manual_seed(0)
    pmodel = load_parallel_model(config, plait.ParallelConfig(gradient_checkpointing=True),
                                 dtype=torch.float32 if args.tiny else torch.bfloat16, device=dev)
    # the check: the packed forward's per-document losses against each document alone
    together = per_document_losses(pmodel, ids, labels, positions)
    alone = []  # each document of the row run by itself, as a padded layout's rows hold them
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    for a, b in zip(starts, starts[1:] + [ids.shape[1]]):
        alone += per_document_losses(pmodel, ids[:, a:b], labels[:, a:b], None)
    pairs = [(a, b) for a, b in zip(together, alone) if np.isfinite(a) and np.isfinite(b)]
    diff = max(abs(a - b) for a, b in pairs)

    if args.compile:
        pmodel.torch_compile(default_registry().leaf_modules(pmodel.adapter, config))
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-5, fused=device.use_fused_adamw(dev),
                                optimizer_dtype=None if args.tiny else torch.float32)
    optimizer_step = OptimizerStep(pmodel.grad_sync, optimizer, max_grad_norm=1.0)
    num_items = count_labels(packed, rows)
    losses = []
    for step in range(args.steps + 2):  # two warm-up steps (and compilation)
        if step == 2:
            device.synchronize(dev)
            device.reset_peak_memory(dev)
            start = time.perf_counter()
        loss = pmodel.train_step(ids, labels, num_items_in_batch=num_items, position_ids=positions)
        optimizer_step(loss)
        losses.append(float(loss))
    device.synchronize(dev)
    seconds = (time.perf_counter() - start) / args.steps
    peak = device.peak_memory_bytes(dev)
    return {"attn": attn, "block": args.block, "documents": len(starts), "real_tokens": real,
            "max_per_document_loss_diff": diff, "documents_compared": len(pairs),
            "step_s": seconds, "tokens_per_s": real / seconds,
            "peak_gib": None if peak is None else peak / 2**30, "loss_first": losses[0], "loss_last": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=32768)
    parser.add_argument("--median", type=float, default=1500, help="median document length in tokens")
    parser.add_argument("--attn", default="sdpa,flex_attention")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and fp32: the plumbing only")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny and args.block == 32768:
        args.block, args.median = 512, 40
    if args.one:
        print(json.dumps(run(args, args.one)))
        return
    rows = []
    for attn in args.attn.split(","):  # each kernel in its own process: clean memory and compile caches
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", attn], capture_output=True, text=True)
        if out.returncode != 0:
            rows.append({"attn": attn, "error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n| attention | documents in {args.block} tokens | max per-document loss diff vs alone | s/step | "
          "tokens/s | peak GiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['attn']} | error: {r['error'][:90]} | | | | |")
            continue
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(f"| {r['attn']} | {r['documents']} | {r['max_per_document_loss_diff']:.2e} | {r['step_s']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {peak} |")


if __name__ == "__main__":
    main()
