"""The MoE load-balancing loss over the global batch (``moe_aux_loss_scope="global_batch"``, plait.parallel.moe_balance): one
process at the global batch in one forward (transformers' own loss) is what dp, microbatches, accumulation calls,
pp (1f1b, zero-bubble, gpipe), cp (both strategies), ep, tp + SP, ZeRO-1/3 and their combinations train on, in
loss, evaluation loss, the reported aux term and every gradient on every rank, step after step; the default
scope (``micro_batch``) is shown to differ. The trainer's accumulation steps share one balance. A model the scope
cannot serve exactly is refused before any collective, in one line naming the values and the fix."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model
from plait.layout_plan import plan_layout
from plait.parallelize import parallelize
from plait.run.metrics import read_metrics
from plait.run.train_args import TrainArgs
from plait.run.trainer import train
from plait.testing import launch
from plait.testing.conformance_modes import load_subject
from plait.testing.conformance_worker import perturb

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from moe_global_aux import CASES  # noqa: E402

WORKER = str(Path(__file__).parent / "workers" / "moe_global_aux.py")
GLOBAL = dict(moe_aux_loss_scope="global_batch")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("moe_global_aux")
    merged: dict[str, dict] = {}
    for tag, world in (("w2", 2), ("w4", 4)):
        launch([WORKER, str(out), tag], world, timeout=500)
        merged.update({case: {**record, "world": world}
                       for case, record in json.loads((out / f"{tag}.json").read_text()).items()})
    return merged


@pytest.mark.parametrize("case", [case for cases in CASES.values() for case, c in cases.items()
                                  if c.scope == "global_batch"])
def test_global_batch_aux_loss_is_one_process_s(results, case):
    record = results[case]
    assert record["failures"] == [] and not record["crashed"], record["failures"]
    assert record["ranks"] == record["world"]
    assert record["loss_rel"] <= 1e-6 and record["eval_rel"] <= 1e-6 and record["grad_tol"] <= 1, record
    assert record["aux_rel"] <= 1e-6  # the aux term the step's metrics report (0 where pp > 1: not kept there)
    assert record["aux_share"] > 0.05  # the aux loss is a real part of what was compared
    assert record["checked"] == sorted(record["expected"])  # every parameter, routers included, on some rank


def test_micro_batch_scope_is_not_one_process_s(results):
    """The default scope averages per-forward losses: under dp=2 its loss and gradients are not the one process's."""
    record = results["qwen3_moe|dp2-micro_batch"]
    assert not record["crashed"]
    assert record["loss_rel"] > 1e-5 and record["aux_rel"] > 1e-4 and record["grad_tol"] > 100, record


def moe_model(arch: str = "qwen3_moe", **overrides):
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(load_subject(f"transformers:{arch}").config)
    config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    perturb(model)
    return model


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_one_process_microbatches_and_forward_are_transformers_loss(arch):
    """One process: 1, 2 or 4 microbatches, and ``forward`` with labels, train on transformers' loss of the whole
    batch (bit-exact in one forward)."""
    reference = moe_model(arch)
    ids = torch.randint(0, reference.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    out = reference(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    for microbatches in (1, 2, 4):
        pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(num_microbatches=microbatches, **GLOBAL))
        loss = pmodel.train_step(ids, ids)
        assert loss.item() == pytest.approx(out.loss.item(), rel=1e-6, abs=0)
        if microbatches == 1:
            assert loss.item() == out.loss.item()
        for (name, ours), theirs in zip(pmodel.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)
        assert pmodel.eval_loss(ids, ids).item() == pytest.approx(out.loss.item(), rel=1e-6, abs=0)
    pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(**GLOBAL))
    assert pmodel(ids, labels=ids).item() == out.loss.item()


def test_set_global_batch_names_the_calls_that_follow():
    """Two calls named by ``set_global_batch`` train on the loss of both batches together; a call whose batch is not
    the one named is refused; an evaluation between them leaves their balance alone."""
    reference = moe_model()
    ids = torch.randint(0, reference.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(**GLOBAL))
    first, second = ids[:3], ids[3:]
    pmodel.set_global_batch([(first, None, None), (second, None, None)])
    pmodel.train_step(first, first, num_items_in_batch=4 * 15)
    pmodel.eval_loss(ids[:1], ids[:1])
    pmodel.train_step(second, second, num_items_in_batch=4 * 15)
    for (name, ours), theirs in zip(pmodel.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)
    pmodel.set_global_batch([(first, None, None), (second, None, None)])
    with pytest.raises(ConfigError, match=r"^train_step got input_ids of shape \(1, 16\), but set_global_batch named "
                                          r"a batch of shape \(3, 16\) for this call"):
        pmodel.train_step(second, second)


