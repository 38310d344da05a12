"""Bytes per rank of parameters, gradients and optimizer state for tp x pp x dp layouts with and without
ZeRO-1, beside the ZeRO paper's formula; and peak RSS of one step with activation checkpointing on vs off.

    python bench/memory.py

Everything is measured on the real tensors of each rank after one optimizer step (sum of numel *
element_size), then compared with Rajbhandari et al. 2020, per parameter held by the rank (psi):
mixed-precision Adam keeps 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master, exp_avg, exp_avg_sq)
bytes, ZeRO-1 2 + 2 + 12/dp; in fp32, 4 + 4 + 8 (8/dp). "bf16" rows keep bf16 gradients as the paper
does (main_grads=False); plait's default also accumulates them in fp32 ``main_grad`` buffers
(+4 bytes per parameter, the "fp32 acc" column). The goal checked in the last column: optimizer state per
rank = 1/dp of the unsharded state, to within one parameter's state.
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
    from plait.grad_sync import MAIN_GRAD, grad_of
    from plait.optim import OptimizerStep, build_optimizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rows = []
    for precision in ("fp32", "bf16", "bf16+fp32acc"):
        for zero_1 in (False, True):
            torch.manual_seed(0)
            model = LlamaForCausalLM(model_config())
            if precision != "fp32":
                model.to(torch.bfloat16)
            pmodel = parallelize(model, ParallelConfig(tp=tp, pp=pp, zero_1=zero_1))
            optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3,
                                        optimizer_dtype=torch.float32 if precision != "fp32" else None,
                                        main_grads=precision == "bf16+fp32acc")
            params = list(pmodel.parameters())
            ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
            pmodel(ids, labels=ids).backward()
            grads = tensor_bytes(g for g in (p.grad for p in params) if g is not None)
            main = tensor_bytes(grad_of(p) for p in params if hasattr(p, MAIN_GRAD))
            OptimizerStep(pmodel.grad_sync, optimizer)()
            mine = {"params": tensor_bytes(params), "grads": grads, "fp32_acc": main,
                    "state": optimizer_state_bytes(optimizer), "psi": sum(p.numel() for p in params),
                    "largest": max(p.numel() for p in params)}
            everyone = [None] * world
            if world > 1:
                dist.all_gather_object(everyone, mine)
            else:
                everyone = [mine]
            rows.append({"precision": precision, "zero_1": zero_1, "ranks": everyone})
    if world == 1 or dist.get_rank() == 0:
        out.write_text(json.dumps(rows))


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


def formula(precision: str, zero_1: bool, dp: int) -> tuple[int, int, float]:
    """ZeRO paper bytes per parameter: (params, grads, optimizer state)."""
    shard = dp if zero_1 else 1
    if precision == "fp32":
        return 4, 4, 8 / shard
    return 2, 2, 12 / shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--rss-worker", choices=("on", "off"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.layout_worker:
        out, tp, pp = ns.layout_worker
        layout_worker(Path(out), int(tp), int(pp))
        return
    if ns.rss_worker:
        rss_worker(ns.rss_worker == "on")
        return
    from plait.testing import launch

    tmp = Path(tempfile.mkdtemp(prefix="memory-"))
    print(f"Llama h={H} L={L} ffn={FFN} vocab={VOCAB} (untied), AdamW; bytes per rank after one optimizer step")
    print("ranks: max over the world (params, grads) / max and min (optimizer state); formula = psi * bytes/param")
    header = (f"{'tp':>2} {'pp':>2} {'dp':>2} {'zero1':>5} {'precision':>13} {'psi':>9} {'params MiB':>10} "
              f"{'formula':>8} {'grads MiB':>9} {'formula':>8} {'fp32 acc':>8} {'state MiB max/min':>17} "
              f"{'formula':>8} {'state/unsharded':>15} {'goal':>5}")
    print(header)
    for tp, pp, dp in LAYOUTS:
        out = tmp / f"tp{tp}_pp{pp}_dp{dp}.json"
        launch([__file__, "--layout-worker", str(out), str(tp), str(pp)], tp * pp * dp, timeout=600)
        rows = json.loads(out.read_text())
        unsharded = {r["precision"]: max(x["state"] for x in r["ranks"]) for r in rows if not r["zero_1"]}
        for r in rows:
            ranks = r["ranks"]
            psi = max(x["psi"] for x in ranks)
            fp, fg, fs = formula(r["precision"], r["zero_1"], dp)
            state_max, state_min = max(x["state"] for x in ranks), min(x["state"] for x in ranks)
            target = unsharded[r["precision"]] / (dp if r["zero_1"] else 1)
            one_param = max(x["largest"] for x in ranks) * (12 if r["precision"] != "fp32" else 8)
            ok = "ok" if state_max - target <= one_param else "MISS"
            print(f"{tp:2d} {pp:2d} {dp:2d} {str(r['zero_1']):>5} {r['precision']:>13} {psi:9,d} "
                  f"{max(x['params'] for x in ranks) / MIB:10.2f} {psi * fp / MIB:8.2f} "
                  f"{max(x['grads'] for x in ranks) / MIB:9.2f} {psi * fg / MIB:8.2f} "
                  f"{max(x['fp32_acc'] for x in ranks) / MIB:8.2f} "
                  f"{state_max / MIB:8.2f}/{state_min / MIB:<8.2f} {psi * fs / MIB:8.2f} "
                  f"{state_max / unsharded[r['precision']]:15.3f} {ok:>5}")
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
