"""Generation speed: ``ParallelModel.generate`` against transformers' ``generate`` on one process.

    python bench/generate.py [--batch 8] [--prompt 32] [--new 32] [--rounds 3]

A 125M-parameter Llama (16 layers of width 768, 12 heads and 4 kv heads, MLP 2048, a 32,000-token vocabulary, tied
head: a 135M-class model whose heads tp=2 divides, which SmolLM-135M's 9 do not; random weights, fp32) decodes the
same batch of random prompts greedily to exactly ``--new`` tokens (no EOS), three ways: transformers' ``generate`` on
one process and ``ParallelModel.generate`` on the same model parallelized on one process (tp=1), in alternating
order, and ``ParallelModel.generate`` at tp=2 and at pp=2 on two processes (worlds launched by plait.testing.launch,
one OpenMP thread each, where one process uses the machine's threads). Prints new tokens per second, the median of
``--rounds`` (after a warm-up round), and each against transformers. Under pp the prompts go through the stages in
micro-batches (plait.generation.pipelined), which pays where a forward's work grows with its rows: try ``--batch 32``.
Run it alone: the ways compete for the cores otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
             num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True)

# the worlds of two processes: tp (each rank half of every layer's heads) and pp (each rank half of the layers)
LAYOUTS = {"tp=2": dict(tp=2, sp=False), "pp=2": dict(pp=2, num_microbatches=2)}
WORKER = """
import json, statistics, sys, time
import torch, torch.distributed as dist
from transformers import LlamaForCausalLM
import plait
dist.init_process_group("gloo")
model_dir, batch, prompt, new, rounds, out, layout = sys.argv[1], *map(int, sys.argv[2:6]), *sys.argv[6:8]
pmodel = plait.parallelize(LlamaForCausalLM.from_pretrained(model_dir), plait.ParallelConfig(**json.loads(layout)))
ids = torch.randint(0, 32000, (batch, prompt), generator=torch.Generator().manual_seed(0))
times = []
for _ in range(rounds + 1):
    start = time.perf_counter()
    pmodel.generate(ids, max_new_tokens=new)
    times.append(time.perf_counter() - start)
if dist.get_rank() == 0:
    open(out, "w").write(json.dumps(times[1:]))
dist.destroy_process_group()
"""


def alternating(ways: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each way per round, after a warm-up; the order flips every round (whichever ran second in each
    round was measured 8% slower when one order was kept: the machine's drift, not the way)."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.no_grad():
        for run in ways.values():
            run()
        for i in range(rounds):
            for name in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
                start = time.perf_counter()
                ways[name]()
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import plait
    from plait.testing import launch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    new = args.new
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        pmodel = plait.parallelize(model, plait.ParallelConfig())  # the same module: its weights shared
        got = pmodel.generate(ids, mask, max_new_tokens=new)
        assert torch.equal(got, expected), "plait's greedy tokens differ from transformers'"
        ways = {"transformers generate, one process": lambda: model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    eos_token_id=None, pad_token_id=0),
                "ParallelModel.generate, tp=1": lambda: pmodel.generate(ids, mask, max_new_tokens=new)}
        results = alternating(ways, args.rounds)
        script, out = Path(tmp) / "worker.py", Path(tmp) / "world.json"
        script.write_text(WORKER)
        os.environ["OMP_NUM_THREADS"] = "1"
        for name, layout in LAYOUTS.items():
            launch([str(script), tmp, str(args.batch), str(args.prompt), str(new), str(args.rounds), str(out),
                    json.dumps(layout)], 2, timeout=1800)
            results[f"ParallelModel.generate, {name} (2 processes)"] = json.loads(out.read_text())
    tokens = args.batch * new
    base = tokens / statistics.median(results["transformers generate, one process"])
    size = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**SHAPE)).parameters()) / 1e6
    print(f"Llama of {size:.0f}M parameters, fp32, batch {args.batch}, prompts of {args.prompt}, {new} new tokens, "
          f"greedy; {torch.get_num_threads()} threads in one process, {os.cpu_count()} cores")
    print("| way | new tokens/s (median) | vs transformers | rounds, s |\n| --- | ---: | ---: | --- |")
    for way, times in results.items():
        rate = tokens / statistics.median(times)
        print(f"| {way} | {rate:.1f} | {rate / base:.2f}x | {', '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    sys.exit(main())
