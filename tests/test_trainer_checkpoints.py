"""`plait train` with checkpoints: exact resume, 'auto', resharding on resume, load-only runs, rotation, and
`plait consolidate` to a model and tokenizer transformers loads."""

from __future__ import annotations


import pytest
import torch

from plait.cli import main
from plait.run.metrics import read_metrics
from plait.testing import launch
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama", vocab_size=300).to_json_string())  # 300: room for a BPE tokenizer
    return str(path)


def flags(model_config: str, out, *extra: str) -> list[str]:
    return ["--model_config", model_config, "--output_dir", str(out), "--max_steps", "4", "--block_size", "16",
            "--per_device_train_batch_size", "4", "--save_steps", "2", "--lr_scheduler_type", "constant", *extra]


def run(argv: list[str]) -> list[dict]:
    main(["train", *argv])
    return read_metrics(argv[argv.index("--output_dir") + 1])


@pytest.fixture(scope="module")
def straight(model_config, tmp_path_factory):
    """4 steps straight through, saving at steps 2 and 4 (single process)."""
    out = tmp_path_factory.mktemp("straight")
    return out, run(flags(model_config, out))


def test_exact_resume_is_bit_identical(model_config, straight, tmp_path):
    out, records = straight
    resumed = run(flags(model_config, tmp_path, "--resume_from_checkpoint", str(out / "checkpoint-2")))
    assert [r["step"] for r in resumed] == [3, 4]  # only the steps after the checkpoint are recomputed
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records[2:]]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in records[2:]]


def test_a_longer_run_resumes_on_its_own_schedule(model_config, tmp_path):
    """A linear schedule's checkpoint resumes bit for bit at the same --max_steps (the lr recomputed at the step
    is the one saved), and under a longer --max_steps each resumed step takes that schedule's lr: the saved lr
    of a 4-step schedule's end was 0, and the first resumed step trained at it."""
    linear = ("--lr_scheduler_type", "linear", "--learning_rate", "0.01")
    records = run(flags(model_config, tmp_path / "four", *linear))
    resumed = run(flags(model_config, tmp_path / "again", *linear, "--resume_from_checkpoint",
                        str(tmp_path / "four" / "checkpoint-2")))
    assert [(r["loss"], r["lr"]) for r in resumed] == [(r["loss"], r["lr"]) for r in records[2:]]
    longer = flags(model_config, tmp_path / "eight", *linear, "--resume_from_checkpoint",
                   str(tmp_path / "four" / "checkpoint-4"))
    longer[longer.index("--max_steps") + 1] = "8"
    assert [r["lr"] for r in run(longer)] == pytest.approx([0.01 * (8 - step) / 8 for step in range(4, 8)], rel=1e-6)


def test_auto_resume_at_tp2_and_reshard_to_tp1(model_config, straight, tmp_path):
    """tp=2 trains 2 steps; 'auto' resumes it at tp=2 for 2 more; the same checkpoint resumed at tp=1
    continues with the same losses (resharded)."""
    _, records = straight
    first = flags(model_config, tmp_path / "tp2", "--tensor_parallel_size", "2")
    first[first.index("--max_steps") + 1] = "2"
    launch(["-m", "plait", "train", *first], 2, timeout=240)
    launch(["-m", "plait", "train", *flags(model_config, tmp_path / "tp2", "--tensor_parallel_size", "2",
                                            "--resume_from_checkpoint", "auto")], 2, timeout=240)
    tp2 = read_metrics(tmp_path / "tp2")
    assert [r["step"] for r in tp2] == [1, 2, 3, 4]
    assert [r["loss"] for r in tp2] == pytest.approx([r["loss"] for r in records], rel=1e-5)
    resharded = run(flags(model_config, tmp_path / "tp1", "--resume_from_checkpoint",
                          str(tmp_path / "tp2" / "checkpoint-2")))
    assert [r["loss"] for r in resharded] == pytest.approx([r["loss"] for r in records[2:]], rel=1e-5)


def test_max_steps_0_only_loads(model_config, straight, tmp_path):
    out, _ = straight
    argv = flags(model_config, tmp_path, "--resume_from_checkpoint", str(out / "checkpoint-4"))
    argv[argv.index("--max_steps") + 1] = "0"
    assert run(argv) == []
    (load,) = read_metrics(tmp_path, event="load")
    assert load["step"] == 4 and load["load_seconds"] > 0 and load["peak_rss_mb"] > 0
    assert not list(tmp_path.glob("checkpoint-*"))


def test_save_total_limit_keeps_newest(model_config, tmp_path):
    run(flags(model_config, tmp_path, "--save_total_limit", "1", "--save_steps", "1"))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]


