"""How long a run takes to train again after one of its ranks is killed, and how many steps it loses, three ways.

    python bench/faults.py [--steps 30] [--kill_at 13] [--save_steps 5] [--rounds 1]

The same run each time: a small Llama, two ranks holding the same weights (data-parallel), a global batch of 4
blocks of 64 tokens, a checkpoint every ``--save_steps`` steps; the rank holding the second half of the data is
SIGKILLed at the start of step ``--kill_at`` (``PLAIT_FAULT_INJECT``, as an out-of-memory killer would).

- torchrun's restart: ``plait train --nproc_per_node 2 --max_restarts 1``: torchrun ends the other worker, starts
  both again, and they resume from the newest checkpoint by themselves;
- torchft's live recovery: two replica groups of one process (``--fault_tolerance torchft``, a lighthouse on the
  loopback); the live group goes on at its next quorum, in the same process;
- a fresh job: the same ``plait train --nproc_per_node 2`` without restarts ends; the command is run again with
  ``--resume_from_checkpoint auto`` at once (a scheduler's requeue, with no time in the queue).

"Time to training again" runs from the moment metrics.jsonl shows the last step before the kill to the moment it
shows the next step trained (by the job or the surviving group): so it holds one step's own time besides the
recovery. "Steps lost" are the steps trained again or never applied: those after the newest checkpoint for the
two restarts, the uncommitted step for torchft (whose dead group's share of each batch is also not trained on
until a replacement joins, which it can do at any quorum).

Run it alone: the three cases start interpreters and compete for the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from plait.testing.metrics_watch import MetricsWatch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 128, "tie_word_embeddings": False}


def train(flags: list[str], env: dict[str, str] | None = None, wait: bool = True) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "plait", "train", *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if wait:
        proc.wait()
    return proc


def steps(seen: list[tuple[float, dict]]) -> list[tuple[float, dict]]:
    return [(t, r) for t, r in seen if "event" not in r]


def recovery(seen: list[tuple[float, dict]], kill_at: int) -> tuple[float, int]:
    """Seconds from the last step before the kill to the next step trained after it, and steps lost."""
    records = steps(seen)
    before = min(t for t, r in records if r["step"] == kill_at - 1)  # the first run's (a restart trains it again)
    after = min(t for t, r in records if t > before and r.get("committed", True))
    trained = [r["step"] for _, r in records]
    lost = len(trained) - len(set(trained)) + sum(1 for _, r in records if r.get("committed") is False)
    return after - before, lost


def restart_case(base: list[str], out: Path, kill: str, kill_at: int) -> tuple[float, int]:
    watch = MetricsWatch(out / "metrics.jsonl")
    train([*base, "--output_dir", str(out), "--nproc_per_node", "2", "--max_restarts", "1"],
          {"PLAIT_FAULT_INJECT": kill})
    return recovery(watch.stop(), kill_at)


def fresh_case(base: list[str], out: Path, kill: str, kill_at: int) -> tuple[float, int]:
    watch = MetricsWatch(out / "metrics.jsonl")
    train([*base, "--output_dir", str(out), "--nproc_per_node", "2"], {"PLAIT_FAULT_INJECT": kill})
    train([*base, "--output_dir", str(out), "--nproc_per_node", "2", "--resume_from_checkpoint", "auto"])
    return recovery(watch.stop(), kill_at)


def torchft_case(base: list[str], out: Path, kill_at: int) -> tuple[float, int]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=100)
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
    try:
        ft = [*base, "--fault_tolerance", "torchft", "--num_replica_groups", "2"]
        watch = MetricsWatch(out / "group0" / "metrics.jsonl")
        survivor = train([*ft, "--output_dir", str(out / "group0"), "--replica_group_id", "0"], env, wait=False)
        train([*ft, "--output_dir", str(out / "group1"), "--replica_group_id", "1"],
              {**env, "PLAIT_FAULT_INJECT": f"0:{kill_at}:kill"})
        survivor.wait()
        return recovery(watch.stop(), kill_at)
    finally:
        lighthouse.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill_at", type=int, default=13)
    parser.add_argument("--save_steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    ns = parser.parse_args()
    results: dict[str, list[tuple[float, int]]] = {"torchrun restart (--max_restarts 1)": [],
                                                   "torchft live recovery": [],
                                                   "fresh job from the last checkpoint": []}
    with tempfile.TemporaryDirectory(prefix="plait-faults-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(CONFIG))
        base = ["--model_config", str(config), "--max_steps", str(ns.steps), "--save_steps", str(ns.save_steps),
                "--per_device_train_batch_size", "2", "--block_size", "64", "--no_save_final", "--ddp_timeout", "60"]
        kill = f"1:{ns.kill_at}:kill"
        for round_ in range(ns.rounds):
            run = Path(tmp) / f"round{round_}"
            results["torchrun restart (--max_restarts 1)"].append(
                restart_case(base, run / "restart", kill, ns.kill_at))
            results["torchft live recovery"].append(torchft_case(base, run / "torchft", ns.kill_at))
            results["fresh job from the last checkpoint"].append(fresh_case(base, run / "fresh", kill, ns.kill_at))
    print(f"one rank of 2 SIGKILLed at step {ns.kill_at} of {ns.steps}, a checkpoint every {ns.save_steps} steps; "
          f"{ns.rounds} round(s), median [min-max]\n")
    print("| recovery | time to training again (s) | steps lost |\n| --- | --- | --- |")
    for name, rounds in results.items():
        times = [t for t, _ in rounds]
        print(f"| {name} | {statistics.median(times):.1f} [{min(times):.1f}-{max(times):.1f}] | "
              f"{statistics.median([lost for _, lost in rounds]):g} |")


if __name__ == "__main__":
    main()
