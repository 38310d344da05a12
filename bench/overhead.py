"""Step time of plait at tp=pp=1 beside a plain transformers training loop on the same model and batch.

    python bench/overhead.py [--rounds 15] [--steps 5]

Both loops run in one process, alternating round by round (A B A B ...) so machine noise hits both
alike; the table gives the median step of each and their ratio (goal: plait / plain <= 1.02).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import plait

B, S = 8, 128


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=S)
    return AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    ns = parser.parse_args()

    plain = model()
    pmodel = plait.parallelize(copy.deepcopy(plain), plait.ParallelConfig())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    plait_opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
    ids = torch.randint(0, 2048, (B, S), generator=torch.Generator().manual_seed(1))
    num_items = B * (S - 1)

    def plain_step():
        plain(input_ids=ids, labels=ids).loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def plait_step():
        pmodel(ids, labels=ids, num_items_in_batch=num_items).backward()
        pmodel.grad_sync.finish()
        plait_opt.step()
        plait_opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"plain transformers": [], "plait tp=pp=1": []}
    for fn in (plain_step, plait_step):  # warm-up
        fn()
    for _ in range(ns.rounds):
        for name, fn in (("plain transformers", plain_step), ("plait tp=pp=1", plait_step)):
            start = time.perf_counter()
            for _ in range(ns.steps):
                fn()
            times[name].append((time.perf_counter() - start) / ns.steps)

    base = statistics.median(times["plain transformers"])
    print(f"Llama h=256 L=4 vocab=2048, batch {B}x{S}, fp32, {torch.get_num_threads()} threads, "
          f"{ns.rounds} alternating rounds of {ns.steps} steps")
    print(f"{'loop':22} {'median step (s)':>16} {'ratio':>7}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:22} {median:16.4f} {median / base:7.3f}")


if __name__ == "__main__":
    main()