def test_consolidated_model_and_tokenizer_load_in_transformers(model_config, straight, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, records = straight
    main(["consolidate", str(out / "checkpoint-4"), str(tmp_path / "hf")])
    assert "from_pretrained" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("ROMEO: good morrow", return_tensors="pt").input_ids
    assert ids.max() < model.config.vocab_size
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] == ids.shape[1] + 5


def test_a_run_a_teacher_and_a_reference_start_from_a_checkpoints_weights(model_config, straight, tmp_path):
    """--model_name_or_path, and a frozen second model (KD's teacher, DPO's reference), from a plait checkpoint: its
    weights, as from the directory it consolidates to. They were only allocated (NaN at step 1, an audit); a LoRA
    checkpoint is refused (its adapters need their base: resumed, or consolidated --lora merged)."""
    import types

    from plait import ParallelConfig
    from plait.checkpoint.materialize import load_parallel_model
    from plait.run.methods.frozen import frozen_on_mesh

    out, _ = straight
    main(["consolidate", str(out / "checkpoint-4"), str(tmp_path / "hf")])
    start = ["--max_steps", "1", "--block_size", "16", "--per_device_train_batch_size", "4", "--no_save_final"]
    losses = [run(["--model_name_or_path", str(source), "--output_dir", str(tmp_path / name), *start])[0]["loss"]
              for name, source in (("from-checkpoint", out / "checkpoint-4"), ("from-hf", tmp_path / "hf"))]
    assert losses[0] == losses[1] and losses[0] < 10, losses
    trained = load_parallel_model(tmp_path / "hf", ParallelConfig())
    teacher = frozen_on_mesh(out / "checkpoint-4", types.SimpleNamespace(bf16=False, ddp_timeout=60, seed=1), trained,
                             torch.device("cpu"))
    for (name, mine), (_, theirs) in zip(teacher.named_parameters(), trained.named_parameters(), strict=True):
        assert torch.equal(mine, theirs), name


def test_resume_missing_checkpoint_is_refused(model_config, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", *flags(model_config, tmp_path / "out", "--resume_from_checkpoint", str(tmp_path / "nope"))])
    assert "--resume_from_checkpoint" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_weight_decay_groups_agree_across_layouts_and_reshard(model_config, tmp_path):
    """--weight_decay decays matrices only (biases and norms never): the groups are the same under ZeRO-1 at
    dp=2 as in one process (same losses), the checkpoint records them, and a ZeRO-1 checkpoint resumes at
    tp=2 with the one-process losses."""
    from plait.checkpoint.format import read_index

    decay = ("--weight_decay", "0.5", "--learning_rate", "1e-2")
    one = run(flags(model_config, tmp_path / "one", *decay))
    zero = flags(model_config, tmp_path / "zero", *decay, "--zero_1")
    zero[zero.index("--max_steps") + 1] = "2"
    zero[zero.index("--per_device_train_batch_size") + 1] = "2"  # dp=2: the same global batch of 4
    launch(["-m", "plait", "train", *zero], 2, timeout=240)
    groups = read_index(tmp_path / "zero" / "checkpoint-2")[1].optimizer["groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    launch(["-m", "plait", "train", *flags(model_config, tmp_path / "tp2", *decay, "--tensor_parallel_size", "2",
                                            "--resume_from_checkpoint", str(tmp_path / "zero" / "checkpoint-2"))],
           2, timeout=240)
    losses = [r["loss"] for r in read_metrics(tmp_path / "zero")] + [r["loss"] for r in read_metrics(tmp_path / "tp2")]
    assert losses == pytest.approx([r["loss"] for r in one], rel=1e-5)


def test_cp2_zero1_run_resumes_at_tp2(model_config, straight, tmp_path):
    """Context parallelism through the trainer: cp=2 with ZeRO-1 (optimizer state sharded over the cp pair)
    gives the one-process losses, and its checkpoint (layout-free) resumes at tp=2 with the same losses."""
    _, records = straight
    first = flags(model_config, tmp_path / "cp2", "--context_parallel_size", "2", "--zero_1")
    first[first.index("--max_steps") + 1] = "2"
    launch(["-m", "plait", "train", *first], 2, timeout=240)
    cp2 = read_metrics(tmp_path / "cp2")
    assert [r["loss"] for r in cp2] == pytest.approx([r["loss"] for r in records[:2]], rel=1e-5)
    from plait.checkpoint.format import read_index

    ranks = read_index(tmp_path / "cp2" / "checkpoint-2")[1].ranks
    assert [r["cp_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["rng"]["torch"] != ranks[1]["rng"]["torch"], "cp ranks share one dropout stream"
    # consolidated like any checkpoint: the one-process run's weights at the same step
    from transformers import AutoModelForCausalLM

    main(["consolidate", str(tmp_path / "cp2" / "checkpoint-2"), str(tmp_path / "hf-cp2")])
    main(["consolidate", str(straight[0] / "checkpoint-2"), str(tmp_path / "hf-one")])
    cp_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-cp2")
    one = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-one")
    for name, param in one.named_parameters():
        torch.testing.assert_close(cp_model.get_parameter(name), param, rtol=1e-5, atol=1e-6)
    launch(["-m", "plait", "train", *flags(model_config, tmp_path / "tp2", "--tensor_parallel_size", "2",
                                            "--resume_from_checkpoint", str(tmp_path / "cp2" / "checkpoint-2"))],
           2, timeout=240)
    resumed = read_metrics(tmp_path / "tp2")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records[2:]], rel=1e-5)


