"""Chat SFT end to end on the bundled conversations: a chat tokenizer, `plait train` on 2 processes with
tensor + sequence parallelism and packed examples (only assistant tokens trained on), `plait consolidate`,
then transformers' `generate` with the chat template on the result (no plait needed for that part).

    python examples/sft_chat.py [--output_dir runs/sft-chat] [--max_steps 300] [--nproc 2]

A real run would start from a pretrained model dir (--model_name_or_path, its own tokenizer and template);
this one trains a tiny Llama from scratch, so its answers are only as good as 400 toy conversations make them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.checkpoint import latest_checkpoint
from plait.cli import main as plait  # plait's command line, run in this process: its imports are paid
from plait.data.chat_tokenizer import save_chat_tokenizer

DATA = Path(__file__).with_name("sft") / "conversations.jsonl"
MODEL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="runs/sft-chat")
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2, help="processes, all tensor parallel (1: one process)")
    parser.add_argument("--question", default="What colour is grass?")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = [m["content"] for line in DATA.read_text().splitlines() for m in json.loads(line)["messages"]]
    tokenizer_dir = save_chat_tokenizer(texts, MODEL["vocab_size"], out / "tokenizer")
    config = out / "config.json"
    config.write_text(json.dumps(MODEL))

    run = out / "run"
    plait(["train", "--nproc_per_node", str(args.nproc), "--tensor_parallel_size", str(args.nproc),
           "--model_config", str(config), "--train_file", str(DATA), "--tokenizer_name", str(tokenizer_dir),
           "--data_format", "chat", "--packing", "--block_size", "128", "--per_device_train_batch_size", "8",
           "--learning_rate", "3e-3", "--lr_scheduler_type", "cosine", "--warmup_steps", "10",
           "--max_steps", str(args.max_steps), "--save_steps", str(args.max_steps),
           "--logging_steps", "50", "--data_cache_dir", str(out / "cache"), "--output_dir", str(run)])
    hf_dir = out / "hf"
    plait(["consolidate", str(latest_checkpoint(run)), str(hf_dir)])

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"user: {args.question}\nassistant: {answer.strip()}")


if __name__ == "__main__":
    main()
