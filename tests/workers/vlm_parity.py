"""Worker: image-text-to-text models (issue 49) on the layouts that serve them, against one process.

Run as a world of 2: ``vlm_parity.py OUT.json``. For each model (a tiny LLaVA: CLIP vision tower, projector, Llama
decoder) and layout, a copy of the same model trains ``STEPS`` AdamW steps on the same global batches of image-text
rows (0, 1 or 2 images a row, image tokens never labelled) through ``ParallelModel.train_step(..., images=...)``;
the reference is transformers' model and torch's AdamW on the whole batch in this process. Rank 0 writes, per case,
each step's loss against the reference's, and the largest gradient error of any rank at any step in units of
1e-6 + 1e-5 |g| (the kit's tolerance), with the parameter names compared on some rank.
"""

from __future__ import annotations

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist

from plait import ConfigError
from plait.base.images import ImageBatch
from plait.testing.conformance_worker import Float64Throughout
from plait_transformers.vision_parity import (as_double, compare, padded, reference, sweep_config, tiny_batches,
                                              tiny_model, train)

STEPS, ROWS, TEXT = 3, 4, 6
# images of each row at each step: micro-batches and replicas with different counts, text-only rows, and at the last
# step a replica (rows 0 and 1 at dp=2) without any image, whose vision tower does not run; under ZeRO-2/3 (FSDP)
# every replica holds an image (FSDP_PER_ROW), the other batches are refused
PER_ROW = [[1, 2, 1, 1], [2, 0, 1, 2], [0, 0, 1, 2]]
FSDP_PER_ROW = [[1, 2, 1, 1], [2, 0, 1, 2], [1, 0, 0, 1]]
IMAGE_TOKENS = 16  # a 16x16 image in 4x4 patches, a token each (the "default" features: CLS dropped)
# name -> ParallelConfig kwargs (a world of 2)
LAYOUTS = {"tp2_sp": dict(tp=2), "tp2": dict(tp=2, sp=False), "dp2": dict(), "zero1_dp2": dict(zero_1=True),
           "zero2_dp2": dict(zero_stage=2), "zero3_dp2": dict(zero_stage=3),
           "dp2_microbatches": dict(num_microbatches=2),
           # the vision tower and projector on the first stage, the images riding with their rows' micro-batches
           "pp2": dict(pp=2, num_microbatches=2),
           "pp2_gpipe": dict(pp=2, num_microbatches=4, pipeline_schedule="gpipe"),
           # the image features merged into the whole sequence, each cp rank's text model on its slice of it
           "cp2": dict(cp=2, cp_attention="all-to-all"), "cp2_ring": dict(cp=2, cp_attention="ring")}
FSDP = ("zero2_dp2", "zero3_dp2")


def llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=96, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config)


