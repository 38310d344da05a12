"""What packing saves on SFT data with a skewed length distribution: padding tokens, blocks (steps per epoch)
and training time per real token, padded (one example per block) against packed (several per block, attention
kept within each by restarting position ids).

Example lengths are drawn from a log-normal distribution (many short answers, a long tail; median and spread
set by flags), capped at the block size as ``--overlong truncate`` does. Both layouts are laid out by plait's
own ``lay_out``; the step time is a forward + backward + AdamW step of a Llama (sizes by flags) on one process,
``--batch`` blocks per step, median of ``--steps`` timed steps after one warm-up, divided by the real (non-pad)
tokens of the step's blocks. Epoch time = blocks / batch * step time.

    python bench/sft_packing.py                          # the lead's numbers (idle machine)
    python bench/sft_packing.py --device auto            # on the accelerator torch finds
    python bench/sft_packing.py --examples 200 --block_size 128 --vocab 512 --hidden 64 --layers 2 --steps 2  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from plait.base import device
from plait.data.sft_blocks import Example, batch_inputs, count_labels, lay_out

PAD = 0


def skewed_examples(count: int, median: float, sigma: float, vocab: int, seed: int) -> list[Example]:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(2, rng.lognormal(np.log(median), sigma, count).astype(int))
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(1, vocab, n)
        out.append(Example(ids, np.arange(n) >= n // 3, f"example {i}"))  # the last two thirds: the answer
    return out


def step_seconds(blocks, args) -> tuple[float, float]:
    """(median seconds per step, real tokens per step) training on the first blocks."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                         intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
                                         num_attention_heads=max(args.hidden // 64, 2), num_key_value_heads=2,
                                         max_position_embeddings=args.block_size,
                                         attn_implementation=args.attn))
    dev = device.pick_device(args.device)
    model.to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = torch.arange(min(args.batch, len(blocks)))
    ids, labels, positions = batch_inputs(blocks, rows, dev)
    num_items = count_labels(blocks, rows)
    real = int((ids != PAD).sum())  # example ids are drawn from 1.., so pad id 0 marks exactly the padding
    times = []
    for step in range(args.steps + 1):
        device.synchronize(dev)
        start = time.perf_counter()
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 reduction="sum") / num_items
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        device.synchronize(dev)
        if step:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - start)
    return statistics.median(times), real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--median", type=float, default=60, help="median example length in tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal spread (1.0: a long tail)")
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="blocks per step")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, or auto: the accelerator torch finds")
    args = parser.parse_args()
    examples = skewed_examples(args.examples, args.median, args.sigma, args.vocab, args.seed)
    lengths = np.array([min(len(e.ids), args.block_size) for e in examples])
    print(f"{args.examples} examples, lengths median {np.median(lengths):.0f}, mean {lengths.mean():.0f}, "
          f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()} tokens (capped at --block_size="
          f"{args.block_size}); Llama hidden={args.hidden} layers={args.layers} attn={args.attn}, "
          f"{args.batch} blocks per step, on {device.pick_device(args.device)} ({torch.get_num_threads()} threads)")
    rows = []
    for packing in (False, True):
        blocks = lay_out(examples, args.block_size, PAD, packing, "truncate")
        seconds, real = step_seconds(blocks, args)
        steps = -(-len(blocks) // args.batch)
        rows.append(("packed" if packing else "padded", len(blocks), blocks.pad_tokens,
                     blocks.pad_tokens / blocks.input_ids.numel(), steps, seconds, seconds / real * 1e6,
                     steps * seconds))
    print("\n| layout | blocks | padding tokens | padding | steps/epoch | s/step | us per real token | epoch s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, n, pad, frac, steps, seconds, per_token, epoch in rows:
        print(f"| {name} | {n:,} | {pad:,} | {frac:.1%} | {steps:,} | {seconds:.3f} | {per_token:.1f} | {epoch:,.1f} |")
    print(f"\npacking: {rows[0][4] / rows[1][4]:.2f}x fewer steps per epoch, "
          f"{rows[0][6] / rows[1][6]:.2f}x less time per real token, {rows[0][7] / rows[1][7]:.2f}x shorter epoch")


if __name__ == "__main__":
    main()
