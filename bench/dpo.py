"""DPO step time: plait's trainer against TRL's DPOTrainer on one process, and plait at tp=2 and dp=2.

    python bench/dpo.py [--hidden 512 --layers 4 --vocab 8192 --pairs 4 --length 256 --steps 6]

The same Llama (random weights, saved once with a tokenizer), the same preference rows (prompt and completions of
random words, each row about --length tokens) and the same global batch of --pairs pairs: TRL 1.16's DPOTrainer
(fp32, its reference a second copy of the model) and ``plait train --method dpo`` in one process, then plait on 2
processes at tp=2 (SP) and at dp=2 (each rank half the pairs). A step is forward and backward of the policy on the
pairs' chosen and rejected rows, the reference's forward, and AdamW. Printed: the median step time of --steps
after one warm-up step, each against TRL's with the same threads (plait's one process should be >= 1.0x), and
against plait's one process with the threads each of the 2 processes gets (half the cores): the 2-process layouts'
limit is 2x that, less what their collectives cost.
Run it alone: the 2-process runs use both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plait.testing.launcher import free_port  # a fixed port was still held by the previous run


def build(root: Path, args) -> None:
    """The model directory (with a tokenizer that has a chat template) and the pairs file."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.data.chat_tokenizer import save_chat_tokenizer

    rng = random.Random(0)
    words = [f"w{i}" for i in range(2000)]
    save_chat_tokenizer([" ".join(rng.choices(words, k=200)) for _ in range(200)], args.vocab, root / "model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                 num_key_value_heads=args.hidden // 64,
                                 max_position_embeddings=2 * args.length)).save_pretrained(root / "model")
    with open(root / "pairs.jsonl", "w") as file:
        for _ in range(args.pairs * (args.steps + 1)):
            half = args.length // 4  # words become a few tokens each: rows of about --length tokens
            file.write(json.dumps({"prompt": " ".join(rng.choices(words, k=half)),
                                   "chosen": " " + " ".join(rng.choices(words, k=half)),
                                   "rejected": " " + " ".join(rng.choices(words, k=half))}) + "\n")


def plait_flags(root: Path, args, out: str) -> dict:
    return dict(method="dpo", model_name_or_path=str(root / "model"), train_file=str(root / "pairs.jsonl"),
                block_size=2 * args.length, per_device_train_batch_size=args.pairs, max_steps=args.steps + 1,
                learning_rate=1e-6, device="cpu", save_final=False, output_dir=out, lr_scheduler_type="constant")


def plait_worker(flags_file: str) -> None:
    """One rank (or the one process): the trainer's steps, timed; rank 0 prints them as JSON."""
    import torch.distributed as dist

    from plait.run.train_args import TrainArgs
    from plait.run.trainer import Trainer

    trainer = Trainer(TrainArgs(**json.loads(Path(flags_file).read_text())))
    times = []
    for step in range(trainer.args.max_steps):
        start = time.perf_counter()
        trainer.step(step)
        times.append(time.perf_counter() - start)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("TIMES " + json.dumps(times), flush=True)


def run_plait(root: Path, args, world: int, threads: int, **layout) -> float:
    flags = {**plait_flags(root, args, str(root / f"out{world}{sorted(layout)}")), **layout}
    if world > 1:
        flags["per_device_train_batch_size"] = args.pairs // (world // layout.get("tensor_parallel_size", 1))
    path = root / "flags.json"
    path.write_text(json.dumps(flags))
    command = [sys.executable, __file__, "--worker", str(path)]
    if world > 1:
        command = ["torchrun", "--nproc_per_node", str(world), "--master_port", str(free_port()), *command[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
    times = json.loads(next(line for line in out.splitlines() if line.startswith("TIMES "))[6:])
    return statistics.median(times[1:])


def run_trl(root: Path, args) -> float:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times, self.start = [], 0.0

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.start)

    rows = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()]
    config = DPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=args.pairs,
                       max_steps=args.steps + 1, learning_rate=1e-6, report_to=[], max_length=2 * args.length,
                       use_cpu=True, save_strategy="no", bf16=False, logging_steps=1,
                       train_sampling_strategy="sequential", lr_scheduler_type="constant")
    model = root / "model"
    clock = Clock()
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                         ref_model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), args=config,
                         train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(model),
                         callbacks=[clock])
    trainer.train()
    return statistics.median(clock.times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        plait_worker(args.worker)
        return
    root = Path(tempfile.mkdtemp(prefix="plait-bench-dpo-"))
    build(root, args)
    trl = run_trl(root, args)
    cores = os.cpu_count()
    one = run_plait(root, args, 1, cores)
    single = run_plait(root, args, 1, 1)  # what each of 2 processes has on 2 cores: the base of their 2x limit
    tp2 = run_plait(root, args, 2, max(1, cores // 2), tensor_parallel_size=2)
    dp2 = run_plait(root, args, 2, max(1, cores // 2))
    print(f"DPO step, Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, {args.pairs} pairs of "
          f"~{args.length}-token rows, fp32, {os.cpu_count()} cores\n")
    print(f"| run | step (s) | vs TRL ({cores} threads) | vs plait 1 process, {max(1, cores // 2)} thread(s) |")
    print("| --- | --- | --- | --- |")
    rows = ((f"TRL DPOTrainer, 1 process, {cores} threads", trl), (f"plait, 1 process, {cores} threads", one),
            (f"plait, 1 process, {max(1, cores // 2)} thread(s)", single),
            ("plait tp=2 (SP), 2 processes", tp2), ("plait dp=2, 2 processes", dp2))
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {trl / seconds:.2f}x | {single / seconds:.2f}x |")


if __name__ == "__main__":
    main()