def test_cp2_bf16_with_accumulation_follows_fp32(model_config, straight, tmp_path):
    """cp=2 with bf16 parameters (fp32 masters), the global batch of 4 as 2 x 2 accumulation steps: the fp32
    one-process curve within bf16's 2e-2 (as test_train_cli's bf16 check), the strategy printed."""
    _, records = straight
    argv = flags(model_config, tmp_path, "--context_parallel_size", "2", "--bf16", "--gradient_accumulation_steps",
                 "2", "--save_steps", "0")
    argv[argv.index("--per_device_train_batch_size") + 1] = "2"
    argv[argv.index("--max_steps") + 1] = "2"
    output = launch(["-m", "plait", "train", *argv], 2, timeout=240)
    assert [r["loss"] for r in read_metrics(tmp_path)] == pytest.approx([r["loss"] for r in records[:2]], rel=2e-2)
    layout = " ".join(output[0].split())  # the console wraps long lines
    assert "cp=2 (auto)" in layout and "cp attention all-to-all" in layout


# -- --save_async: checkpoints written in the background --------------------------------------------------------

def tensors_of(checkpoint) -> dict[tuple[str, str], torch.Tensor]:
    """Every tensor of a checkpoint's shard files, by (file, key)."""
    from safetensors.torch import load_file

    return {(f.name, key): t for f in sorted((checkpoint / "shards").glob("*.safetensors"))
            for key, t in load_file(f).items()}


def assert_same_tensors(checkpoint, expected) -> None:
    mine, theirs = tensors_of(checkpoint), tensors_of(expected)
    assert mine.keys() == theirs.keys() and mine
    for key, tensor in mine.items():
        assert torch.equal(tensor, theirs[key]), key


def test_async_saves_are_the_synchronous_ones_and_a_crash_mid_write_keeps_the_previous(model_config, straight,
                                                                                         tmp_path):
    """--save_async writes the same checkpoints, bit for bit, as a synchronous save at the same steps. A rank killed
    while the background writes step 4's (PLAIT_FAULT_INJECT's write phase: before its files) leaves checkpoint-2
    the newest, and 'auto' resumes from it to the uninterrupted losses. At tp=2 the background's collectives run on
    a gloo group of their own beside the training's."""
    from plait.checkpoint import list_checkpoints
    from plait.testing.launcher import WorkerFailure

    out, records = straight
    async_out = tmp_path / "async"
    launch(["-m", "plait", "train", *flags(model_config, async_out, "--save_async")], 1, timeout=240)
    assert [r["loss"] for r in read_metrics(async_out)] == [r["loss"] for r in records]
    for step in (2, 4):
        assert_same_tensors(async_out / f"checkpoint-{step}", out / f"checkpoint-{step}")

    crashed = tmp_path / "crashed"
    with pytest.raises(WorkerFailure, match="killed|-9|SIGKILL"):
        launch(["-m", "plait", "train", *flags(model_config, crashed, "--save_async")], 1, timeout=240,
               env={"PLAIT_FAULT_INJECT": "0:4:kill:write"})
    assert list_checkpoints(crashed) == [crashed / "checkpoint-2"]
    assert_same_tensors(crashed / "checkpoint-2", out / "checkpoint-2")
    resumed = run(flags(model_config, crashed, "--save_async", "--resume_from_checkpoint", "auto"))[-2:]
    assert [r["step"] for r in resumed] == [3, 4] and [r["loss"] for r in resumed] == [r["loss"] for r in records[2:]]
    assert_same_tensors(crashed / "checkpoint-4", out / "checkpoint-4")

    tp2 = tmp_path / "tp2"
    launch(["-m", "plait", "train", *flags(model_config, tp2, "--save_async", "--tensor_parallel_size", "2")], 2,
           timeout=240)
    assert [r["loss"] for r in read_metrics(tp2)] == pytest.approx([r["loss"] for r in records], rel=1e-5)
    assert list_checkpoints(tp2) == [tp2 / "checkpoint-2", tp2 / "checkpoint-4"]


