"""``plait train --method grpo`` with an image-text policy: TRL's vision prompt rows (chat ``prompt`` beside its
``images``), each prompt's images reaching the rollouts' decoding, the policy's and the reference's forwards.

Held to TRL: on fixed completions of a tiny LLaVA, plait's loss and every gradient equal GRPOTrainer's
``_compute_loss`` with the processor's pixels (the KL to the reference on, so the reference reads the images too).
Then every layout of one world of 2 (tp=2 with SP, dp=2, ZeRO-3, pp=2, cp=2, tp=2 with two optimizer steps a batch
of rollouts, LoRA at tp=2) gives one process's rollouts, losses and gradients; and what is refused is one line
before any process group.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vision_data import picture, save_tiny_llava, turn

from plait import ParallelConfig, parallelize
from plait.base.config import ConfigError
from plait.data.processors import load_processor
from plait.run.methods.dpo import Reference
from plait.run.methods.grpo import GRPO
from plait.run.methods.grpo_prompts import read_image_prompts
from plait.run.train_args import TrainArgs

REWARDS = '''
def length(prompts, completions, **columns):
    return [float(len(c[0]["content"])) for c in completions]


def pictures(prompts, completions, images, **columns):
    return [float(len(i)) + (1.0 if "a" in c[0]["content"] else 0.0) for c, i in zip(completions, images)]
'''
ROWS = [{"prompt": [{"role": "user", "content": "describe the picture"}], "images": ["0.png"]},
        {"prompt": [turn("user", None, "compare", None)], "images": ["1.png", "2.png"]},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what colour is it"}],
         "images": ["2.png"]}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo-vlm")
    save_tiny_llava(root)
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (root / "rewards.py").write_text(REWARDS)
    return root


def grpo_args(root, **flags) -> TrainArgs:
    base = dict(method="grpo", model_name_or_path=str(root / "model"), train_file=str(root / "prompts.jsonl"),
                reward_funcs=f"{root / 'rewards.py'}:length,{root / 'rewards.py'}:pictures", reward_weights="0.1,1.0",
                num_generations=2, per_device_train_batch_size=6, block_size=64, max_completion_length=6,
                temperature=0.7, beta=0.04, output_dir=str(root / "out"))
    return TrainArgs(**{**base, **flags})


def test_prompts_are_trls_multimodal_messages(files):
    """TRL's ``prepare_multimodal_messages`` on each row: the image parts where TRL puts them, holding the images the
    reward functions get; the ids are the processor's for that conversation with its generation prompt."""
    from PIL import Image
    from transformers import AutoProcessor
    from trl.data_utils import prepare_multimodal_messages

    processor = AutoProcessor.from_pretrained(files / "model")
    prompts = read_image_prompts(files / "prompts.jsonl", processor, 64)
    for prompt, row in zip(prompts, ROWS, strict=True):
        pictures = [Image.open(files / name) for name in row["images"]]
        theirs = prepare_multimodal_messages(row["prompt"], images=pictures)
        given, columns = prompt.for_rewards()  # the images read when the rewards are called, none kept before
        assert [[p["type"] for p in m["content"]] for m in given] == [[p["type"] for p in m["content"]] for m in theirs]
        assert columns["images"] is not row["images"] and prompt.columns["images"] == row["images"]
        got = [p["image"] for m in given for p in m["content"] if p["type"] == "image"]
        for kept in (got, columns["images"]):
            assert [np.asarray(g).tolist() for g in kept] == [np.asarray(p).tolist() for p in pictures]
        ids = processor.apply_chat_template([theirs], add_generation_prompt=True, tokenize=True, return_dict=True)
        assert prompt.ids == list(ids["input_ids"][0])  # as TRL's _tokenize_prompts
        assert prompt.example.num_images == len(pictures)


