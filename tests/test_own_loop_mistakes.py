"""A new user's own loop fails loudly, not silently: an optimizer built on the model before ``parallelize`` (which
replaces the weights it splits with their shards) would step stale tensors while the shards never train; it is
refused in one line at ``OptimizerStep``, as is ``build_optimizer`` on a model that was never parallelized, a
plain optimizer under ZeRO, and an ``optimizer.step()`` on gradients the layout has not summed yet."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from plait import ParallelConfig, parallelize
from plait.base.config import ConfigError
from plait.optim import OptimizerStep, build_optimizer
from plait.testing import launch
from tiny_models import tiny_config

WORKER = Path(__file__).parent / "workers" / "own_loop_mistakes.py"
FIX = "build the optimizer after parallelize, from the model it returns"


def test_an_optimizer_built_before_parallelize_is_refused_at_tp2_and_replicas_start_equal(tmp_path):
    """Also: ranks that built the model from different seeds lay out rank 0's (parallelize broadcasts it), at dp=2
    and at tp=2, and their dp replicas take identical steps."""
    out = tmp_path / "out.json"
    launch([str(WORKER), str(out)], 2, timeout=120)
    for rank, r in enumerate(json.loads(out.read_text())):
        assert r["stale"] > 0, (rank, r)  # the split weights: what would have stayed untrained
        assert r["error"] and FIX in r["error"], (rank, r)
        assert f"holds {r['stale']} of its {r['held']} tensors" in r["error"], (rank, r)
        assert r["norm"] > 0, (rank, r)  # built after parallelize, the same model steps
    r = json.loads(out.read_text())[1]
    assert len(r["differed"]) > 10, r  # rank 1's own seed gave other weights than rank 0's
    assert r["dp_not_rank0s"] == [] and r["replicas_apart_after_steps"] == [], r
    assert r["tp_not_rank0s"] == [], r  # split weights are slices of rank 0's, replicated ones rank 0's
    # an id or a label past the vocabulary at tp=2 (each rank reads its rows only): refused, not trained as zeros
    for name, said in r["out_of_vocab"].items():
        assert said and said.startswith("token ids or labels outside the model's vocabulary of 61 (ids 0 to 60; "
                                        "labels those or -100)") and "resize_token_embeddings" in said, (name, said)
    assert r["gathered_with_grad"] == [[2, 8, 61], False, True], r  # gather_logits outside no_grad: read, detached
    # a plain optimizer under ZeRO (build_optimizer skipped): ZeRO-2/3 trained other numbers, ZeRO-1 kept all state
    wanted = {"1": "the optimizer state sharded over the data-parallel ranks, which Zero1Optimizer holds",
              "3": "FSDP2's sharded gradients and parameters, which ShardedOptimizer steps"}
    assert r["plain_under_zero"].keys() == wanted.keys()
    for stage, said in r["plain_under_zero"].items():
        assert said == (f"zero_stage={stage} asks for {wanted[stage]}, but the optimizer is a plain AdamW; build it "
                        f"with build_optimizer(pmodel, torch.optim.AdamW, ...)"), (stage, said)
    # optimizer.step() straight after train_step, before the sums OptimizerStep does: the dp replicas drifted apart
    # silently; refused where the layout owes sums, taken after grad_sync.finish() (the replicas then equal) and
    # where FSDP2 summed during backward
    fix = ("each rank would step on its own part and the copies of a weight drift apart silently; call "
           "pmodel.grad_sync.finish() before optimizer.step(), or step with OptimizerStep(pmodel.grad_sync, ")
    owed = {"dp2": "over the data-parallel replicas (dp=2)", "zero1": "over the data-parallel replicas (dp=2)",
            "tp2_sp": "over the tensor-parallel ranks that share a parameter (tp=2)", "zero3": None}
    assert r["step_before_the_sums"].keys() == owed.keys()
    for name, (said, apart) in r["step_before_the_sums"].items():
        if owed[name] is None:
            assert said is None, (name, said)
        else:
            assert said and said.startswith(f"optimizer.step() on gradients not yet summed {owed[name]}: {fix}"), \
                (name, said)
        assert apart == ([] if name == "dp2" else None), (name, apart)


def test_an_extra_trainable_tensor_is_refused_and_the_models_own_are_not():
    torch.manual_seed(0)
    pmodel = parallelize(AutoModelForCausalLM.from_config(tiny_config("llama")), ParallelConfig())
    OptimizerStep(pmodel.grad_sync, torch.optim.AdamW(pmodel.parameters()))
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match=f"holds 1 of its .* tensors .*{FIX}"):
        OptimizerStep(pmodel.grad_sync, torch.optim.AdamW([*pmodel.parameters(), stray]))


def test_build_optimizer_on_a_model_not_parallelized_says_what_to_do():
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with pytest.raises(ConfigError, match=f"not a LlamaForCausalLM; {FIX}"):
        build_optimizer(model)


def test_describe_before_the_world_is_known_says_where_dp_comes_from():
    assert "dp=world/(tp*pp) " in ParallelConfig(tp=2).describe()
    assert "dp=world/(tp*cp*pp) " in ParallelConfig(tp=2, cp=2).describe()
    assert "dp=2 " in ParallelConfig(tp=2).resolve(4).describe()


def test_a_layout_of_several_processes_outside_torchrun_says_how_to_launch(monkeypatch):
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"needs 4 processes, but this process runs alone .*`torchrun "
                                          r"--nproc_per_node 4 .*` and call torch.distributed.init_process_group"):
        parallelize(model, ParallelConfig(tp=2, pp=2))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="one of torchrun's 2 but has not joined their group; call "
                                          r"torch.distributed.init_process_group\(\) before parallelize"):
        parallelize(model, ParallelConfig(tp=2))
    # a data-parallel layout too: each process trained alone on the whole batch, ZeRO off, before
    for config in (ParallelConfig(), ParallelConfig(zero_stage=1)):
        with pytest.raises(ConfigError, match=r"spans the world torchrun started, and this process is one of "
                                              r"torchrun's 2 but has not joined their group"):
            parallelize(model, config)


def test_zero_with_one_data_parallel_rank_is_refused_as_the_api_writes_it(monkeypatch):
    """ZeRO at world 1 would shard over nothing: refused in the API's words (the CLI's: test_bad_inputs), before any
    process group, as ``plait train`` refuses it."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    for config, given in ((ParallelConfig(zero_stage=3), "zero_stage=3"), (ParallelConfig(zero_1=True), "zero_stage=1")):
        with pytest.raises(ConfigError, match=rf"^{given} has no effect with one data-parallel rank \(world 1 = tp 1 x "
                                              r"pp 1\): ZeRO shards over the data-parallel \(x cp\) ranks; drop it, "
                                              r"or launch 2 processes for dp=2$"):
            parallelize(model, config)
    assert not torch.distributed.is_initialized()


