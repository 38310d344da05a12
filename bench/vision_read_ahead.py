"""What reading the next step's pixels during this step (``TrainingMethod.read_ahead``, plait.data.pixel_loader)
saves an image-text run whose rows keep no pixels, against encoding them when each batch is built.

    python bench/vision_read_ahead.py [--rows 64] [--size 336] [--batch 8] [--steps 12] [--hidden 128]

A LLaVA-like model (a CLIP tower at ``--size`` in 14-pixel patches, a Llama decoder, both ``--hidden`` wide and 2
layers deep) trained by plait's Trainer in one process on torch's one thread, on ``--rows`` rows of one picture each
(640 x 480 PNGs, resized and cropped by CLIP's image processor), ``--batch`` rows a step; once with the read-ahead
turned off (the method's ``read_ahead`` a no-op: every batch encodes its pixels when it is built) and once as plait
runs, each in a process of its own, twice in turn. It prints the median step time of each (the first step left out)
and what encoding one batch's pixels costs alone. Run it alone: a concurrent process takes the core the loader's
thread runs on.
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


def build(folder: Path, rows: int, size: int, hidden: int) -> None:
    """The model, its processor and ``rows`` rows of one picture each in ``folder``."""
    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    import torch
    from PIL import Image
    from test_vision_data import template, tokenizer
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = tokenizer("<image>")
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, image_token="<image>",
                   chat_template=template("<image>")).save_pretrained(folder / "model")
    vision = CLIPVisionConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                              num_attention_heads=4, image_size=size, patch_size=14, projection_dim=hidden)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1, vision_feature_select_strategy="default")).save_pretrained(folder / "model")
    generator = np.random.default_rng(0)
    lines = []
    for i in range(rows):
        Image.fromarray(generator.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the picture"}]},
            {"role": "assistant", "content": "a red square on blue"}], "images": [f"{i}.png"]}))
    (folder / "rows.jsonl").write_text("\n".join(lines) + "\n")


def measure(folder: Path, read_ahead: bool, batch: int, steps: int, size: int) -> dict:
    """In this process: ``steps`` training steps, reading ahead or not; step times, and one batch encoded alone."""
    import torch

    from plait.data.vision import collate
    from plait.run.train_args import TrainArgs
    from plait.run.trainer import Trainer

    torch.set_num_threads(1)
    args = TrainArgs(model_name_or_path=str(folder / "model"), train_file=str(folder / "rows.jsonl"),
                     block_size=size * size // 196 + 64, per_device_train_batch_size=batch, max_steps=steps,
                     learning_rate=1e-4, device="cpu", save_final=False, output_dir=str(folder / "out"),
                     logging_steps=steps)
    trainer = Trainer(args)
    if not read_ahead:
        trainer.method.read_ahead = lambda *args: None
    starts = []
    step = trainer.step

    def timed(index: int) -> dict:
        starts.append(time.perf_counter())
        return step(index)

    trainer.step = timed
    trainer.train()
    starts.append(time.perf_counter())
    took = [b - a for a, b in zip(starts, starts[1:])][1:]
    examples = trainer.method.examples[:batch]
    begin = time.perf_counter()
    collate(examples, 0)
    return {"step_ms": 1000 * statistics.median(took), "encode_ms": 1000 * (time.perf_counter() - begin)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--size", type=int, default=336)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # in a child: measure there
    parser.add_argument("--read_ahead", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.folder:
        print(json.dumps(measure(Path(args.folder), bool(args.read_ahead), args.batch, args.steps, args.size)))
        return
    folder = Path(tempfile.mkdtemp(prefix="plait-read-ahead-"))
    build(folder, args.rows, args.size, args.hidden)
    found: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(2):
        for read_ahead in (False, True):
            done = subprocess.run([sys.executable, __file__, "--folder", str(folder), "--read_ahead",
                                   str(int(read_ahead)), "--batch", str(args.batch), "--steps", str(args.steps),
                                   "--size", str(args.size)], check=True, capture_output=True, text=True)
            found[read_ahead].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.rows} rows of one 640 x 480 picture (CLIP at {args.size}), batches of {args.batch}, hidden "
          f"{args.hidden}, {args.steps} steps, torch on 1 thread; two runs each, in turn\n")
    print("| pixels | step (ms, median of each run) | one batch's encoding alone (ms) |")
    print("| --- | --- | --- |")
    for read_ahead, name in ((False, "encoded when the batch is built"), (True, "read during the step before")):
        runs = found[read_ahead]
        steps = ", ".join(f"{r['step_ms']:.0f}" for r in runs)
        encodings = ", ".join(f"{r['encode_ms']:.0f}" for r in runs)
        print(f"| {name} | {steps} | {encodings} |")
    before = statistics.median(r["step_ms"] for r in found[False])
    after = statistics.median(r["step_ms"] for r in found[True])
    print(f"\nread ahead / at the batch: step time {after / before:.3f}x ({before - after:.0f} ms a step less)")


if __name__ == "__main__":
    main()
