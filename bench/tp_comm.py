"""Count every collective of one training step at tp=2 (with and without SP) against Megatron's formula,
and time a step at tp=2 beside tp=1.

    python bench/tp_comm.py [--steps 10] [--model llama|phi3|mixtral|all]

Formula (b = batch, s = sequence, h = hidden, L = layers, N = b*s scored tokens: labels are shifted and padded, the
last one's ignored label included, p = tp):
- without SP, per layer: 2 all-reduces of b*s*h forward (attention and MLP outputs) and 2 backward (their
  inputs); plus the vocab-parallel embedding's forward all-reduce, the LM head input's backward
  all-reduce, and the vocab-parallel cross-entropy's 3 all-reduces of N floats;
- with SP, every layer all-reduce becomes an all-gather + reduce-scatter pair of the same tensor (the same
  ring bytes), and backward gathers each region's input again from the sequence shard its column linears saved
  (Korthikanti et al.: activations fall tp-fold for one more all-gather per region); the SP region adds the split at the first layer (all-gather backward) and the gather after the
  final norm (reduce-scatter backward) in place of the head's all-reduce, plus one all-reduce of the norm
  weight gradients ((2L+1)*h floats). plait keeps the embedding's forward all-reduce under SP (transformers
  builds the mask and rotary tables from the full-length embedding output, docs/decisions.md D2), where
  Megatron-SP reduce-scatters: (p-1)/p*b*s*h more ring bytes, once per step.
Ring bytes per rank: all-reduce 2(p-1)/p*n, all-gather (p-1)*n_local, reduce-scatter (p-1)/p*n_input.

Phi3 (fused qkv_proj and gate_up_proj, which transformers' own plan gathers) must count exactly as Llama: each
rank keeps whole heads of q, k, v and matching halves of gate/up, so nothing is gathered inside a layer.
Mixtral (MoE, experts split over tp on their intermediate dimension, router replicated) replaces the MLP's
pair by the experts region, Megatron's all-gather token dispatcher with expert tensor parallelism (T = b*s
tokens, k experts per token, E experts): without SP the output's forward all-reduce and, backward, the
all-reduces of the tokens' and the routing weights' gradients (T*h and T*k floats); with SP, forward
all-gathers of the tokens, the expert indices (int64) and the routing weights, and a reduce-scatter of the
output; backward the mirror images (reduce-scatter of the tokens' and weights' gradients, all-gather of the
output's). The router's weight gradient joins the SP norm-gradient all-reduce (L*E*h floats).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

B, S, H, L, VOCAB, FFN = 4, 128, 256, 4, 2048, 768
EXPERTS, TOP_K = 4, 2
MODELS = ("llama", "phi3", "mixtral")


def model_config(name: str):
    from transformers import LlamaConfig, MixtralConfig, Phi3Config

    common = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=L,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=S)
    if name == "phi3":
        return Phi3Config(**common, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "mixtral":
        return MixtralConfig(**common, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    return LlamaConfig(**common)


def worker(out_dir: Path, steps: int, name: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import plait
    from plait.base.comm import count_collectives

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        torch.set_num_threads(2)  # one process may use both cores; tp=2 runs two 1-thread processes
    results = {}
    for sp in ([True, False] if world > 1 else [False]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config(name))
        pmodel = plait.parallelize(model, plait.ParallelConfig(tp=world, sp=sp))
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))

        def step():
            loss = pmodel(ids, labels=ids)
            loss.backward()
            pmodel.grad_sync.finish()
            opt.step()
            opt.zero_grad()

        with count_collectives() as counter:
            step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        results["sp" if sp else "nosp"] = {"records": counter.records, "step_s": sorted(times)[len(times) // 2]}
    rank = dist.get_rank() if world > 1 else 0
    (out_dir / f"{name}_w{world}_rank{rank}.json").write_text(json.dumps(results))


def formula(sp: bool, p: int, name: str = "llama") -> dict[str, tuple[int, int]]:
    """op -> (count, bytes into the collective per rank), fp32 (expert indices int64)."""
    act, act_local, n_tok = B * S * H * 4, B * S * H * 4 // p, B * S * 4  # every token scored (tp.loss.shift_labels)
    moe = name == "mixtral"
    weights, weights_local, index_local = B * S * TOP_K * 4, B * S * TOP_K * 4 // p, B * S * TOP_K * 8 // p
    if not sp:
        count, size = 4 * L + 2 + 3, (4 * L + 2) * act + 3 * n_tok
        return {"all_reduce": (count + L, size + L * weights) if moe else (count, size)}
    # per layer and region: the forward gather, the backward all-gather after the output's reduce-scatter, and the
    # backward gather again of the sequence shard the column linears saved (Megatron's SP); the experts region of
    # a MoE model has no column linears: its own collectives below
    regions = L if moe else 2 * L
    gathers = (4 * L + 2 + regions, (4 * L + 2 + regions) * act_local)
    scatters = (4 * L + 1, (4 * L + 1) * act)
    reduces = (1 + 3 + 1, act + 3 * n_tok + (2 * L + 1) * H * 4)
    if moe:
        gathers = (gathers[0] + 2 * L, gathers[1] + L * (index_local + weights_local))
        scatters = (scatters[0] + L, scatters[1] + L * weights)
        reduces = (reduces[0], reduces[1] + L * EXPERTS * H * 4)
    return {"all_gather": gathers, "reduce_scatter": scatters, "all_reduce": reduces}


def ring_bytes(op: str, n: int, p: int) -> float:
    return {"all_reduce": 2 * (p - 1) / p * n, "all_gather": (p - 1) * n, "reduce_scatter": (p - 1) / p * n}[op]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", choices=(*MODELS, "all"), default="all")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(Path(ns.worker), ns.steps, ns.model)
        return
    from plait.testing import launch

    out = Path(tempfile.mkdtemp(prefix="tp_comm-"))
    mismatches = 0
    for name in MODELS if ns.model == "all" else (ns.model,):
        for world in (1, 2):
            launch([__file__, "--worker", str(out), "--steps", str(ns.steps), "--model", name], world, timeout=600)
        mismatches += report(out, name)
    if mismatches:
        raise SystemExit(f"{mismatches} collective counts differ from the formula")


def report(out: Path, name: str) -> int:
    """Print the counts of ``name`` beside the formula and the step times; the number of mismatches."""
    single = json.loads((out / f"{name}_w1_rank0.json").read_text())
    ranks = [json.loads((out / f"{name}_w2_rank{r}.json").read_text()) for r in range(2)]
    p, mismatches = 2, 0
    print(f"{name} b={B} s={S} h={H} L={L} vocab={VOCAB}, fp32, gloo, tp={p}; one training step on rank 0")
    print(f"{'mode':6} {'op':15} {'count':>6} {'formula':>8} {'bytes':>12} {'formula':>12} {'ring bytes':>12}")
    ring_total = {}
    for mode in ("nosp", "sp"):
        records = ranks[0][mode]["records"]
        expected = formula(mode == "sp", p, name)
        ring_total[mode] = 0.0
        for op in sorted({o for o, _ in records} | set(expected)):
            count = sum(1 for o, _ in records if o == op)
            size = sum(n for o, n in records if o == op)
            ring = sum(ring_bytes(o, n, p) for o, n in records if o == op)
            ring_total[mode] += ring
            f_count, f_bytes = expected.get(op, (0, 0))
            mismatches += (count, size) != (f_count, f_bytes)
            mark = "" if (count, size) == (f_count, f_bytes) else "  MISMATCH"
            print(f"{mode:6} {op:15} {count:6d} {f_count:8d} {size:12,d} {f_bytes:12,d} {ring:12,.0f}{mark}")
        print(f"{mode:6} {'total ring':15} {'':6} {'':8} {'':12} {'':12} {ring_total[mode]:12,.0f}")
    print(f"SP / no-SP ring bytes: {ring_total['sp'] / ring_total['nosp']:.3f}")
    print()
    t1 = single["nosp"]["step_s"]
    print(f"{'layout':24} {'median step (s)':>16} {'vs tp=1':>8}")
    print(f"{'tp=1 (1 proc, 2 threads)':24} {t1:16.4f} {1.0:8.2f}")
    for mode in ("nosp", "sp"):
        t = max(r[mode]["step_s"] for r in ranks)
        print(f"{'tp=2 ' + mode:24} {t:16.4f} {t / t1:8.2f}")
    print()
    return mismatches


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
    main()