def batches(image_token: int, images: list[list[int]]) -> list[tuple]:
    """Each step's rows: images (0, 1 or 2 a row, so micro-batches and replicas hold different counts) as
    IMAGE_TOKENS image tokens each, then text; labels on the text only, right-padded rows of one length."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        per_row = torch.tensor(images[step])
        seq = -(-(max(int(per_row.max()), 1) * IMAGE_TOKENS + TEXT) // 4) * 4  # cp=2 cuts it in 4 chunks
        ids = torch.full((ROWS, seq), 0)
        labels = torch.full((ROWS, seq), -100)
        for row, count in enumerate(per_row.tolist()):
            text = torch.randint(1, image_token, (TEXT,), generator=generator)
            ids[row, : count * IMAGE_TOKENS] = image_token
            ids[row, count * IMAGE_TOKENS: count * IMAGE_TOKENS + TEXT] = text
            labels[row, count * IMAGE_TOKENS: count * IMAGE_TOKENS + TEXT] = text
        pixels = torch.randn(int(per_row.sum()), 3, 16, 16, generator=generator)
        out.append((ids, labels, ImageBatch({"pixel_values": pixels}, per_row), (ids != 0).long()))
    return out


# more families, from the generic adapter's tiny image-text configs (plait_transformers.tiny_vision), on the layouts
# that tell the most apart: the language model split with SP, ZeRO-3's gathered vision tower, micro-batches, the
# pipeline (Gemma 3's token types and Qwen2-VL's grid positions reach the later stages) and cp (the language model
# on its slice, Idefics3's vision tower building its own masks, Qwen2-VL's grid positions cut); Gemma 3's image
# tokens attend both ways, which cp refuses. "qwen3_vl_deepstack": Qwen3-VL whose vision tower's layer 1 feeds
# visual tokens added after decoder layer 0 (deepstack), cut to each rank's slice under SP and cp; under pp the first
# stage must hold layer 0 and the next (the planned split gives it one: the cut is named)
# "llama4": its vision tower's attention split over tp (transformers' plan for it), which runs on whole images
# before the language model even under SP
# "llava_next": its image_newline, a parameter of the module holding the vision tower and the language model, on the
# first pipeline stage alone (PipelinePlan.first_params)
# "gemma4": its vision attention's projections wrapped (q_proj.linear) and split over tp; the language model's masks
# built by the model around it over the whole merged sequence, and its per-layer inputs made there from the embeddings
# with the image features, cut to each rank's slice under cp; refused under pp
TINY = ("idefics3", "gemma3", "qwen2_vl", "qwen3_vl_deepstack", "llama4", "llava_next", "gemma4")
TINY_LAYOUTS = tuple(LAYOUTS)  # every layout LLaVA runs
DEEPSTACK_LAYOUTS = {"pp2_cut": dict(pp=2, num_microbatches=2, pipeline_cuts=("model.language_model.layers.2",))}
TINY_CASES = [(model_type, layout) for model_type in TINY[:3] for layout in TINY_LAYOUTS
              if (model_type, layout) not in (("gemma3", "cp2"), ("gemma3", "cp2_ring"))] + [
              ("qwen3_vl_deepstack", layout) for layout in ("tp2_sp", "cp2", "pp2_cut")] + [("llama4", "tp2_sp"),
              ("llava_next", "pp2"), ("gemma4", "tp2_sp"), ("gemma4", "cp2"), ("gemma4", "cp2_ring")]


def tiny_config(name: str):
    from plait_transformers.tiny_vision import tiny_image_text_config

    if name in ("llama4", "llava_next"):  # named as a whole image-text checkpoint names itself
        return sweep_config(name)
    if name != "qwen3_vl_deepstack":
        return tiny_image_text_config(name)
    config = tiny_image_text_config("qwen3_vl")
    config.vision_config.deepstack_visual_indexes = [1]  # the tiny tower's last layer (its 8, 16, 24 do not exist)
    return config


def bidirectional(model, rows):
    """Gemma 4 as its larger checkpoints configure it: image tokens attending to each other both ways."""
    model = copy.deepcopy(model)
    model.config.get_text_config().use_bidirectional_attention = "vision"
    return model, rows


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    base = llava()
    data = {"mixed": batches(base.config.image_token_index, PER_ROW),
            "fsdp": batches(base.config.image_token_index, FSDP_PER_ROW)}
    expected = {kind: reference(base, rows) for kind, rows in data.items()}
    results = {"parameters": expected["mixed"]["trained"]}
    for name, layout in LAYOUTS.items():
        kind = "fsdp" if name in FSDP else "mixed"
        results[f"llava-{name}"] = compare(train(base, data[kind], layout), expected[kind])
    tiny = {}
    layouts = {**LAYOUTS, **DEEPSTACK_LAYOUTS}
    for model_type in TINY:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        model = tiny_model(config)
        rows = padded(tiny_batches(config, FSDP_PER_ROW), 4)  # cp=2 cuts a row in 4 chunks
        tiny[model_type] = (model, rows)
        wanted = reference(model, rows)
        results[f"{model_type}-parameters"] = wanted["trained"]
        # fp32's rounding, grown by Adam, moves some gradients past the tolerance (gemma3's at step 1 under SP);
        # float64 shows whether it is rounding: the same layouts there, at the same tolerance
        # float64 throughout (the conformance kit's mode: transformers' fp32 casts, Gemma 4's vision pooler's, too)
        model64, rows64 = copy.deepcopy(model).double(), as_double(rows)
        with Float64Throughout():
            wanted64 = reference(model64, rows64)
        for name in (layout for kind, layout in TINY_CASES if kind == model_type):
            results[f"{model_type}-{name}"] = compare(train(model, rows, layouts[name]), wanted)
            with Float64Throughout():
                results[f"{model_type}-{name}-float64"] = compare(train(model64, rows64, layouts[name]), wanted64)
    # refused on every rank before the forward: a replica without an image under ZeRO-3; Gemma 3's images under cp;
    # deepstack under pp where the first stage holds only the layer the visual tokens are added after
    for name, layout, (model, rows) in (("zero3_no_image", LAYOUTS["zero3_dp2"], (base, data["mixed"])),
                                        ("gemma3_cp2", LAYOUTS["cp2"], tiny["gemma3"]),
                                        ("qwen3_vl_deepstack_pp2", LAYOUTS["pp2"], tiny["qwen3_vl_deepstack"]),
                                        ("gemma4_pp2", LAYOUTS["pp2"], tiny["gemma4"]),
                                        ("gemma4_bidirectional_cp2", LAYOUTS["cp2"], bidirectional(*tiny["gemma4"]))):
        try:
            train(model, rows, layout)
            said = "not refused"
        except ConfigError as err:
            said = str(err)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, said)
        results[f"refused-{name}"] = everyone
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
