"""The trainer runs a training method it does not know: a method is a class (``plait.run.methods.base``), not a
branch in the trainer. Here a method written in this file trains on the second half of each block only (its own
labels and divisor); ``plait train``'s loop with it matches a plain transformers + torch loop with the same
labels, step by step (loss and gradient norm), and differs from next-token prediction on the same run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from plait.data import GlobalBatchSampler
from plait.data.sft_blocks import batch_inputs
from plait.run.methods.next_token import NextToken
from plait.run.train_args import TrainArgs
from plait.run.train_data import load_data
from plait.run.trainer import Trainer
from plait.tp.loss import IGNORE_INDEX
from tiny_models import tiny_config

STEPS, LR, VOCAB, BLOCK, BATCH = 3, 3e-3, 320, 16, 4


def second_half(labels: torch.Tensor) -> torch.Tensor:
    """The labels with the first half of each block ignored."""
    labels = labels.clone()
    labels[:, : labels.shape[1] // 2] = IGNORE_INDEX
    return labels


class SecondHalf(NextToken):
    """Next-token prediction on the second half of each block."""

    def divisor(self, rows):
        return len(rows) * (BLOCK - BLOCK // 2)  # the labels of positions BLOCK//2 .. BLOCK-1 of each row

    def micro_batches(self, rows, mesh, accumulation, device):
        return [(ids, second_half(labels), positions)
                for ids, labels, positions in super().micro_batches(rows, mesh, accumulation, device)]


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("methods")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB)).save_pretrained(root / "model")
    text = root / "text.txt"
    text.write_text(" ".join(f"the {w} sat on the {v} mat." for w in ("cat", "dog", "owl") for v in ("red", "old"))
                    * 40)
    return dict(model_name_or_path=str(root / "model"), train_file=str(text), block_size=BLOCK, max_steps=STEPS,
                learning_rate=LR, lr_scheduler_type="constant", data_cache_dir=str(root / "cache"), device="cpu",
                seed=3, per_device_train_batch_size=BATCH, save_steps=0, save_final=False)


def reference(args: dict) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) per step of a plain loop on the second halves."""
    train_args = TrainArgs(**args)
    blocks, _, _ = load_data(train_args, VOCAB)
    model = AutoModelForCausalLM.from_pretrained(args["model_name_or_path"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sampler = GlobalBatchSampler(len(blocks), BATCH, train_args.seed)
    out = []
    for step in range(STEPS):
        ids, labels, _ = batch_inputs(blocks, sampler.indices(step), torch.device("cpu"))
        labels = second_half(labels)[:, 1:]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (labels != IGNORE_INDEX).sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train_args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


def test_the_trainer_runs_a_method_it_does_not_know(args, tmp_path):
    expected = reference(args)
    history = Trainer(TrainArgs(**{**args, "output_dir": str(tmp_path / "half")}), method=SecondHalf).train()
    got = [(r["loss"], r["grad_norm"]) for r in history]
    assert [r["trainable_tokens"] for r in history] == [BATCH * (BLOCK - BLOCK // 2)] * STEPS
    assert [x for pair in got for x in pair] == pytest.approx([x for pair in expected for x in pair], rel=1e-5), (
        got, expected)
    whole = Trainer(TrainArgs(**{**args, "output_dir": str(tmp_path / "whole")})).train()
    assert abs(whole[0]["loss"] - got[0][0]) > 1e-3, "the method's labels made no difference"
