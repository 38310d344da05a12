"""Worker: ParallelModel.generate on several layouts of one world against one process (tests/test_generate.py).

For each case every rank builds the same tiny model, lays a copy out and generates from the same left-padded
prompts: greedily (compared with transformers' ``generate`` on one process) and sampled (compared with the same
decoding loop run on the plain model in this process, ``decode``). It also records the refusals. One JSON per rank.
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import plait  # noqa: E402
from peft import get_peft_model  # noqa: E402
from plait.checkpoint.lora_export import gather_lora  # noqa: E402
from plait.generation.decode import decode, drop_pads  # noqa: E402
from plait.lora.config import lora_config  # noqa: E402
from tiny_models import tiny_model  # noqa: E402
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList  # noqa: E402

NEW, EOS, PAD = 12, 7, 0
LONG = 30  # new tokens at most where every row stops early
SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9, seed=5)
# name -> (arch, ParallelConfig kwargs)
CASES = {
    "llama-tp2": ("llama", dict(tp=2, sp=False)),
    "llama-tp2-sp": ("llama", dict(tp=2)),  # each forward's tokens padded to a multiple of 2 (odd prompts: 9)
    "llama-dp2": ("llama", dict(tp=1)),
    "llama-zero1-dp2": ("llama", dict(zero_1=True)),
    "llama-zero2-dp2": ("llama", dict(zero_stage=2)),
    "llama-zero3-dp2": ("llama", dict(zero_stage=3)),
    "gpt2-tp2": ("gpt2", dict(tp=2, sp=False)),
    "gpt2-tp2-sp": ("gpt2", dict(tp=2)),
    "mixtral-ep2": ("mixtral", dict(ep=2)),
    # a sliding window of 6 (its mask counts cache entries) under SP, whose pads each step must not fill
    "mistral-tp2-sp": ("mistral", dict(tp=2)),
    # chunked attention (chunks of 8: the prompts and completions cross two) with no rope in every other layer, under SP
    "llama4_text-tp2-sp": ("llama4_text", dict(tp=2)),
    # a stage a rank: each stage's own KV cache, the hidden states of each step handed on, the last stage's logits back
    "llama-pp2": ("llama", dict(pp=2, num_microbatches=2)),
    "gpt2-pp2": ("gpt2", dict(pp=2, num_microbatches=2)),  # its head tied to the first stage's embedding
    # two stages a rank (the interleaved schedule's placement: rank 0 holds stages 0 and 2), a layer a stage
    "llama4-pp2-vpp2": ("llama4", dict(pp=2, virtual_pipeline_size=2, num_microbatches=2,
                                       pipeline_schedule="interleaved-1f1b")),
    # each cp rank decodes the replica's rows whole, with the model's own attention
    "llama-cp2": ("llama", dict(cp=2)),
    # LoRA (random A and B) under tp=2 + SP, against peft's model on one process with the same adapter values
    "llama-lora-tp2-sp": ("llama", dict(tp=2)),
    "llama-lora-zero3-dp2": ("llama", dict(zero_stage=3)),
}
# a world of 4: a middle stage (receives hidden states, sends them on, gets the tokens from the last), two replicas
# whose last stages agree when every row is done, stages of two tp ranks with SP
CASES_4 = {
    "llama4-pp4": ("llama4", dict(pp=4, num_microbatches=4)),
    "llama-pp2-dp2": ("llama", dict(pp=2, num_microbatches=2)),
    "llama-pp2-tp2-sp": ("llama", dict(pp=2, tp=2, num_microbatches=2)),
    "mistral-pp2-tp2-sp": ("mistral", dict(pp=2, tp=2, num_microbatches=2)),
}


def prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompts of 9, 6, 9 and 4 tokens, left padded (no EOS among them)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(EOS + 1, vocab, (4, 9), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in enumerate((9, 6, 9, 4)):
        mask[row, : 9 - length] = 0
        ids[row, : 9 - length] = PAD
    return ids, mask


def one_process(reference, ids, mask) -> dict[str, list]:
    reference.eval()
    with torch.no_grad():
        greedy = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                    eos_token_id=EOS, pad_token_id=PAD)

        cache = DynamicCache()

        def forward(step_ids, step_mask, positions, pads):
            out = reference(input_ids=step_ids, attention_mask=step_mask, position_ids=positions,
                            past_key_values=cache, use_cache=True)
            return drop_pads(out.logits, cache, pads)

        sampled = decode(forward, ids, mask, slice(0, ids.shape[0]), ids.shape[0], max_new_tokens=NEW,
                         eos_token_id=EOS, pad_token_id=PAD, all_done=lambda mine: mine, **SAMPLING)
    return {"greedy": greedy.tolist(), "sampled": sampled.tolist()}


def model(arch: str) -> torch.nn.Module:
    """tests/tiny_models' model, or the generic adapter's tiny config of ``arch`` (mixtral, llama4_text)."""
    if arch == "llama4":  # a layer a stage at pp=4 (seed 1: its free greedy rows share a token by the 11th)
        return tiny_model("llama", seed=1, num_hidden_layers=4)
    if arch not in ("mixtral", "llama4_text"):
        return tiny_model(arch, seed=0)
    from plait_transformers import plait_tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(plait_tiny_config(arch))


def run_case(name: str) -> dict:
    arch, layout = {**CASES, **CASES_4}[name]
    reference = model(arch)
    ids, mask = prompts(reference.config.vocab_size)
    if "-lora-" in name:
        pmodel = plait.parallelize(copy.deepcopy(reference), plait.ParallelConfig(**layout),
                                   lora=lora_config(4, 8, init_lora_weights=False), lora_seed=7)
        adapters = gather_lora(pmodel)
        reference = get_peft_model(reference, copy.deepcopy(pmodel.plan.lora.config))
        with torch.no_grad():
            for peft_name, param in reference.named_parameters():
                if param.requires_grad:
                    param.copy_(adapters[peft_name.removeprefix("base_model.model.").replace(".default.", ".")])
    else:
        pmodel = plait.parallelize(copy.deepcopy(reference), plait.ParallelConfig(**layout))
    pmodel.train()  # generation evaluates (no dropout) and gives the mode back
    greedy = pmodel.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    sampled = pmodel.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, **SAMPLING)
    found = {"one_process": one_process(reference, ids, mask), "greedy": greedy.tolist(),
             "sampled": sampled.tolist(), "still_training": pmodel.module.training}
    if arch.startswith("llama") and "-lora-" not in name:
        found["all_stop"] = all_stop(reference, pmodel, ids, mask)
    return found


def all_stop(reference, pmodel, ids, mask) -> dict:
    """Greedy decoding with an EOS every row meets before ``LONG`` tokens (a token of every row's free greedy
    completion, the earliest to be in all of them): transformers' tokens and the layout's, both stopping early."""
    with torch.no_grad():
        free = reference.generate(ids, attention_mask=mask, max_new_tokens=LONG, do_sample=False, eos_token_id=None,
                                  pad_token_id=PAD)[:, ids.shape[1]:].tolist()
        eos = min(set(free[0]).intersection(*map(set, free[1:])), key=lambda t: max(r.index(t) for r in free))
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=LONG, do_sample=False,
                                      eos_token_id=eos, pad_token_id=PAD)
    got = pmodel.generate(ids, mask, max_new_tokens=LONG, eos_token_id=eos, pad_token_id=PAD)
    # each row's own pair of tokens early in its free completion ends it through a stopping criterion (the EOS of
    # the cases kept: transformers pads a row a criterion ended only beside one)
    ends = EndsWith([tuple(row[2 + r % 3: 4 + r % 3]) for r, row in enumerate(free)])
    with torch.no_grad():
        criteria = reference.generate(ids, attention_mask=mask, max_new_tokens=LONG, do_sample=False, eos_token_id=EOS,
                                      pad_token_id=PAD, stopping_criteria=StoppingCriteriaList([ends]))
    by_criteria = pmodel.generate(ids, mask, max_new_tokens=LONG, eos_token_id=EOS, pad_token_id=PAD,
                                  stopping_criteria=StoppingCriteriaList([ends]))
    return {"expected": expected.tolist(), "got": got.tolist(), "criteria_expected": criteria.tolist(),
            "criteria_got": by_criteria.tolist(), "tails": [list(t) for t in ends.tails]}


class EndsWith(StoppingCriteria):
    """Ends a row whose ids end with one of ``tails``: what a stop string's ``StopStringCriteria`` does on text."""

    def __init__(self, tails: list[tuple[int, ...]]) -> None:
        self.tails = tails

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        rows = input_ids.tolist()
        return torch.tensor([any(tuple(row[-len(t):]) == t for t in self.tails) for row in rows],
                            device=input_ids.device)


def refusals() -> dict[str, str]:
    """What generate says, before any collective, for a layout or batch it does not serve."""
    said = {}
    cases = (("odd-batch", dict(tp=1), 3),)
    for name, layout, batch in cases:
        pmodel = plait.parallelize(tiny_model("llama"), plait.ParallelConfig(**layout))
        try:
            pmodel.generate(torch.ones(batch, 8, dtype=torch.long), max_new_tokens=2)
            said[name] = "not refused"
        except plait.ConfigError as err:
            said[name] = str(err)
    return said


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if dist.get_world_size() == 4:
        results = {name: run_case(name) for name in CASES_4}
    else:
        results = {name: run_case(name) for name in CASES}
        results["refusals"] = refusals()
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
