"""Expert parallelism on this machine: the all-to-all bytes against the formula, expert parameter and optimizer
bytes per rank, and the experts kernel's step time on one process.

    python bench/moe.py [--steps 5] [--parts comm memory kernel time]

Run it alone (a concurrent job halves the times). The model is OLMoE-shaped and scaled down for 2 CPU cores: 4
layers, hidden 256, 16 experts of intermediate 128, top-4 routing, vocab 4096. Parts, each a world of gloo ranks:

- comm: one train_step (forward and backward, 2 sequences of 256 tokens per rank) at ep=2, every collective
  counted (plait.base.comm.count_collectives). Per MoE layer and forward a rank sends its per-expert counts (E int64),
  its T*k (token, expert) rows (dispatch) and the rows it computed for the others (combine); backward sends the
  same two again. Over the ep group: L * (ep * E * 8 + 4 * T_group * k * H * e) bytes, e = 4 (fp32).
- memory: expert and dense parameter bytes and AdamW state bytes per rank (mean over ranks) at dp=4 with ep=1,
  2 and 4, without and with ZeRO-1. Expert parameters per rank must be 1/ep of ep=1's and, without ZeRO-1, their
  state too; dense bytes unchanged.
- kernel: seconds per optimizer step on one process of the same model and batch (4 x 512) with transformers'
  experts implementations: plait keeps the model's (``grouped_mm``, one grouped matrix multiply per
  projection: what an ep rank runs on its received rows), against transformers' ``eager`` loop over experts and
  ``batched_mm`` (weights gathered per row).
- time: seconds per optimizer step at a world of 2, global batch 4 x 512: dp=2 (every rank all experts) and ep=2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

LAYERS, HIDDEN, EXPERTS, INTER, TOP_K, VOCAB = 4, 256, 16, 128, 4, 4096
LAYOUTS_TIME = {"dp=2": {}, "ep=2": dict(ep=2)}


def model(implementation: str = "grouped_mm"):
    import torch
    from transformers import AutoModelForCausalLM, OlmoeConfig

    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=8, num_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    config._experts_implementation = implementation
    return AutoModelForCausalLM.from_config(config)


def comm_part(out: Path) -> None:
    import torch

    import plait
    from plait.base import comm

    batch, seq = 2, 256
    pmodel = plait.parallelize(model(), plait.ParallelConfig(ep=2))
    ids = torch.randint(0, VOCAB, (batch * 2, seq), generator=torch.Generator().manual_seed(0))
    local = ids.chunk(2)[pmodel.mesh.dp_rank]
    with comm.count_collectives() as counter:
        pmodel.train_step(local, local, num_items_in_batch=ids.shape[0] * (seq - 1))
    ops = [n for op, n in counter.records if op == "all_to_all"]
    totals = comm.all_gather_object(ops, comm.world_group())
    write(out, "comm", {"per_rank": [[len(t), sum(t)] for t in totals], "tokens": batch * 2 * seq})


def memory_part(out: Path, what: str) -> None:
    import torch

    import plait
    from plait.base import comm
    from plait.optim import OptimizerStep, build_optimizer

    ep, zero = int(what.split("-")[0]), what.endswith("zero1")
    pmodel = plait.parallelize(model(), plait.ParallelConfig(ep=ep, zero_1=zero))
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4)
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
    pmodel.train_step(ids, ids, num_items_in_batch=4 * 63)
    OptimizerStep(pmodel.grad_sync, optimizer)()
    experts = {id(p) for n, p in pmodel.module.named_parameters() if ".experts." in n}
    sizes = {"expert": 0, "dense": 0, "expert_state": 0, "dense_state": 0}
    for p in pmodel.parameters():
        sizes["expert" if id(p) in experts else "dense"] += p.numel() * p.element_size()
    if hasattr(optimizer, "dense"):
        parts = [optimizer.dense.optim, optimizer.experts]
    else:
        parts = [getattr(optimizer, "optim", optimizer)]
    for part in parts:
        inner = getattr(part, "optim", part)
        for param, state in inner.state.items():
            kind = "expert_state" if id(param) in experts else "dense_state"
            sizes[kind] += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
    every = comm.all_gather_object(sizes, comm.world_group())  # ZeRO-1 partitions whole tensors: ranks differ
    write(out, f"memory-{what}", {key: sum(r[key] for r in every) / len(every) for key in sizes})


def train_seconds(pmodel, batch: int, seq: int, steps: int) -> float:
    import torch
    import torch.distributed as dist

    from plait.optim import OptimizerStep, build_optimizer

    step = OptimizerStep(pmodel.grad_sync, build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4))
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    local = ids.chunk(pmodel.mesh.dp)[pmodel.mesh.dp_rank]
    times = []
    for _ in range(steps + 1):  # the first step builds what later steps reuse: not timed
        start = time.perf_counter()
        step(pmodel.train_step(local, local, num_items_in_batch=batch * (seq - 1)))
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def kernel_part(out: Path, implementation: str, steps: int) -> None:
    import plait

    seconds = train_seconds(plait.parallelize(model(implementation), plait.ParallelConfig()), 4, 512, steps)
    write(out, f"kernel-{implementation}", {"seconds": seconds})


def time_part(out: Path, name: str, steps: int) -> None:
    import plait

    seconds = train_seconds(plait.parallelize(model(), plait.ParallelConfig(**LAYOUTS_TIME[name])), 4, 512, steps)
    write(out, f"time-{name}", {"seconds": seconds})


def write(out: Path, key: str, value: dict) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / f"{key}.json").write_text(json.dumps(value))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("WORLD_SIZE", "1"))))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    out = Path(args.worker)
    if args.part == "comm":
        comm_part(out)
    elif args.part == "memory":
        memory_part(out, args.what)
    elif args.part == "kernel":
        kernel_part(out, args.what, args.steps)
    else:
        time_part(out, args.what, args.steps)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_part(out: Path, world: int, part: str, what: str, args: argparse.Namespace) -> dict:
    from plait.testing import launch

    launch([__file__, "--worker", str(out), "--part", part, "--what", what, "--steps", str(args.steps)], world,
           timeout=1800)
    key = part if part == "comm" else f"{part}-{what}"
    return json.loads((out / f"{key}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--parts", nargs="+", default=["comm", "memory", "kernel", "time"],
                        choices=["comm", "memory", "kernel", "time"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--what", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    out = Path(tempfile.mkdtemp(prefix="plait-bench-moe-"))
    if "comm" in args.parts:
        got = launch_part(out, 2, "comm", "-", args)
        expected = LAYERS * (2 * EXPERTS * 8 + 4 * got["tokens"] * TOP_K * HIDDEN * 4)
        print("## All-to-all of one train_step at ep=2 (forward and backward, 2 x 256 tokens per rank)\n")
        print("| rank | all-to-alls | formula | bytes sent |")
        print("| --- | ---: | ---: | ---: |")
        for rank, (count, nbytes) in enumerate(got["per_rank"]):
            print(f"| {rank} | {count} | {5 * LAYERS} | {nbytes:,} |")
        total = sum(n for _, n in got["per_rank"])
        print(f"| both | | | {total:,} (formula {expected:,}: L * (ep * E * 8 + 4 * T * k * H * 4)) |\n")
    if "memory" in args.parts:
        print("## Bytes per rank at dp=4, mean over the ranks (AdamW state after one step)\n")
        print("| ZeRO-1 | ep | expert params | vs ep=1 | expert state | vs ep=1 | dense params | dense state |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for zero in ("", "-zero1"):
            base = None
            for ep in (1, 2, 4):
                sizes = launch_part(out, 4, "memory", f"{ep}{zero}", args)
                base = base or sizes
                print(f"| {'yes' if zero else 'no'} | {ep} | {sizes['expert']:,.0f} | {sizes['expert'] / base['expert']:.3f} "
                      f"| {sizes['expert_state']:,.0f} | {sizes['expert_state'] / base['expert_state']:.3f} | "
                      f"{sizes['dense']:,.0f} | {sizes['dense_state']:,.0f} |")
        print("\nWithout ZeRO-1 a rank's expert state follows its experts (1/ep); with it, expert state is already 1/dp "
              "of the total at ep=1 and stays so (sharded over dp/ep ranks holding 1/ep of the experts).\n")
    if "kernel" in args.parts:
        print(f"## One process, seconds per optimizer step, batch 4 x 512 (median of {args.steps})\n")
        print("| experts implementation | s/step | grouped_mm speed-up |")
        print("| --- | ---: | ---: |")
        found = {impl: launch_part(out, 1, "kernel", impl, args)["seconds"] for impl in ("grouped_mm", "eager",
                                                                                         "batched_mm")}
        for impl, seconds in found.items():
            print(f"| {impl}{' (plait: the model default)' if impl == 'grouped_mm' else ''} | {seconds:.3f} | "
                  f"{seconds / found['grouped_mm']:.2f}x |")
        print()
    if "time" in args.parts:
        print(f"## World of 2, seconds per optimizer step, global batch 4 x 512 (median of {args.steps})\n")
        print("| layout | s/step |")
        print("| --- | ---: |")
        for name in LAYOUTS_TIME:
            print(f"| {name} | {launch_part(out, 2, 'time', name, args)['seconds']:.3f} |")


if __name__ == "__main__":
    main()