def test_a_failed_background_write_stops_the_run_at_the_next_step(model_config, tmp_path, monkeypatch, capsys):
    """A background write that fails (here injected before step 4's files) ends the run in one line at the end of
    a step soon after, not at the next save or the end of the run: the previous code trained all 8 steps and only
    then said that checkpoint-4 was lost."""
    monkeypatch.setenv("PLAIT_FAULT_INJECT", "0:4:raise:write")
    argv = flags(model_config, tmp_path, "--save_async")
    argv[argv.index("--max_steps") + 1], argv[argv.index("--save_steps") + 1] = "8", "4"
    with pytest.raises(SystemExit):
        run(argv)
    assert "plait: error: InjectedFault: injected fault on rank 0 at step 4" in capsys.readouterr().err
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == list(range(1, len(steps) + 1)) and 4 <= len(steps) <= 5, steps
    assert not (tmp_path / "checkpoint-4").exists()


def test_the_host_copy_shares_no_memory_with_training():
    """What an asynchronous save writes is a copy: the next step may change the weights and the optimizer state at
    once. Its bytes are the tensors this rank writes (here all of them: one process)."""
    from transformers import LlamaForCausalLM

    from plait import ParallelConfig, parallelize
    from plait.checkpoint.save import prepare_save
    from plait.optim import OptimizerStep, build_optimizer

    config = tiny_config("llama")
    pmodel = parallelize(LlamaForCausalLM(config), ParallelConfig())
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    pmodel(ids, labels=ids).backward()
    OptimizerStep(pmodel.grad_sync, optimizer)()
    pending = prepare_save("unused", pmodel, optimizer, step=1)
    live = [*pmodel.parameters(), *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    before = {id(t): t.tensor.clone() for t in pending.tensors}
    expected = sum(t.tensor.numel() * t.tensor.element_size() for t in pending.tensors)
    assert pending.host_copy() == expected > 0
    live_storage = {t.untyped_storage().data_ptr() for t in live}
    assert not {t.tensor.untyped_storage().data_ptr() for t in pending.tensors} & live_storage
    assert all(torch.equal(t.tensor, before[id(t)]) for t in pending.tensors)
    # the next save copies into the previous one's host tensors (written out by then): the new values, no new memory
    pmodel(ids, labels=ids).backward()
    OptimizerStep(pmodel.grad_sync, optimizer)()
    again = prepare_save("unused", pmodel, optimizer, step=2)
    fresh = {t.logical: t.tensor.clone() for t in again.tensors}
    assert again.host_copy([t.tensor for t in pending.tensors]) == expected
    assert [t.tensor.data_ptr() for t in again.tensors] == [t.tensor.data_ptr() for t in pending.tensors]
    assert all(torch.equal(t.tensor, fresh[t.logical]) for t in again.tensors)
    assert any(not torch.equal(t.tensor, before[id(old)]) for t, old in zip(again.tensors, pending.tensors))


def test_save_async_without_save_steps_is_refused(model_config, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model_config", model_config, "--output_dir", str(tmp_path), "--save_async"])
    assert exit_info.value.code == 2
    assert "--save_async overlaps a checkpoint's writing" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16-masters"])
def test_plan_gives_the_host_memory_an_async_save_copies(model_config, tmp_path, capsys, precision):
    """``plait plan --save_async`` names the host memory a save holds: the bytes the trainer's host copy takes
    (here one process, which writes everything: parameters, and with --bf16 the fp32 masters beside them)."""
    import json

    from plait.checkpoint.save import prepare_save
    from plait.costs.render import gib
    from plait.run.train_args import TrainArgs
    from plait.run.trainer import Trainer

    shape = ["--block_size", "16", "--per_device_train_batch_size", "2", *precision]
    main(["plan", "--model_config", model_config, *shape, "--json"])
    planned = json.loads(capsys.readouterr().out)["ranks"][0]["checkpoint_bytes"]
    main(["plan", "--model_config", model_config, *shape, "--save_async", "--save_steps", "2"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("--save_async:"))
    assert f"copies up to {gib(planned)} per rank to host memory" in line, line
    trainer = Trainer(TrainArgs(model_config=model_config, block_size=16, per_device_train_batch_size=2,
                                output_dir=str(tmp_path), max_steps=1, bf16=bool(precision)))
    trainer.step(0)
    pending = prepare_save(tmp_path / "checkpoint-1", trainer.pmodel, trainer.optimizer, trainer.scheduler, 1)
    assert pending.host_copy() == planned