def trl_trainer(root, loss_type: str):
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=6, num_generations=2,
                        max_completion_length=6, beta=0.04, loss_type=loss_type, temperature=0.7, report_to="none",
                        use_cpu=True, epsilon_high=0.28, bf16=False)
    trainer = GRPOTrainer(model=AutoModelForImageTextToText.from_pretrained(root / "model"), args=config,
                          reward_funcs=[lambda prompts, completions, **kw: [0.0] * len(completions)],
                          train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}] * 3),
                          processing_class=load_processor(root / "model"))
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def step_matches_trls(root, loss_type: str, moved_part: str, noise: float = 0.05, kl_above: float = 1e-3) -> None:
    """One GRPO step of the image-text model in ``root`` on fixed completions: its loss, every gradient and its KL
    equal TRL's ``_compute_loss`` given the processor's image inputs, against a reference whose ``moved_part`` (the
    projector) differs (by ``noise`` times a normal draw), so that its log-probs read the images too, and the KL is
    above ``kl_above``."""
    from transformers import AutoModelForImageTextToText

    args = grpo_args(root, epsilon_high=0.28, loss_type=loss_type)
    args.validate()
    processor = load_processor(root / "model")
    tokenizer_ = processor.tokenizer
    prompts = read_image_prompts(root / "prompts.jsonl", processor, 58)
    model = AutoModelForImageTextToText.from_pretrained(root / "model")
    pmodel = parallelize(copy.deepcopy(model), ParallelConfig())
    moved = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for name, param in moved.named_parameters():
            if moved_part in name:
                param.add_(torch.randn(param.shape, generator=gen) * noise)
    reference = Reference(parallelize(copy.deepcopy(moved), ParallelConfig()))
    method = GRPO(prompts, args, tokenizer_, reference, torch.device("cpu"))
    [batch] = method.micro_batches(torch.arange(3), pmodel.mesh, 1, torch.device("cpu"))
    completions = torch.randint(3, 300, (6, 6), generator=torch.Generator().manual_seed(1))
    completions[0, 3], completions[3, 0] = tokenizer_.eos_token_id, tokenizer_.eos_token_id
    rows = [prompts[i] for i in range(3) for _ in range(2)]
    method.score_and_build([p.ids for p in rows], completions, rows)
    loss = method.micro_step(pmodel, batch, 6)

    trainer = trl_trainer(root, loss_type)
    trainer.ref_model.load_state_dict(moved.state_dict())
    r = method.rollouts
    width = r.ids.shape[1] - 6
    assert r.images.per_row.tolist() == [1, 1, 2, 2, 1, 1]  # each prompt's images, once a completion
    images = {key: value for key, value in r.images.tensors.items()}  # the processor's: pixels, grids, token types
    images["num_images"] = r.images.per_row.tolist()
    inputs = {"prompt_ids": r.ids[:, :width], "prompt_mask": r.mask[:, :width], "completion_ids": completions,
              "completion_mask": r.mask[:, width:], "advantages": r.advantages,
              "num_items_in_batch": r.mask[:, width:].sum(), **images}
    with torch.no_grad():
        inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, r.ids, r.mask, 6, **images)[0]
    expected = trainer._compute_loss(trainer.model, inputs)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    theirs = dict(trainer.model.named_parameters())
    vision = 0
    for name, param in pmodel.module.named_parameters():
        if theirs[name].grad is None:  # CLIP's post-layernorm: LLaVA reads the last layer's hidden states before it
            assert param.grad is None, name
            continue
        # measured: 6.9e-9 at most beyond rtol 1e-5 (LLaVA)
        assert torch.allclose(param.grad, theirs[name].grad, rtol=1e-5, atol=3e-8), name
        vision += ("vision_tower" in name or "visual" in name) and bool(param.grad.abs().sum() > 0)
    assert vision > 0  # the images reached the loss: the vision tower has gradients
    metrics = method.step_metrics(pmodel)
    found = trainer._metrics["train" if trainer.model.training else "eval"]["kl"][-1]
    assert metrics["kl"] == pytest.approx(found, rel=1e-4) and found > kl_above


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_step_on_fixed_completions_is_trls(files, loss_type):
    step_matches_trls(files, loss_type, "multi_modal_projector")


