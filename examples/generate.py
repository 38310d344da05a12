"""Generate text with a model plait trained and consolidated: plain transformers, no plait needed.

    python examples/generate.py runs/main/hf --prompt "ROMEO:" --max_new_tokens 60
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="the output of `plait consolidate`")
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument("--max_new_tokens", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                         pad_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(out[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
