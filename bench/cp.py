"""Context parallelism on this machine: collectives against each strategy's formula, activation memory per
rank at a long block, and step time beside tp=2 and dp=2.

    python bench/cp.py [--steps 5] [--memory-seq 8192] [--parts comm memory time]

Run it alone (a concurrent job halves the times). Three parts, each a world of gloo ranks:

- comm: one train_step (forward + backward) of a Llama (L layers, 8 query heads, 2 kv heads) at cp=2 per
  strategy, every collective counted (plait.base.comm.count_collectives) against the formula (b sequences, n = S/C
  local tokens, d = head dim, e = 4 bytes, r = C/gcd(kv heads, C) copies of each kv head for all-to-all):
  all-to-all: per layer 4 all-to-alls forward (q: b*Hq*n*d*e, k and v: b*Hkv*r*n*d*e, output: b*Hq*n*d*e) and
  the same 4 backward; ring: per layer 2(C-1) sends forward (k, v: b*Hkv*n*d*e each), backward 2(C-1) of k and
  v plus 2C of their gradients (kept in fp32).
- memory: the bytes autograd saves for backward in one forward of one sequence of --memory-seq tokens (a
  small Llama), per rank, at cp=1, 2 and 4 (both strategies at 2): the activation memory cp divides.
- time: seconds per optimizer step of the same small model at a 2048-token block, global batch 2: one
  process, cp=2 (each strategy), tp=2 with SP and dp=2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import tempfile
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32
LAYOUTS_TIME = {  # name -> (world, ParallelConfig kwargs)
    "1 process": (1, {}),
    "cp=2 all-to-all": (2, dict(cp=2, cp_attention="all-to-all")),
    "cp=2 ring": (2, dict(cp=2, cp_attention="ring")),
    "tp=2 sp": (2, dict(tp=2, sp=True)),
    "dp=2": (2, {}),
}


def model(layers: int, seq: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=HEADS * HEAD_DIM, intermediate_size=4 * HEADS * HEAD_DIM,
                         num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=seq)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config)


def comm_part(out: Path, strategy: str) -> None:
    import torch

    import plait
    from plait.base import comm

    layers, batch, seq = 2, 2, 256
    pmodel = plait.parallelize(model(layers, seq), plait.ParallelConfig(cp=2, cp_attention=strategy))
    ids = torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(0))
    with comm.count_collectives() as counter:
        pmodel.train_step(ids, ids)
    ops: dict[str, list[int]] = {}
    for op, nbytes in counter.records:
        ops.setdefault(op, [0, 0])
        ops[op][0] += 1
        ops[op][1] += nbytes
    write(out, f"comm-{strategy}", {"ops": ops, "layers": layers, "batch": batch, "seq": seq, "cp": 2})


def comm_formula(strategy: str, layers: int, batch: int, seq: int, cp: int) -> dict[str, tuple[int, int]]:
    n, e = seq // cp, 4
    q = batch * HEADS * n * HEAD_DIM * e
    kv = batch * KV_HEADS * n * HEAD_DIM * e
    if strategy == "all-to-all":
        r = cp // math.gcd(KV_HEADS, cp)
        return {"all_to_all": (8 * layers, 2 * layers * (2 * q + 2 * kv * r))}
    sends = layers * (2 * (cp - 1) + 2 * (cp - 1) + 2 * cp)
    return {"send": (sends, layers * (2 * (cp - 1) * kv + 2 * (cp - 1) * kv + 2 * cp * kv))}


def memory_part(out: Path, seq: int, strategy: str | None) -> None:
    import torch
    import torch.distributed as dist

    import plait

    world = dist.get_world_size() if dist.is_initialized() else 1
    config = plait.ParallelConfig(cp=world, cp_attention=strategy or "auto") if world > 1 else plait.ParallelConfig()
    pmodel = plait.parallelize(model(2, seq), config)
    ids = torch.randint(0, 2048, (1, seq), generator=torch.Generator().manual_seed(0))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pmodel(ids, labels=ids)
    loss.backward()
    params = {p.untyped_storage().data_ptr() for p in pmodel.parameters()}
    saved = sum(n for ptr, n in seen.items() if ptr not in params)
    write(out, f"memory-w{world}-{strategy or 'none'}", {"saved_bytes": saved, "seq": seq})


def time_part(out: Path, name: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import plait
    from plait.optim import OptimizerStep, build_optimizer

    world, layout = LAYOUTS_TIME[name]
    batch, seq = 2, 2048
    pmodel = plait.parallelize(model(2, seq), plait.ParallelConfig(**layout))
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4)
    step = OptimizerStep(pmodel.grad_sync, optimizer)
    ids = torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(0))
    mesh = pmodel.mesh
    local = ids.chunk(mesh.dp)[mesh.dp_rank]
    times = []
    for _ in range(steps + 1):  # the first step builds what later steps reuse: not timed
        start = time.perf_counter()
        loss = pmodel.train_step(local, local, num_items_in_batch=batch * (seq - 1))
        step(loss)
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - start)
    write(out, f"time-{name}", {"seconds": sorted(times[1:])[len(times[1:]) // 2]})


def write(out: Path, key: str, value: dict) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        (out / f"{key}.json").write_text(json.dumps(value))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("WORLD_SIZE", "1"))))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    out = Path(args.worker)
    if args.part == "comm":
        comm_part(out, args.what)
    elif args.part == "memory":
        memory_part(out, args.memory_seq, None if args.what == "none" else args.what)
    else:
        time_part(out, args.what, args.steps)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_part(out: Path, world: int, part: str, what: str, args: argparse.Namespace) -> None:
    from plait.testing import launch

    argv = [__file__, "--worker", str(out), "--part", part, "--what", what, "--steps", str(args.steps),
            "--memory-seq", str(args.memory_seq)]
    launch(argv, world, timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--memory-seq", type=int, default=8192)
    parser.add_argument("--parts", nargs="+", default=["comm", "memory", "time"], choices=["comm", "memory", "time"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--what", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    out = Path(tempfile.mkdtemp(prefix="plait-bench-cp-"))
    if "comm" in args.parts:
        print("## Collectives of one train_step (forward and backward) at cp=2; the gradient all-reduce over dp x cp "
              "follows at the optimizer step\n")
        print("| strategy | op | count | formula | bytes | formula |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for strategy in ("all-to-all", "ring"):
            launch_part(out, 2, "comm", strategy, args)
            got = json.loads((out / f"comm-{strategy}.json").read_text())
            expected = comm_formula(strategy, got["layers"], got["batch"], got["seq"], got["cp"])
            for op, (count, nbytes) in sorted(got["ops"].items()):
                want = expected.get(op, ("-", "-"))
                print(f"| {strategy} | {op} | {count} | {want[0]} | {nbytes:,} | "
                      f"{want[1] if isinstance(want[1], str) else f'{want[1]:,}'} |")
        print()
    if "memory" in args.parts:
        print(f"## Saved activations per rank, one sequence of {args.memory_seq} tokens (2-layer Llama, hidden "
              f"{HEADS * HEAD_DIM})\n")
        print("| layout | MiB per rank | vs cp=1 | bound 1/C + 10% |")
        print("| --- | ---: | ---: | ---: |")
        runs = [(1, "none"), (2, "all-to-all"), (2, "ring"), (4, "all-to-all"), (4, "ring")]
        base = None
        for world, strategy in runs:
            launch_part(out, world, "memory", strategy, args)
            saved = json.loads((out / f"memory-w{world}-{strategy}.json").read_text())["saved_bytes"]
            base = base or saved
            label = "cp=1" if world == 1 else f"cp={world} {strategy}"
            print(f"| {label} | {saved / 2**20:.1f} | {saved / base:.3f} | {1 / world + 0.1:.3f} |")
        print()
    if "time" in args.parts:
        print(f"## Seconds per optimizer step, 2-layer Llama, block 2048, global batch 2 (median of {args.steps})\n")
        print("| layout | s/step | vs 1 process |")
        print("| --- | ---: | ---: |")
        base = None
        for name, (world, _) in LAYOUTS_TIME.items():
            launch_part(out, world, "time", name, args)
            seconds = json.loads((out / f"time-{name}.json").read_text())["seconds"]
            base = base or seconds
            print(f"| {name} | {seconds:.3f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
