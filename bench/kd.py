"""Distillation's logits memory per rank: the vocabulary split over tp, never gathered.

    python bench/kd.py [--vocab 131072 --tokens 512 --tp 1 4]

A student and a teacher Llama with a 128k vocabulary (small otherwise: hidden 64, 2 layers, so that the logits are
what costs), one ``--method kd`` step (jsd) on --tokens tokens per rank, at each tp of --tp (a world of tp
processes). Printed per layout: the bytes of the logits a rank holds while the loss is computed (the student's slice
and the teacher's kept slice, as the objective sees them) and their share of one process's, which should be 1/tp:
no rank gathers the vocabulary. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from plait.testing.launcher import free_port  # a fixed port was still held by the previous run


def worker(flags_file: str, out: str) -> None:
    """One rank: a KD step with the objective watched; rank 0 writes the largest logits bytes it saw."""
    import torch.distributed as dist

    import plait.run.methods.kd as kd
    from plait.run.train_args import TrainArgs
    from plait.run.trainer import Trainer

    seen = {"bytes": 0}
    divergence = kd.divergence

    def watched(logits, teacher, *rest):
        held = logits.values.numel() * logits.values.element_size() + teacher.numel() * teacher.element_size()
        seen["bytes"] = max(seen["bytes"], held)
        return divergence(logits, teacher, *rest)

    kd.divergence = watched
    Trainer(TrainArgs(**json.loads(Path(flags_file).read_text()))).train()
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(seen))


def build(root: Path, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, layers in (("student", 2), ("teacher", 3)):
        torch.manual_seed(len(name))
        LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=4,
                                     max_position_embeddings=1024)).save_pretrained(root / name)
    (root / "text.txt").write_text(" ".join(f"word{i % 97}" for i in range(20000)))


def run(root: Path, tp: int, tokens: int) -> int:
    block = 256
    flags = dict(method="kd", model_name_or_path=str(root / "student"), teacher_model_name_or_path=str(root / "teacher"),
                 train_file=str(root / "text.txt"), block_size=block, per_device_train_batch_size=tokens // block,
                 max_steps=1, device="cpu", save_final=False, kd_loss="jsd", tensor_parallel_size=tp,
                 output_dir=str(root / f"out{tp}"), data_cache_dir=str(root / "cache"))
    path, out = root / f"flags{tp}.json", root / f"seen{tp}.json"
    path.write_text(json.dumps(flags))
    command = ["torchrun", "--nproc_per_node", str(tp), "--master_port", str(free_port()), __file__, "--worker",
               str(path), str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--worker", nargs=2)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    root = Path(tempfile.mkdtemp(prefix="plait-bench-kd-"))
    build(root, args.vocab)
    held = {tp: run(root, tp, args.tokens) for tp in args.tp}
    print(f"KD logits per rank, vocab {args.vocab}, {args.tokens} tokens per rank (student + teacher, fp32)\n")
    print("| tp | logits MiB per rank | vs tp=1 |\n| --- | ---: | ---: |")
    for tp, size in held.items():
        print(f"| {tp} | {size / 2**20:.1f} | {size / held[args.tp[0]]:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
