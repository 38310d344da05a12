"""LoRA vs full fine-tuning: gradient and optimizer-state bytes per rank, and step time beside peft.

    python bench/lora.py [--hidden 2048 --layers 4 --vocab 8192 --seq 256 --batch 2 --r 8 --steps 10]
                         [--world 2 --tp 2 | --world 2 --tp 1 --zero_1]

1. Bytes per rank (a world of --world processes laid out as --tp, dp = world / tp, ZeRO-1 with --zero_1): after
   one optimizer step, the bytes of every gradient a rank holds and of its optimizer state (AdamW's exp_avg and
   exp_avg_sq; under ZeRO-1 only its slice), for full fine-tuning and for LoRA on the same Llama. LoRA should
   be well under 1% of full fine-tuning: r (in + out) numbers per adapted projection against in * out.
2. Step time on one process: plait's LoRA layers against peft's ``LoraModel`` on the same model and batch
   (forward, backward, AdamW step), median of --steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 32,
        max_position_embeddings=args.seq))


def lora(args):
    from plait.lora.config import lora_config

    return lora_config(args.r, 2 * args.r)


def step_bytes(pmodel, optimizer) -> tuple[int, int]:
    """(gradient bytes, optimizer-state bytes) this rank holds after a step."""
    inner = getattr(optimizer, "optim", optimizer)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in pmodel.parameters() if p.grad is not None)
    state = sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return grads, state


def bytes_worker(args) -> None:
    """One rank: a step of full fine-tuning, then of LoRA; bytes held right after ``optimizer.step``."""
    import torch.distributed as dist

    from plait import ParallelConfig, parallelize
    from plait.base import comm
    from plait.optim import build_optimizer

    dist.init_process_group("gloo")
    rows = {}
    for name, adapters in (("full", None), ("lora", lora(args))):
        pmodel = parallelize(model(args), ParallelConfig(tp=args.tp, zero_1=args.zero_1), lora=adapters)
        optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        pmodel.train_step(ids, ids.clone())
        grads = step_bytes(pmodel, optimizer)[0]  # before the step: ZeRO-1 frees non-owned gradients in it
        pmodel.grad_sync.finish()
        optimizer.step()
        rows[name] = (grads, step_bytes(pmodel, optimizer)[1])
    every = comm.all_gather_object(rows, comm.world_group())
    if dist.get_rank() == 0:
        Path(args.bytes_out).write_text(json.dumps(every))
    dist.destroy_process_group()


def step_times(args) -> dict[str, float]:
    """Median seconds per step on one process: plait LoRA and peft LoRA, same model and batch."""
    from peft import get_peft_model

    from plait import ParallelConfig, parallelize

    base, ids = model(args), torch.randint(0, args.vocab, (args.batch, args.seq))
    pmodel = parallelize(copy.deepcopy(base), ParallelConfig(), lora=lora(args))
    peft_model = get_peft_model(copy.deepcopy(base), copy.deepcopy(pmodel.plan.lora.config))
    runs = {
        "plait": (lambda: pmodel.train_step(ids, ids.clone()), [p for p in pmodel.parameters() if p.requires_grad]),
        "peft": (lambda: peft_model(input_ids=ids, labels=ids).loss.backward(),
                 [p for p in peft_model.parameters() if p.requires_grad]),
    }
    times = {}
    for name, (forward_backward, params) in runs.items():
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        samples = []
        for i in range(args.steps + 1):
            start = time.perf_counter()
            forward_backward()
            optimizer.step()
            optimizer.zero_grad()
            if i:  # the first step allocates optimizer state
                samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--zero_1", action="store_true")
    parser.add_argument("--bytes_out", default=None, help=argparse.SUPPRESS)  # set for the launched ranks
    args = parser.parse_args()
    if args.bytes_out is not None:
        bytes_worker(args)
        return
    from plait.testing import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bytes.json"
        launch([__file__, *sys.argv[1:], "--bytes_out", str(out)], args.world, timeout=3600)
        ranks = json.loads(out.read_text())
    print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, LoRA r={args.r} on every "
          f"projection; world={args.world} tp={args.tp} zero_1={args.zero_1}")
    print(f"{'rank':>4} {'grad MB full':>13} {'grad MB LoRA':>13} {'LoRA/full':>10} "
          f"{'optim MB full':>14} {'optim MB LoRA':>14} {'LoRA/full':>10}")
    for rank, rows in enumerate(ranks):
        (gf, of), (gl, ol) = rows["full"], rows["lora"]
        print(f"{rank:>4} {gf / 1e6:>13.2f} {gl / 1e6:>13.3f} {gl / gf:>10.3%} {of / 1e6:>14.2f} {ol / 1e6:>14.3f} "
              f"{ol / of:>10.3%}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    times = step_times(args)
    print(f"step time on one process (batch {args.batch} x {args.seq}, median of {args.steps}): "
          f"plait {times['plait'] * 1e3:.1f} ms, peft {times['peft'] * 1e3:.1f} ms "
          f"(plait/peft {times['plait'] / times['peft']:.2f})")


if __name__ == "__main__":
    main()
