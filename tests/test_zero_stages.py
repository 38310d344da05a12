"""ZeRO-2/3 (FSDP2) through `plait train`: one-process losses, layout-free checkpoints that resume at tp=2 and at
ZeRO-1 and consolidate, bf16 compute from fp32 shards with accumulation, LoRA on a sharded frozen base.

Parity of gradients and parameters step by step is tests/test_optim.py's (the optimizer worker) and the
conformance kit's (zero*-dp2 modes); this module proves the trainer's paths: meta build, materialising into the
shards, saving them, and reading them back at other layouts.
"""

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
    path.write_text(tiny_config("llama", vocab_size=300).to_json_string())
    return str(path)


def flags(model_config: str, out, *extra: str, batch: int = 4, steps: int = 4) -> list[str]:
    return ["--model_config", model_config, "--output_dir", str(out), "--max_steps", str(steps), "--block_size", "16",
            "--per_device_train_batch_size", str(batch), "--save_steps", "2", "--lr_scheduler_type", "constant",
            "--max_grad_norm", "0.5", *extra]  # clipping that bites: the tiny model's norm is ~1.2


def losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


@pytest.fixture(scope="module")
def validation(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("val") / "val.txt"
    # 371 tokens: 23 blocks of 16, an odd count: the dp ranks evaluate them all, one of dp=2's padded with a row
    # without labels (the last block was left out: dp=2's eval loss was 5.712730 to one process's 5.713709)
    path.write_text("to be or not to be, that is the question " * 16)
    return ["--validation_file", str(path), "--eval_steps", "2"]


@pytest.fixture(scope="module")
def straight(model_config, validation, tmp_path_factory):
    """4 steps in one process, evaluating and saving at 2 and 4."""
    out = tmp_path_factory.mktemp("straight")
    main(["train", *flags(model_config, out, *validation)])
    return out, read_metrics(out)


def test_zero3_resumes_at_tp2_and_at_zero1_and_consolidates(model_config, straight, validation, tmp_path):
    """Stage 3 at dp=2 (the same global batch of 4) follows one process with clipping, and evaluates at step 2 as it
    does, just before saving (a forward without backward leaves FSDP2's gathered copies registered: the save
    failed after one); its checkpoint (the same layout-free index) resumes at tp=2, at ZeRO-1 dp=2 and at stage 3
    dp=4 with the one-process losses, and consolidates to the one-process weights. A one-process checkpoint resumes
    into stage 3 too."""
    one_dir, records = straight
    ref = [r["loss"] for r in records]
    grad_norms = [r["grad_norm"] for r in records]
    assert min(grad_norms) > 0.5, f"clipping never bites: {grad_norms}"
    z3 = tmp_path / "z3"
    output = launch(["-m", "plait", "train", *flags(model_config, z3, "--zero_stage", "3", *validation, batch=2,
                                                    steps=2)], 2, timeout=240)
    assert "zero=3" in " ".join(output[0].split())
    assert losses(z3) == pytest.approx(ref[:2], rel=1e-5)
    assert read_metrics(z3)[1]["eval_loss"] == pytest.approx(records[1]["eval_loss"], rel=1e-5)
    for name, layout, world in (("tp2", ("--tensor_parallel_size", "2"), 2), ("zero1", ("--zero_1",), 2),
                                ("zero3-dp4", ("--zero_stage", "3"), 4)):
        batch = 4 if name == "tp2" else 4 // world  # the same global batch of 4
        output = launch(["-m", "plait", "train", *flags(model_config, tmp_path / name, *layout,
                                                         "--resume_from_checkpoint", str(z3 / "checkpoint-2"),
                                                         batch=batch)], world, timeout=240)
        assert "(resharded)" in output[0], name  # zero1: the same ranks, the tensors held otherwise
        assert [r["step"] for r in read_metrics(tmp_path / name)] == [3, 4]
        assert losses(tmp_path / name) == pytest.approx(ref[2:], rel=1e-5), name
    into = tmp_path / "into-z3"
    launch(["-m", "plait", "train", *flags(model_config, into, "--zero_stage", "3", "--resume_from_checkpoint",
                                            str(one_dir / "checkpoint-2"), batch=2)], 2, timeout=240)
    assert losses(into) == pytest.approx(ref[2:], rel=1e-5)

    from transformers import AutoModelForCausalLM

    main(["consolidate", str(z3 / "checkpoint-2"), str(tmp_path / "hf-z3")])
    main(["consolidate", str(one_dir / "checkpoint-2"), str(tmp_path / "hf-one")])
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-z3")
    for name, param in AutoModelForCausalLM.from_pretrained(tmp_path / "hf-one").named_parameters():
        torch.testing.assert_close(sharded.get_parameter(name), param, rtol=1e-5, atol=1e-6)


def test_zero2_bf16_with_accumulation_follows_fp32(model_config, straight, tmp_path):
    """Stage 2 with --bf16 (FSDP2 gathers bf16 copies of fp32 shards) over 2 accumulation steps of 1 sequence per
    rank: the fp32 one-process curve within bf16's 2e-2, the layout line saying what runs."""
    _, records = straight
    argv = flags(model_config, tmp_path, "--zero_stage", "2", "--bf16", "--gradient_accumulation_steps", "2",
                 "--save_steps", "0", batch=1, steps=2)
    output = launch(["-m", "plait", "train", *argv], 2, timeout=240)
    assert losses(tmp_path) == pytest.approx([r["loss"] for r in records[:2]], rel=2e-2)
    assert "zero=2 bf16 (fp32 masters)" in " ".join(output[0].split())


def test_lora_on_a_zero3_base(model_config, tmp_path):
    """LoRA with the frozen base sharded by stage 3: the adapters train (the same losses as LoRA in one process)
    and its checkpoint consolidates to the peft adapter one process writes."""
    lora = ("--lora_r", "4", "--learning_rate", "1e-2")
    main(["train", *flags(model_config, tmp_path / "one", *lora, steps=2)])
    launch(["-m", "plait", "train", *flags(model_config, tmp_path / "z3", *lora, "--zero_stage", "3", batch=2,
                                            steps=2)], 2, timeout=240)
    assert losses(tmp_path / "z3") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert losses(tmp_path / "z3")[1] < losses(tmp_path / "z3")[0]
    from safetensors.torch import load_file

    adapters = {}
    for name in ("one", "z3"):
        main(["consolidate", str(tmp_path / name / "checkpoint-2"), str(tmp_path / f"peft-{name}"), "--lora", "adapter"])
        adapters[name] = load_file(tmp_path / f"peft-{name}" / "adapter_model.safetensors")
    assert adapters["z3"].keys() == adapters["one"].keys() and adapters["one"]
    for key, tensor in adapters["one"].items():
        torch.testing.assert_close(adapters["z3"][key], tensor, rtol=1e-5, atol=1e-6)


def test_interleaved_pipeline_with_zero3(tmp_path):
    """pp=2 x 2 virtual stages (interleaved 1F1B) x ZeRO-3 over dp=2: each rank's two stage shells share one FSDP2
    root, and the run follows one process."""
    path = tmp_path / "config.json"
    path.write_text(tiny_config("llama", vocab_size=300, num_hidden_layers=4).to_json_string())
    main(["train", *flags(str(path), tmp_path / "one", "--save_steps", "0", steps=2)])
    pipeline = ("--pipeline_parallel_size", "2", "--virtual_pipeline_size", "2", "--pipeline_schedule",
                "interleaved-1f1b", "--num_microbatches", "2", "--zero_stage", "3", "--save_steps", "0")
    launch(["-m", "plait", "train", *flags(str(path), tmp_path / "z3", *pipeline, batch=2, steps=2)], 4, timeout=240)
    assert losses(tmp_path / "z3") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)


