"""Bytes per rank of parameters, gradients and optimizer state for tp x pp x dp layouts at ZeRO stages 0-3,
each checked against the ZeRO paper's formula; the peak resident memory per rank of each stage through plait's
trainer; the step time of stage 3 over stage 1; and peak RSS of one step with activation checkpointing on vs off.

    python bench/memory.py

Everything is measured on the real tensors of each rank (sum of numel * element_size): parameters and optimizer
state after one optimizer step, gradients as that step meets them. They are compared with Rajbhandari et al. 2020,
per parameter held by the rank (psi): mixed-precision Adam keeps 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32
master, exp_avg, exp_avg_sq) bytes, ZeRO-1 2 + 2 + 12/dp; in fp32, 4 + 4 + 8 (8/dp). "bf16" rows keep bf16
gradients as the paper does (main_grads=False); plait's default accumulates them in fp32 ``main_grad`` buffers
instead (4 bytes per parameter: the "bf16+fp32acc" rows' gradients). The "ok" column checks all three against the
formula: exactly, up to AdamW's 4-byte step count per tensor, one parameter's state (ZeRO-1 partitions whole
parameters) and one row per tensor (ZeRO-2/3 split each tensor's rows over dp); else it names what is off.

ZeRO-2/3 run on FSDP2 (plait.parallel.fsdp): between steps each rank stores its rows of every parameter, gradient and AdamW
state, so fp32 stages 2 and 3 both hold 16 psi/dp (stage 3: 4/dp + 4/dp + 8/dp); with --bf16 the shards are the fp32
masters, also 16 psi/dp, and layers compute on bf16 gathered copies. Stage 2 differs from stage 3 during the step:
it keeps every layer gathered from its forward to the end of the step (+4 psi in fp32, +2 psi in bf16), where
DeepSpeed's ZeRO-2 (4 psi + 12 psi/dp) keeps the full parameters as its only copy; FSDP2 keeps the shard beside the
gathered copy (docs/decisions.md). The table shows what is stored between steps; the peak-RSS table what each stage
holds at its peak (at dp=2 FSDP2's stage 2 reaches the paper's 10 psi there: 4/2 + 4 + 8/2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

# (tp, pp, dp) per launched world; a pipeline layout is one more tuple here, e.g. (1, 2, 2).
LAYOUTS = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 1), (2, 1, 2), (2, 1, 4)]
H, L, VOCAB, FFN, HEADS = 256, 4, 2048, 768, 8
RSS_BATCH, RSS_SEQ, RSS_LAYERS = 8, 512, 8
TIME_BATCH, TIME_SEQ, TIME_STEPS = 4, 256, 6
# the peak-RSS table: a 51M-parameter Llama (fp32 AdamW), one 32-token sequence per rank: the model's bytes dominate
PEAK_MODEL = dict(vocab_size=8192, hidden_size=640, intermediate_size=1792, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=64)
PEAK_STEPS = 3
MIB = 1024 * 1024


def model_config(layers: int = L):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=layers,
                       num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=RSS_SEQ)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer) -> int:
    """Every tensor the optimizer keeps for this rank: its state and, with master weights, the masters."""
    import torch

    from plait.optim import MasterWeightOptimizer, Zero1Optimizer

    local = optimizer.optim if isinstance(optimizer, Zero1Optimizer) else optimizer
    state = [v for s in local.state.values() for v in s.values() if torch.is_tensor(v)]
    masters = local.masters if isinstance(local, MasterWeightOptimizer) else []
    return tensor_bytes(state) + tensor_bytes(masters)


def layout_worker(out: Path, tp: int, pp: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from plait import ParallelConfig, parallelize
    from plait.optim import OptimizerStep, build_optimizer
    from plait.parallel.grad_sync import MAIN_GRAD, grad_of

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from plait.parallel.fsdp import local

    rows = []
    for precision in ("fp32", "bf16", "bf16+fp32acc"):
        for stage in (0, 1, 2, 3):
            if stage >= 2 and (world // (tp * pp) == 1 or precision == "bf16"):
                continue  # no dp ranks to shard over; FSDP2's bf16 always keeps fp32 shards (the fp32acc row)
            torch.manual_seed(0)
            model = LlamaForCausalLM(model_config())
            if precision != "fp32" and stage < 2:
                model.to(torch.bfloat16)
            pmodel = parallelize(model, ParallelConfig(tp=tp, pp=pp, zero_stage=stage,
                                                       mixed_precision=precision != "fp32" and stage >= 2))
            optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3,
                                        optimizer_dtype=torch.float32 if precision != "fp32" else None,
                                        main_grads=precision == "bf16+fp32acc")
            params = list(pmodel.parameters())
            ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
            pmodel(ids, labels=ids).backward()
            seen = {}
            step = optimizer.step

            def counted_step(*args, **kwargs):  # the gradients as the optimizer meets them (reduced, sharded)
                seen["grads"] = tensor_bytes(local(g) for g in (p.grad for p in params) if g is not None)
                seen["main"] = tensor_bytes(grad_of(p) for p in params if hasattr(p, MAIN_GRAD))
                return step(*args, **kwargs)

            optimizer.step = counted_step
            OptimizerStep(pmodel.grad_sync, optimizer)()
            mine = {"params": tensor_bytes(local(p) for p in params), "grads": seen["grads"],
                    "fp32_acc": seen["main"], "state": optimizer_state_bytes(optimizer),
                    "psi": sum(p.numel() for p in params), "largest": max(p.numel() for p in params),
                    "tensors": len(params), "row_elements": sum(p.numel() // p.shape[0] if p.dim() else 1
                                                                for p in params)}
            everyone = [None] * world
            if world > 1:
                dist.all_gather_object(everyone, mine)
            else:
                everyone = [mine]
            rows.append({"precision": precision, "stage": stage, "ranks": everyone})
    if world == 1 or dist.get_rank() == 0:
        out.write_text(json.dumps(rows))


def time_worker(out: Path) -> None:
    """dp=2: median seconds per step at ZeRO stages 1 and 3, built together and timed in turns (round-robin), so
    a slow spell of the machine hits both."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from plait import ParallelConfig, parallelize
    from plait.optim import OptimizerStep, build_optimizer

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    runs = {}
    for stage in (1, 3):
        torch.manual_seed(0)
        pmodel = parallelize(LlamaForCausalLM(model_config(RSS_LAYERS)), ParallelConfig(zero_stage=stage))
        step = OptimizerStep(pmodel.grad_sync, build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4), 1.0)
        runs[stage] = (pmodel, step, [])
    ids = torch.randint(0, VOCAB, (TIME_BATCH, TIME_SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    for i in range(TIME_STEPS + 1):
        for stage, (pmodel, step, seconds) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            pmodel.train_step(ids, ids, num_items_in_batch=ids.numel() * 2)
            step()
            if i:  # the first step allocates the optimizer state
                seconds.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({stage: statistics.median(r[2]) for stage, r in runs.items()}))


def resident(field: str) -> int:
    """VmRSS, or VmHWM (the resident set's high-water mark since the last reset), of this process in bytes."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":")) * 1024


def stage_worker(out: Path, config: str, output_dir: str, stage: int) -> None:
    """One rank of a ``plait train`` run (``Trainer``) at ``stage``: its peak resident memory after each step, the
    high-water mark reset once the trainer is built (what ``peak_rss_mb`` reports, without the build)."""
    import gc

    import torch.distributed as dist

    from plait.base import comm
    from plait.run.train_args import TrainArgs
    from plait.run.trainer import Trainer

    trainer = Trainer(TrainArgs(model_config=config, output_dir=output_dir, max_steps=PEAK_STEPS, zero_stage=stage,
                                per_device_train_batch_size=1, block_size=32, save_steps=0, save_final=False))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = resident("VmRSS")
    peaks = []
    for step in range(PEAK_STEPS):
        trainer.step(step)
        peaks.append(resident("VmHWM"))
    psi = sum(p.numel() for p in trainer.pmodel.parameters())
    trainer.heartbeat.close()
    ranks = comm.all_gather_object({"base": base, "peaks": peaks, "psi": psi}, comm.world_group())
    if dist.get_rank() == 0:
        out.write_text(json.dumps(ranks))


def peak_rss_table(tmp: Path) -> None:
    """Each rank's peak resident memory per step at ZeRO stages 1-3 (dp=2, fp32 AdamW), one world per stage (a peak
    is its process's), beside the formula's bytes at each stage's peak."""
    from transformers import LlamaConfig

    from plait.testing import launch

    dp = 2
    config = tmp / "peak_model.json"
    config.write_text(LlamaConfig(**PEAK_MODEL).to_json_string())
    # bytes per parameter at the stage's peak: ZeRO-1 parameters + whole gradients + state/dp; FSDP2's stage 2 its
    # shards + the gathered layers + state/dp (the gradients grow as layers are freed); stage 3 all over dp
    at_peak = {1: 4 + 4 + 8 / dp, 2: 4 / dp + 4 + 8 / dp, 3: 16 / dp}
    print(f"Peak resident memory per rank, plait's trainer on the CPU, dp={dp}, fp32 AdamW, Llama "
          f"h={PEAK_MODEL['hidden_size']} L={PEAK_MODEL['num_hidden_layers']} ffn={PEAK_MODEL['intermediate_size']} "
          f"vocab={PEAK_MODEL['vocab_size']}, 1 x 32 tokens per rank, {PEAK_STEPS} steps (MiB)")
    print(f"{'zero':>4} {'bytes/param':>11} {'formula':>8} {'vs zero 1':>9} {'rank':>4} {'after build':>11} "
          f"{'peak per step':>22} {'peak':>6} {'vs zero 1':>9}")
    first: dict[int, int] = {}
    for stage in (1, 2, 3):
        out = tmp / f"peak_zero{stage}.json"
        launch([__file__, "--stage-worker", str(out), str(config), str(tmp / f"peak_run{stage}"), str(stage)], dp,
               timeout=600)
        for rank, r in enumerate(json.loads(out.read_text())):
            psi, peak = r["psi"], max(r["peaks"])
            first.setdefault(rank, peak)
            print(f"{stage:4d} {at_peak[stage]:11.1f} {psi * at_peak[stage] / MIB:8.1f} "
                  f"{psi * (at_peak[stage] - at_peak[1]) / MIB:9.1f} {rank:4d} {r['base'] / MIB:11.1f} "
                  f"{' '.join(f'{p / MIB:6.0f}' for p in r['peaks']):>22} {peak / MIB:6.0f} "
                  f"{(peak - first[rank]) / MIB:9.0f}")


def rss_worker(checkpointing: bool) -> None:
    """One process: peak RSS of a training step (forward + backward) over the RSS before it."""
    import psutil
    import torch
    from transformers import LlamaForCausalLM

    from plait import ParallelConfig, parallelize

    torch.manual_seed(0)
    config = ParallelConfig(gradient_checkpointing=checkpointing)
    pmodel = parallelize(LlamaForCausalLM(model_config(RSS_LAYERS)), config)
    ids = torch.randint(0, VOCAB, (RSS_BATCH, RSS_SEQ), generator=torch.Generator().manual_seed(1))
    before = psutil.Process().memory_info().rss
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pmodel(ids, labels=ids).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"before": before, "peak_before": peak_before, "peak": peak}))