LAYOUTS = {"tp2_sp": dict(tensor_parallel_size=2), "dp2": dict(per_device_train_batch_size=3),
           # every prompt holds an image, so every micro-batch of every replica runs the vision tower
           "zero3_dp2": dict(per_device_train_batch_size=3, zero_stage=3),
           # the pixels to the first stage, for the rollouts' decoding and the loss's forward alike
           "pp2": dict(pipeline_parallel_size=2, num_microbatches=2),
           "cp2": dict(context_parallel_size=2, cp_attention="all-to-all"),
           # a second optimizer step on the rollouts: ratios to their log-probs as drawn, read with the images
           "tp2_sp_mu2": dict(tensor_parallel_size=2, num_iterations=2),
           # the reference is the policy with its adapters off, reading the same images
           "tp2_sp_lora": dict(tensor_parallel_size=2, lora_r=4)}
# 1e-3: at 1e-2 AdamW's first step (each weight moved by about the learning rate, whatever its gradient's size) grew
# fp32's reordering to 1.1e-5 relative in tp2_sp_mu2's second grad norm, past the bound; every step is still compared
RUN = dict(max_steps=2, learning_rate=1e-3, lr_scheduler_type="constant", device="cpu", save_final=False,
           loss_type="grpo")
KEYS = ("loss", "grad_norm", "reward", "reward_std", "rewards/pictures/mean", "completions/mean_length", "kl")


@pytest.fixture(scope="module")
def one_process(files, tmp_path_factory):
    from plait.run.trainer import Trainer
    from workers.trainers import capture_gradients, record_read_ahead, whole

    runs = {}
    for name, extra in (("full", {}), ("mu2", dict(num_iterations=2)), ("lora", dict(lora_r=4))):
        trainer = Trainer(grpo_args(files, output_dir=str(tmp_path_factory.mktemp(name)), **RUN, **extra))
        kept = capture_gradients(trainer)
        reading = record_read_ahead(trainer, "before_step", [p.example for p in trainer.method.prompts])
        runs[name] = (trainer.train(), whole([kept]))
        READ_AHEAD[name] = reading
    return runs


READ_AHEAD = {}  # by one-process run: at each step's generation, the prompts whose pixels were read during the last


def test_the_next_cycles_prompt_pixels_are_read_while_this_step_computes(one_process):
    """Each step's prompts are encoded for generation: their pixels are read during the step before (its prompts'
    pixels then taken, so nothing is left reading); within a cycle of --num_iterations 2, whose second step generates
    nothing, none are read."""
    assert READ_AHEAD["full"] == [set(), {0, 1, 2}] and READ_AHEAD["mu2"] == [set(), set()]