def run(tmp_path: Path, name: str, scope: str, batch: int, accumulation: int) -> list[dict]:
    config = moe_model().config
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    out = tmp_path / name
    train(TrainArgs(model_config=str(path), output_dir=str(out), max_steps=2, per_device_train_batch_size=batch,
                    gradient_accumulation_steps=accumulation, block_size=16, learning_rate=1e-3,
                    moe_aux_loss_scope=scope, save_final=False))
    return read_metrics(out)


def test_trainer_accumulation_shares_one_balance(tmp_path):
    """``plait train --moe_aux_loss_scope global_batch``: 2 accumulation steps of 2 sequences train as 1 of 4 (loss
    and aux loss step by step)."""
    whole = run(tmp_path, "whole", "global_batch", 4, 1)
    split = run(tmp_path, "split", "global_batch", 2, 2)
    for a, b in zip(whole, split, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5)


def test_micro_batch_scope_averages_over_accumulation_steps(tmp_path):
    """``micro_batch``: the aux term is the mean over every forward of the step, accumulation calls included, so 2
    calls of 2 sequences train on about the aux loss of 1 of 4 (each forward's own balance: not equal), not twice it
    (each call added its own mean before: 2.005 against 1.0016; now 1.0025 against 1.0016)."""
    whole = run(tmp_path, "whole", "micro_batch", 4, 1)
    split = run(tmp_path, "split", "micro_batch", 2, 2)
    for a, b in zip(whole, split, strict=True):
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=3e-3)


def refusal(model, config: ParallelConfig = ParallelConfig(**GLOBAL), lora=None) -> str:
    with pytest.raises(ConfigError) as err:
        plan_layout(model, config, world_size=config.tp * config.pp * config.cp, lora=lora)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_what_global_batch_cannot_serve_is_refused_before_any_collective(monkeypatch):
    meta = lambda arch, **kw: build_meta_model(moe_model(arch, **kw).config)  # noqa: E731
    assert refusal(meta("qwen3_moe", output_router_logits=False)) == (
        "moe_aux_loss_scope='global_batch', but qwen3_moe computes no load-balancing loss (output_router_logits is "
        "off in its config); set output_router_logits=True in the model config, or leave "
        "moe_aux_loss_scope='micro_batch'")
    assert refusal(meta("qwen3_moe", attention_dropout=0.1)) == (
        "moe_aux_loss_scope='global_batch' counts the step's routing in a pass before the training forwards, which "
        "must route alike, but qwen3_moe's forward draws random numbers (attention_dropout=0.1); set it to 0, or use "
        "moe_aux_loss_scope='micro_batch'")
    assert "(router_jitter_noise=0.01)" in refusal(meta("mixtral", router_jitter_noise=0.01))
    from plait.lora.config import lora_config
    assert "(lora_dropout=0.1)" in refusal(meta("qwen3_moe"), lora=lora_config(4, 8.0, 0.1, None))
    doge = copy.deepcopy(load_subject("transformers:doge").config)
    doge.output_router_logits = True
    assert refusal(build_meta_model(doge)).startswith(
        "output_router_logits=True with moe_aux_loss_scope='global_batch': DogeForCausalLM.forward does not compute "
        "its load-balancing loss as `load_balancing_loss_func(")

    from transformers.models.qwen3_moe import modeling_qwen3_moe

    own = modeling_qwen3_moe.load_balancing_loss_func
    monkeypatch.setattr(modeling_qwen3_moe, "load_balancing_loss_func",  # a mean of per-layer losses
                        lambda logits, experts, k, mask: sum(own((g,), experts, k, mask) for g in logits) / len(logits))
    message = refusal(meta("qwen3_moe"))
    assert message.startswith("moe_aux_loss_scope='global_batch': qwen3_moe's load_balancing_loss_func gives ")
    assert message.endswith("use moe_aux_loss_scope='micro_batch'")
    monkeypatch.undo()
    plan_layout(meta("qwen3_moe"), ParallelConfig(pp=2, cp=2, num_microbatches=2, **GLOBAL), world_size=4)  # served


def test_an_unknown_scope_is_refused():
    with pytest.raises(ConfigError, match=r"^moe_aux_loss_scope='global' is unknown; choose one of micro_batch, "
                                          r"global_batch$"):
        ParallelConfig(moe_aux_loss_scope="global")
    with pytest.raises(ConfigError, match=r"^--moe_aux_loss_scope='step' is unknown; choose one of micro_batch, "
                                          r"global_batch$"):
        TrainArgs(moe_aux_loss_scope="step").validate()
    assert TrainArgs(moe_aux_loss_scope="global_batch").parallel_config().moe_aux_loss_scope == "global_batch"