def formula(precision: str, stage: int, dp: int) -> tuple[float, float, float]:
    """Bytes per parameter a rank holds: (params, grads, optimizer state). Stages 0-1: the ZeRO paper's (mixed
    precision: bf16 params and grads, fp32 master + moments; "bf16+fp32acc": fp32 gradient buffers instead of bf16
    gradients); stages 2-3 on FSDP2: fp32 shards of parameters and gradients, fp32 moments, all over dp (under --bf16
    the fp32 shards are the masters)."""
    if stage >= 2:
        return 4 / dp, 4 / dp, 8 / dp
    shard = dp if stage == 1 else 1
    if precision == "fp32":
        return 4, 4, 8 / shard
    return 2, 4 if precision == "bf16+fp32acc" else 2, 12 / shard


def misses(precision: str, stage: int, dp: int, rank: dict) -> list[str]:
    """What of one rank's bytes is off the formula: none where parameters, gradients (with fp32 buffers) and state
    are the formula's to within AdamW's step count per tensor, one parameter's state (ZeRO-1 partitions whole
    parameters) and one row per tensor (ZeRO-2/3: torch.chunk of each tensor's rows over dp)."""
    fp, fg, fs = formula(precision, stage, dp)
    psi = rank["psi"]
    rows = 4 * rank["row_elements"] if stage >= 2 else 0
    whole = rank["largest"] * fs * dp if stage == 1 else 0
    allowed = {"params": (psi * fp, rows), "grads": (psi * fg, rows),
               "state": (psi * fs, 4 * rank["tensors"] + whole + 2 * rows)}
    held = {"params": rank["params"], "grads": rank["grads"] + rank["fp32_acc"], "state": rank["state"]}
    return [name for name, (want, slack) in allowed.items() if abs(held[name] - want) > slack]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--rss-worker", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--time-worker", help=argparse.SUPPRESS)
    parser.add_argument("--stage-worker", nargs=4, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.stage_worker:
        out, config, output_dir, stage = ns.stage_worker
        stage_worker(Path(out), config, output_dir, int(stage))
        return
    if ns.time_worker:
        time_worker(Path(ns.time_worker))
        return
    if ns.layout_worker:
        out, tp, pp = ns.layout_worker
        layout_worker(Path(out), int(tp), int(pp))
        return
    if ns.rss_worker:
        rss_worker(ns.rss_worker == "on")
        return
    from plait.testing import launch

    tmp = Path(tempfile.mkdtemp(prefix="memory-"))
    print(f"Llama h={H} L={L} ffn={FFN} vocab={VOCAB} (untied), AdamW; bytes per rank: parameters and state after "
          f"one optimizer step, gradients as it meets them (bf16+fp32acc: the fp32 buffers)")
    print("ranks: max over the world (params, grads) / max and min (optimizer state); formula = psi * bytes/param; "
          "ok: every rank's three within the formula's rounding (else what is off)")
    header = (f"{'tp':>2} {'pp':>2} {'dp':>2} {'zero':>5} {'precision':>13} {'psi':>9} {'params MiB':>10} "
              f"{'formula':>8} {'grads MiB':>9} {'formula':>8} {'state MiB max/min':>17} {'formula':>8} "
              f"{'state/unsharded':>15} {'ok':>12}")
    print(header)
    for tp, pp, dp in LAYOUTS:
        out = tmp / f"tp{tp}_pp{pp}_dp{dp}.json"
        launch([__file__, "--layout-worker", str(out), str(tp), str(pp)], tp * pp * dp, timeout=600)
        rows = json.loads(out.read_text())
        unsharded = {r["precision"]: max(x["state"] for x in r["ranks"]) for r in rows if r["stage"] == 0}
        for r in rows:
            ranks = r["ranks"]
            psi = max(x["psi"] for x in ranks)
            fp, fg, fs = formula(r["precision"], r["stage"], dp)
            state_max, state_min = max(x["state"] for x in ranks), min(x["state"] for x in ranks)
            off = sorted({name for x in ranks for name in misses(r["precision"], r["stage"], dp, x)})
            ok = "ok" if not off else "MISS " + ",".join(off)
            print(f"{tp:2d} {pp:2d} {dp:2d} {r['stage']:>5} {r['precision']:>13} {psi:9,d} "
                  f"{max(x['params'] for x in ranks) / MIB:10.2f} {psi * fp / MIB:8.2f} "
                  f"{max(x['grads'] + x['fp32_acc'] for x in ranks) / MIB:9.2f} {psi * fg / MIB:8.2f} "
                  f"{state_max / MIB:8.2f}/{state_min / MIB:<8.2f} {psi * fs / MIB:8.2f} "
                  f"{state_max / unsharded[r['precision']]:15.3f} {ok:>12}")
    print()
    peak_rss_table(tmp)
    print()
    out = tmp / "time.json"
    launch([__file__, "--time-worker", str(out)], 2, timeout=600)
    median = json.loads(out.read_text())
    print(f"Step time at dp=2 (gloo), Llama h={H} L={RSS_LAYERS}, batch {TIME_BATCH} x {TIME_SEQ} per rank, median of "
          f"{TIME_STEPS} steps timed in turns: ZeRO-1 {median['1'] * 1e3:.0f} ms, ZeRO-3 {median['3'] * 1e3:.0f} ms, "
          f"stage 3 / stage 1 = {median['3'] / median['1']:.2f}")
    print()
    print(f"Activation checkpointing, one process, Llama h={H} L={RSS_LAYERS}, batch {RSS_BATCH} x {RSS_SEQ} "
          f"tokens, fp32, one forward + backward")
    print(f"{'checkpointing':>13} {'RSS before MiB':>14} {'peak RSS MiB':>12} {'step peak - before MiB':>22}")
    peaks = {}
    for mode in ("off", "on"):
        result = subprocess.run([sys.executable, __file__, "--rss-worker", mode], capture_output=True, text=True,
                                check=True, env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=600)
        r = json.loads(result.stdout.strip().splitlines()[-1])
        assert r["peak"] > r["peak_before"], f"the step did not set the peak RSS ({r}); use a larger batch"
        peaks[mode] = r["peak"] - r["before"]
        print(f"{mode:>13} {r['before'] / MIB:14.1f} {r['peak'] / MIB:12.1f} {peaks[mode] / MIB:22.1f}")
    print(f"step memory with / without checkpointing: {peaks['on'] / peaks['off']:.3f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
    main()