def test_a_model_directory_loads_straight_into_the_zero3_rows(tmp_path):
    """Each rank of a dp=2 ZeRO-3 run reads only its rows of each tensor of a from_pretrained directory (half the
    model, to within a row per tensor), and holds exactly those rows."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=300)).save_pretrained(tmp_path / "hf")
    worker = Path(__file__).parent / "workers" / "zero3_load.py"
    launch([str(worker), str(tmp_path / "hf"), str(tmp_path / "out.json")], 2, timeout=240)
    ranks = json.loads((tmp_path / "out.json").read_text())
    for rank in ranks:
        assert not rank["mismatched"], rank
        assert rank["read"] <= rank["total"] / 2 + 64 * 32, rank  # a 64-element row per tensor at most
    assert sum(r["read"] for r in ranks) == ranks[0]["total"]


@pytest.mark.parametrize("layout, message", [
    (dict(zero_stage=4), "zero_stage=4 must be 0, 1, 2 or 3"),
    (dict(zero_1=True, zero_stage=3), "zero_1=True is ZeRO stage 1 but zero_stage=3"),
    (dict(zero_stage=1, mixed_precision=True), "mixed_precision=True is FSDP2's bf16 compute, which needs zero_stage 2"),
    (dict(zero_stage=2, pp=2, num_microbatches=2, virtual_pipeline_size=1, pipeline_schedule="zero-bubble"),
     "zero_stage=2 with pipeline_schedule='zero-bubble'"),
])
def test_what_zero_stages_do_not_run_is_refused_before_any_process_group(layout, message):
    """Refused in one line naming the values and the fix, from the config or the plan on the meta model."""
    from plait import ConfigError, ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.layout_plan import plan_layout

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_layout(build_meta_model(tiny_config("llama")), ParallelConfig(**layout), 4)


def test_a_block_shared_by_layers_is_refused_under_zero3():
    """Zamba2's transformer block is shared by several decoder layers: FSDP2 shards a parameter in one unit, so
    ZeRO-2/3 is refused naming the layers and the parameter (the search checks the same before ranking)."""
    from plait import ConfigError, ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.layout_plan import plan_layout
    from plait.testing.conformance_modes import load_subject

    subject = load_subject("transformers:zamba2")
    model = build_meta_model(subject.config)
    with pytest.raises(ConfigError, match=r"zero_stage=3: one parameter is used by model\.layers\.\d+ \(as .*shared"):
        plan_layout(model, ParallelConfig(zero_stage=3), 2, subject.registry)
    plan_layout(model, ParallelConfig(zero_stage=1), 2, subject.registry)  # ZeRO-1 shards state, not parameters
