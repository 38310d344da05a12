"""Your own training loop on ``plait.parallelize``: the runnable companion of docs/own-loop.md.

    torchrun --nproc_per_node 2 examples/own_loop.py --tp 2            # tensor parallel (dp = 1)
    torchrun --nproc_per_node 2 examples/own_loop.py --pp 2            # two pipeline stages
    torchrun --nproc_per_node 2 examples/own_loop.py                   # data parallel (dp = 2)
    torchrun --nproc_per_node 2 examples/own_loop.py --resume own-loop-out/checkpoint-2 --output_dir resumed
                                                        # from step 2, at any layout (here dp = 2)

A tiny Qwen2 built from a config trains on random tokens. The global batch of a step depends on the step alone,
so every layout trains on the same tokens; each rank passes its slice of it (``pmodel.local_batch``). The loop
evaluates, saves a sharded checkpoint, resumes from one (at this or another layout), and writes a directory that
transformers' ``from_pretrained`` loads. ``--losses FILE`` writes the global losses as JSON (tests/test_own_loop.py
compares them with a plain one-process loop).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

import plait
from plait.base.device import pick_device
from plait.checkpoint import consolidate, load_checkpoint, save_checkpoint
from plait.optim import OptimizerStep, build_optimizer

ROWS, SEQ = 8, 32  # the global batch: rows x tokens, whatever the layout


def tiny_qwen2() -> Qwen2Config:
    return Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                       tie_word_embeddings=False)


def global_batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch, the same on every rank: input ids, and labels with the first 4 tokens of
    each row masked (-100: no loss there, as a prompt would be)."""
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))
    labels = ids.clone()
    labels[:, :4] = -100
    return ids, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_at", type=int, default=2, help="save a checkpoint after this step")
    parser.add_argument("--resume", help="a checkpoint directory to continue from")
    parser.add_argument("--output_dir", default="own-loop-out")
    parser.add_argument("--losses", help="write the global losses here (JSON)")
    args = parser.parse_args()

    dist.init_process_group()  # torchrun's world: gloo on the CPU, NCCL on GPUs
    device = pick_device("auto")  # this process's accelerator (torchrun's LOCAL_RANK), else the CPU
    torch.manual_seed(0)  # parallelize broadcasts rank 0's weights anyway: the replicas start equal
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(tiny_qwen2())
    config = plait.ParallelConfig(tp=args.tp, pp=args.pp, num_microbatches=2 if args.pp > 1 else 1)
    pmodel = plait.parallelize(model, config)  # dp = world / (tp * pp)
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-2, weight_decay=0.0)  # after parallelize
    optimizer_step = OptimizerStep(pmodel.grad_sync, optimizer, max_grad_norm=1.0)
    out = Path(args.output_dir)
    rank0 = dist.get_rank() == 0

    start = load_checkpoint(args.resume, pmodel, optimizer).step if args.resume else 0
    losses = {}
    for step in range(start + 1, args.steps + 1):
        ids, labels = (t.to(device) for t in global_batch(step, model.config.vocab_size))
        share = pmodel.train_step(pmodel.local_batch(ids), pmodel.local_batch(labels),
                                  num_items_in_batch=plait.num_items_in_batch(labels))  # this rank's share
        loss = pmodel.global_loss(share)  # the whole batch's loss, equal on every rank: all decide alike
        grad_norm = optimizer_step(loss)  # gradient sums, norm, finite check, clipping, step, zero_grad
        losses[step] = loss.item()
        if rank0:
            print(f"step {step} | loss {losses[step]:.4f} | grad_norm {grad_norm.item():.3f}", flush=True)
        if step == args.save_at and step != args.steps:
            save_checkpoint(out / f"checkpoint-{step}", pmodel, optimizer, step=step)

    ids, labels = (t.to(device) for t in global_batch(10_000, model.config.vocab_size))  # a held-out batch
    eval_loss = pmodel.global_loss(pmodel.eval_loss(pmodel.local_batch(ids), pmodel.local_batch(labels),
                                                    num_items_in_batch=plait.num_items_in_batch(labels))).item()
    final = save_checkpoint(out / f"checkpoint-{args.steps}", pmodel, optimizer, step=args.steps)
    if rank0:
        consolidate(final, out / "hf")  # AutoModelForCausalLM.from_pretrained(out / "hf")
        print(f"eval loss {eval_loss:.4f} | checkpoint {final} | transformers dir {out / 'hf'}")
        if args.losses:
            Path(args.losses).write_text(json.dumps({"train": losses, "eval": eval_loss}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