@pytest.fixture(scope="module")
def layouts(files, tmp_path_factory):
    from plait.testing import launch

    out = tmp_path_factory.mktemp("layouts")
    cases = {name: {**grpo_args(files, output_dir=str(out / name), **RUN, **layout).__dict__}
             for name, layout in LAYOUTS.items()}
    (out / "flags.json").write_text(json.dumps(cases))
    worker = str(Path(__file__).parent / "workers" / "trainers.py")
    launch([worker, str(out / "runs.json"), str(out / "flags.json")], 2, timeout=300)
    runs = json.loads((out / "runs.json").read_text())
    return {name: (records, torch.load(out / f"{name}.grads.pt")) for name, records in runs.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_one_process_rollouts_losses_and_gradients(one_process, layouts, layout):
    from workers.trainers import assert_gradients_agree

    history, grads = one_process["mu2" if layout.endswith("mu2") else "lora" if layout.endswith("lora") else "full"]
    assert all(r["grad_norm"] > 1e-3 and r["reward_std"] > 0 for r in history)  # the groups' rewards differ
    records, got_grads = layouts[layout]
    for rank, record in enumerate(records):
        for got, expected in zip(record["history"], history, strict=True):
            for key in KEYS:  # the same completions (rewards, lengths), then the loss and its gradient
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (rank, got["step"], key)
    assert sorted(got_grads) == sorted(grads)
    assert_gradients_agree(got_grads, grads)
    if not layout.endswith("lora"):  # LoRA trains the language model's projections alone (its default targets)
        assert any("vision_tower" in name and reference.abs().sum() > 0 for name, reference in grads.items())


@pytest.mark.parametrize("rows, flags, message", [
    ([{"prompt": "describe it", "images": ["0.png"]}], {},
     r"prompts.jsonl:1: a prompt string with images; an image-text prompt is chat messages"),
    ([{"prompt": [turn("user", None, "describe")], "images": ["0.png", "1.png"]}], {},
     r"prompts.jsonl:1: 2 images for 1 image parts in its messages"),
    ([{"prompt": [{"role": "user", "content": "describe"}], "images": ["0.png"]},
      {"prompt": [{"role": "user", "content": "hello"}]}], dict(zero_stage=3, per_device_train_batch_size=3),
     r"prompts.jsonl:2: a prompt without an image, under --zero_stage 3, where every micro-batch of every replica "
     r"needs one"),
    ([{"prompt": [{"role": "user", "content": "describe"}], "images": ["missing.png"]}], {},
     r"prompts.jsonl:1: images\[0\] \(.*missing.png\) cannot be read"),
])
def test_bad_prompts_are_one_line_before_any_process_group(files, tmp_path, rows, flags, message):
    from plait.run.trainer import check_before_launch

    for seed in range(2):
        picture(seed).save(tmp_path / f"{seed}.png")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = grpo_args(files, train_file=str(tmp_path / "prompts.jsonl"), **flags)
    args.validate()
    with pytest.raises(ConfigError, match=message):
        check_before_launch(args, 2)


def test_the_image_column_is_trls_too(files, tmp_path):
    """TRL's one-image column ``image``: the image part before the text, the column a PIL image for the rewards."""
    from transformers import AutoProcessor

    picture(0).save(tmp_path / "0.png")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "describe"}],
                                                        "image": "0.png"}) + "\n")
    [prompt] = read_image_prompts(tmp_path / "prompts.jsonl", AutoProcessor.from_pretrained(files / "model"), 64)
    given, columns = prompt.for_rewards()
    assert [p["type"] for p in given[0]["content"]] == ["image", "text"]
    assert np.asarray(columns["image"]).tolist() == np.asarray(picture(0)).tolist()
    assert prompt.example.num_images == 1


def consolidated_processor(out: Path, checkpoint: str = "checkpoint-1", load=None) -> object:
    """The run's ``checkpoint`` consolidated (``plait consolidate``) and its processor read back as transformers reads
    it (or by ``load``)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from plait.cli import main

    main(["consolidate", str(out / checkpoint), str(out / "hf")])
    AutoModelForImageTextToText.from_pretrained(out / "hf")
    return (load or AutoProcessor.from_pretrained)(out / "hf")


def test_the_checkpoint_ships_the_processor(files, tmp_path):
    """A checkpoint of an image-text GRPO run saves the model's processor beside the weights (its image processor and
    template: it held the tokenizer alone, so the consolidated model's AutoProcessor was a tokenizer and plait
    generate refused the directory), as vision SFT's does."""
    from plait.run.trainer import Trainer

    Trainer(grpo_args(files, output_dir=str(tmp_path), **{**RUN, "max_steps": 1, "save_final": True})).train()
    processor = consolidated_processor(tmp_path)
    assert type(processor).__name__ == "LlavaProcessor" and processor.image_token == "<image>"