def test_backward_on_the_loss_train_step_returns_says_the_step_ran_it(tmp_path):
    """A plain loop's ``loss.backward()`` after ``train_step`` (which ran the backward itself) is one line naming the
    next call, on its loss and on ``global_loss``'s; torch said "element 0 of tensors does not require grad". Else the
    loss is the number it was: printed, formatted, saved and stepped as a plain tensor."""
    from plait.optim import OptimizerStep, build_optimizer

    torch.manual_seed(0)
    pmodel = parallelize(AutoModelForCausalLM.from_config(tiny_config("llama")), ParallelConfig())
    ids = torch.randint(0, 61, (2, 8))
    share = pmodel.train_step(ids, ids)
    loss = pmodel.global_loss(share)
    for tensor in (share, loss):
        with pytest.raises(ConfigError, match=r"^train_step has run this loss's backward already \(the gradients are "
                                              r"in .grad.*call the optimizer step next \(OptimizerStep\(pmodel."
                                              r"grad_sync, optimizer\)\(loss\)\), not loss.backward\(\)$"):
            tensor.backward()
    plain = torch.tensor(loss.item())
    assert repr(loss) == repr(plain) and f"{loss:.5f}" == f"{plain:.5f}" and type(loss * 2) is torch.Tensor
    torch.save(loss, tmp_path / "loss.pt")
    assert type(torch.load(tmp_path / "loss.pt")) is torch.Tensor and torch.load(tmp_path / "loss.pt") == plain
    step = OptimizerStep(pmodel.grad_sync, build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3))
    assert step(loss) > 0  # the gradients were there


def test_batches_of_mismatched_shapes_are_named_before_any_collective():
    """Labels not cut as the ids were (local_batch on one of them only), a mask of other rows and 1-D ids are named
    with their shapes and the fix; torch named flattened token counts inside the loss, or an index out of range.
    A global batch that does not divide, or a micro-step out of range, names the values that would."""
    from plait.base.batches import local_microbatch

    torch.manual_seed(0)
    pmodel = parallelize(AutoModelForCausalLM.from_config(tiny_config("llama")), ParallelConfig())
    ids = torch.randint(0, 61, (4, 16))
    same_rows = "pass the same rows of each (ParallelModel.local_batch on every one of them)"
    for call in (pmodel.train_step, pmodel.eval_loss, pmodel.forward):
        with pytest.raises(ConfigError, match=rf"labels of shape \(8, 16\) does not match input_ids of shape "
                                              rf"\(4, 16\); {re.escape(same_rows)}"):
            call(ids, torch.cat([ids, ids]))
    with pytest.raises(ConfigError, match=r"attention_mask of shape \(4, 8\) does not match input_ids of shape"):
        pmodel.train_step(ids, ids, attention_mask=torch.ones(4, 8, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"input_ids of shape \(16,\) must be \[batch, sequence\]; add the batch "):
        pmodel.train_step(ids[0], ids[0])
    with pytest.raises(ValueError, match="global_batch_size=7 is not divisible by dp_size \\* accumulation_steps = "
                                         "2 \\* 1 = 2; use a global batch of a multiple of 2 rows"):
        local_microbatch(torch.arange(7), 0, 2, 1, 0)
    with pytest.raises(ValueError, match="micro_step=2 is out of range for accumulation_steps=2; use 0 to 1"):
        local_microbatch(torch.arange(8), 0, 2, 2, 2)


def test_the_vocabulary_check_on_a_backend_without_the_device_assert(monkeypatch):
    """Where a backend has no kernel for torch._assert_async (CPU and CUDA have one), the range is checked on the
    host: the same refusal for an id past the vocabulary, nothing for ids and -100 labels inside it."""
    from plait.base.batches import check_token_range

    def missing(*args):
        raise NotImplementedError("no kernel for this backend")

    monkeypatch.setattr(torch, "_assert_async", missing)
    check_token_range(61, ids=torch.tensor([[0, 60]]), labels=torch.tensor([[-100, 60]]))
    with pytest.raises(RuntimeError, match=r"^token ids or labels outside the model's vocabulary of 61"):
        check_token_range(61, ids=torch.tensor([[0, 61]]))
