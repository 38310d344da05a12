"""`plait train` against an independent reference: a plain transformers + torch loop (the model read with
``from_pretrained``, AdamW, ``clip_grad_norm_``, the loss summed over the global batch's labels and divided by
their count) on the same global batches, for several steps: per-step losses and gradient norms at tp=2 + SP,
pp=2 and ZeRO-1 dp=2 on plain text, and at tp=2 + SP on packed, prompt-masked SFT blocks. Only the choice of
blocks (the tokenizer, the block layout and the seeded sampler) is plait's in both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from plait.data import GlobalBatchSampler
from plait.data.chat_tokenizer import save_chat_tokenizer
from plait.data.sft_blocks import batch_inputs, count_labels
from plait.run.train_args import TrainArgs
from plait.run.train_data import load_data
from plait.testing import launch
from tiny_models import tiny_config

WORKER = str(Path(__file__).parent / "workers" / "trainers.py")
STEPS, LR, VOCAB = 4, 3e-3, 320
LAYOUTS = {"tp2_sp": dict(tensor_parallel_size=2, per_device_train_batch_size=4),
           "pp2": dict(pipeline_parallel_size=2, num_microbatches=2, per_device_train_batch_size=4),
           "zero1_dp2": dict(zero_1=True, per_device_train_batch_size=2)}
CHATS = [{"messages": [{"role": "user", "content": f"what is {a} plus {b}"},
                       {"role": "assistant", "content": f"{a + b}, since {a} and {b} make {a + b}"}]}
         for a in range(6) for b in range(4)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("reference")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB)).save_pretrained(root / "model")
    text = root / "text.txt"
    text.write_text(" ".join(f"the {w} sat on the {v} mat." for w in ("cat", "dog", "owl") for v in ("red", "old"))
                    * 60)
    chats = root / "chat.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    tokenizer = save_chat_tokenizer([m["content"] for c in CHATS for m in c["messages"]], VOCAB, root / "tokenizer")
    shared = dict(model_name_or_path=str(root / "model"), block_size=32, max_steps=STEPS, learning_rate=LR,
                  lr_scheduler_type="constant", data_cache_dir=str(root / "cache"), device="cpu", seed=3)
    cases = {name: {**shared, **layout, "train_file": str(text), "output_dir": str(root / name)}
             for name, layout in LAYOUTS.items()}
    cases["sft_packed_tp2_sp"] = {**shared, **LAYOUTS["tp2_sp"], "train_file": str(chats), "packing": True,
                                  "tokenizer_name": str(tokenizer), "output_dir": str(root / "sft")}
    return cases


@pytest.fixture(scope="module")
def histories(cases, tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("runs")
    (root / "flags.json").write_text(json.dumps(cases))
    launch([WORKER, str(root / "out.json"), str(root / "flags.json")], 2, timeout=300)
    return {case: ranks[0]["history"] for case, ranks in json.loads((root / "out.json").read_text()).items()}


def reference(args: dict, global_batch: int) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) per step of the plain loop."""
    train_args = TrainArgs(**args)
    blocks, _, _ = load_data(train_args, VOCAB)
    model = AutoModelForCausalLM.from_pretrained(args["model_name_or_path"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sampler = GlobalBatchSampler(len(blocks), global_batch, train_args.seed)
    out = []
    for step in range(STEPS):
        rows = sampler.indices(step)
        ids, labels, positions = batch_inputs(blocks, rows, torch.device("cpu"))
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
        loss = loss / count_labels(blocks, rows)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train_args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


def matches(history: list[dict], expected: list[tuple[float, float]]) -> bool:
    """Every step's loss and gradient norm within 1e-5 of the plain loop's."""
    return ([r["step"] for r in history] == list(range(1, STEPS + 1))
            and [r["loss"] for r in history] == pytest.approx([loss for loss, _ in expected], rel=1e-5)
            and [r["grad_norm"] for r in history] == pytest.approx([norm for _, norm in expected], rel=1e-5))


@pytest.mark.parametrize("case", [*LAYOUTS, "sft_packed_tp2_sp"])
def test_trainer_matches_a_plain_loop(cases, histories, case):
    args = cases[case]
    dp = 2 if args.get("zero_1") else 1
    expected = reference(args, args["per_device_train_batch_size"] * dp)
    assert matches(histories[case], expected), (case, [(r["loss"], r["grad_norm"]) for r in histories[case]], expected)


def test_the_comparison_catches_a_planted_bug(cases, monkeypatch, tmp_path):
    """A test of the test: on one process the trainer matches the plain loop, and with a planted one-line bug
    (one gradient scaled by 1.001 before every step) the same comparison fails. (Adam's update is nearly blind
    to a steady scale, so the losses barely move: the gradient norm is what must catch it.)"""
    import plait.optim.step
    from plait.run.trainer import Trainer

    args = {**cases["tp2_sp"], "tensor_parallel_size": 1}
    expected = reference(args, args["per_device_train_batch_size"])
    assert matches(Trainer(TrainArgs(**{**args, "output_dir": str(tmp_path / "clean")})).train(), expected)

    norm = plait.optim.step.global_grad_norm

    def planted(params, *rest, **kwargs):
        next(p for p in params if p.grad is not None).grad.mul_(1.001)
        return norm(params, *rest, **kwargs)

    monkeypatch.setattr(plait.optim.step, "global_grad_norm", planted)
    assert not matches(Trainer(TrainArgs(**{**args, "output_dir": str(tmp_path / "bugged")})).train(), expected)
