"""What an image-text run's rows hold in memory with their pixels kept (``VisionEncoder(lazy=False)``) or encoded
again per batch (``lazy=True``, what training, GRPO and DPO read their rows with), and what the second costs a batch.

    python bench/vision_memory.py [--rows 300] [--size 336] [--batch 8]

Rows of one ``--size`` x ``--size`` picture each, encoded by a LLaVA-1.5-like processor (CLIP's image processor at
that size: 3 x size x size float32 pixels an image), each way in a process of its own so that the resident set of one
does not carry over: the resident set's growth over reading the rows, the pixel tensors the examples keep, and the
median time of ``collate`` over batches of ``--batch`` rows (the re-encoding is in it under ``lazy``). Run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(mode: str, rows: int, size: int, batch: int) -> dict:
    """In this process: read ``rows`` rows the ``mode`` way and time collating them in batches."""
    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    import psutil
    from PIL import Image
    from test_vision_data import template, tokenizer
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from plait.data.vision import VisionEncoder, collate

    folder = Path(tempfile.mkdtemp(prefix="plait-vision-memory-"))
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / "0.png")
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer("<image>"), patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               image_token="<image>", chat_template=template("<image>"))
    encoder = VisionEncoder(processor, folder, lazy=mode == "lazy")
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe it"}]},
                        {"role": "assistant", "content": "a picture"}], "images": ["0.png"]}
    rss = lambda: psutil.Process().memory_info().rss / 2**20  # noqa: E731
    encoder.encode(row, "warm-up")  # the processor's first call allocates what every later one reuses
    before = rss()
    examples = [encoder.encode(row, f"row {i}") for i in range(rows)]
    grown = rss() - before
    kept = sum(t.numel() * t.element_size() for e in examples for t in e.pixels.values()) / 2**20
    times = []
    for start in range(0, rows - batch + 1, batch):
        begin = time.perf_counter()
        collate(examples[start:start + batch], 0)
        times.append(time.perf_counter() - begin)
    return {"mode": mode, "grown": grown, "kept": kept, "collate_ms": 1000 * statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--size", type=int, default=336)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mode", choices=("eager", "lazy"), help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.rows, args.size, args.batch)))
        return
    found = []
    for mode in ("eager", "lazy"):
        done = subprocess.run([sys.executable, __file__, "--mode", mode, "--rows", str(args.rows), "--size",
                               str(args.size), "--batch", str(args.batch)], check=True, capture_output=True, text=True)
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.rows} rows of one {args.size} x {args.size} image, batches of {args.batch}\n")
    print("| rows kept | resident set grown (MiB) | pixel tensors kept (MiB) | collate a batch (ms, median) |")
    print("| --- | --- | --- | --- |")
    for r in found:
        print(f"| {r['mode']} | {r['grown']:.0f} | {r['kept']:.0f} | {r['collate_ms']:.1f} |")
    eager, lazy = found
    print(f"\nlazy / eager: resident set {lazy['grown'] / max(eager['grown'], 1e-9):.3f}x, a batch's collate "
          f"{lazy['collate_ms'] / eager['collate_ms']:.1f}x ({lazy['collate_ms'] - eager['collate_ms']:.1f} ms more, "
          f"{(lazy['collate_ms'] - eager['collate_ms']) / args.batch:.1f} ms an image)")


if __name__ == "__main__":
    main()
