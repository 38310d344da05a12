"""GRPO end to end on the CPU: a tiny Llama learns a toy reward (the share of vowels in what it writes) from its own
rollouts, with `plait train --method grpo`, and the reward curve is drawn to reward.png.

    python examples/grpo_toy.py [--output_dir runs/grpo-toy] [--max_steps 40] [--nproc 1]

Each step the policy completes 4 prompts 8 times each (sampled from its own shards, --nproc processes of tensor
parallelism), examples/grpo/rewards.py scores the completions, and the advantages within each prompt's group move the
policy towards its better completions (TRL's GRPO loss, --loss_type dapo). A real run starts from a pretrained model
dir (--model_name_or_path) and rewards what matters to it (a verifier, a unit test, a judge).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from plait.cli import main as plait  # plait's command line, run in this process: its imports are paid
from plait.data.chat_tokenizer import save_chat_tokenizer
from plait.run.metrics import read_metrics

HERE = Path(__file__).parent
MODEL = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
PROMPTS = ["say something", "tell me a word", "write a line", "go on"]
TEXT = "the quick brown fox jumps over the lazy dog. a bee sees an eel. oh you ought to eat a pie. rhythm, crypt, lynx."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="runs/grpo-toy")
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=1, help="processes, all tensor parallel")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = save_chat_tokenizer([TEXT, *PROMPTS] * 50, MODEL["vocab_size"] - 20, out / "tokenizer")
    (out / "config.json").write_text(json.dumps(MODEL))
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))

    run = out / "run"
    plait(["train", "--method", "grpo", "--nproc_per_node", str(args.nproc), "--tensor_parallel_size",
           str(args.nproc), "--model_config", str(out / "config.json"), "--tokenizer_name", str(tokenizer_dir),
           "--train_file", str(out / "prompts.jsonl"), "--reward_funcs", f"{HERE / 'grpo' / 'rewards.py'}:vowels",
           "--num_generations", "8", "--per_device_train_batch_size", "32", "--max_completion_length", "12",
           "--block_size", "32", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant",
           "--max_steps", str(args.max_steps), "--logging_steps", "10", "--no_save_final", "--output_dir", str(run)])
    rewards = [(r["step"], r["reward"]) for r in read_metrics(run) if "reward" in r]
    plot(rewards, out / "reward.png")
    first, last = rewards[: max(1, len(rewards) // 5)], rewards[-max(1, len(rewards) // 5):]
    mean = lambda part: sum(r for _, r in part) / len(part)  # noqa: E731
    print(f"reward (share of vowels): {mean(first):.3f} over the first steps, {mean(last):.3f} over the last; "
          f"curve: {out / 'reward.png'}")


def plot(rewards: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s for s, _ in rewards], [r for _, r in rewards], label="mean reward of the step's 32 completions")
    ax.set_xlabel("step")
    ax.set_ylabel("share of vowels")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
