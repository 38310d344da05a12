"""LoRA chat fine-tuning end to end on the bundled conversations: `plait train --lora_r` on 2 processes with
tensor + sequence parallelism (frozen base, only the adapters trained, only assistant tokens counted), then
`plait consolidate --lora adapter` (a peft directory) and `--lora merged` (a plain model), and transformers'
`generate` with the chat template on both (no plait needed for that part).

    python examples/lora_chat.py [--base MODEL_DIR] [--output_dir runs/lora-chat] [--max_steps 300] [--nproc 2]

--base: a local Hugging Face model directory with a tokenizer and chat template (a real run starts from a
pretrained model). Without it, a tiny random Llama with a chat tokenizer trained on the conversations is saved
first and used as the base: the adapters then learn what 400 toy conversations teach a random model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from plait.checkpoint import latest_checkpoint
from plait.cli import main as plait  # plait's command line, run in this process: its imports are paid
from plait.data.chat_tokenizer import save_chat_tokenizer

DATA = Path(__file__).with_name("sft") / "conversations.jsonl"
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def tiny_base(out: Path) -> Path:
    """A random tiny Llama and a chat tokenizer for the conversations, saved as one model directory."""
    texts = [m["content"] for line in DATA.read_text().splitlines() for m in json.loads(line)["messages"]]
    tokenizer = AutoTokenizer.from_pretrained(save_chat_tokenizer(texts, TINY["vocab_size"], out / "tokenizer"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, bos_token_id=tokenizer.bos_token_id,
                                                         eos_token_id=tokenizer.eos_token_id,
                                                         pad_token_id=tokenizer.pad_token_id))
    base = out / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


def answer(model, tokenizer, question: str) -> str:
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="a local model dir with a chat template (default: tiny random)")
    parser.add_argument("--output_dir", default="runs/lora-chat")
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2, help="processes, all tensor parallel (1: one process)")
    parser.add_argument("--question", default="What colour is grass?")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.base) if args.base else tiny_base(out)

    run = out / "run"
    plait(["train", "--nproc_per_node", str(args.nproc), "--tensor_parallel_size", str(args.nproc),
           "--model_name_or_path", str(base), "--train_file", str(DATA), "--data_format", "chat",
           "--packing", "--block_size", "128", "--per_device_train_batch_size", "8",
           "--lora_r", "16", "--lora_alpha", "32", "--learning_rate", "1e-2",
           "--lr_scheduler_type", "cosine", "--warmup_steps", "10", "--max_steps", str(args.max_steps),
           "--save_steps", str(args.max_steps), "--logging_steps", "50",
           "--data_cache_dir", str(out / "cache"), "--output_dir", str(run)])
    checkpoint = latest_checkpoint(run)
    for mode in ("adapter", "merged"):
        plait(["consolidate", str(checkpoint), str(out / mode), "--lora", mode])

    tokenizer = AutoTokenizer.from_pretrained(base)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    print(f"user: {args.question}")
    print(f"assistant (peft adapter on the base): {answer(adapted, tokenizer, args.question)}")
    print(f"assistant (merged model):             {answer(merged, tokenizer, args.question)}")


if __name__ == "__main__":
    main()
