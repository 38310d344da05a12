"""Worker: ``ParallelModel.generate`` with images (plait.generation.images) on the layouts that serve it, against one
process (tests/test_vlm_generate.py). Run as a world of 2: ``vlm_generate.py OUT.json``.

For each model and layout every rank lays a copy of the same tiny image-text model out and completes the same
left-padded prompts (1, 0, 2 and 1 images: a replica of dp=2 with a text-only prompt beside an image one):
greedily, against transformers' ``generate`` on the plain model with the same pixels; sampled, against plait's
decoding loop (``decode``) run on the plain model in this process with the images in its first forward. Then what
generation refuses, on every rank before any collective. Rank 0 writes one JSON.
"""

from __future__ import annotations

import copy
import datetime
import inspect
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import plait  # noqa: E402
from plait.base import comm  # noqa: E402
from plait.base.images import ImageBatch, grid_position_ids  # noqa: E402
from plait.generation.decode import decode, drop_pads  # noqa: E402
from plait.generation.images import PromptImages  # noqa: E402
from plait_transformers.tiny_vision import image_text_batch  # noqa: E402
from plait_transformers.vision_parity import tiny_model  # noqa: E402
from tiny_models import tiny_model as tiny_text_model  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from workers.vlm_parity import llava, tiny_config  # noqa: E402

NEW, PAD, EOS = 6, 0, 7  # EOS: transformers reads a None as the generation config's own
PER_ROW = [1, 0, 2, 1]
SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9, seed=5)
LAYOUTS = {"tp2_sp": dict(tp=2), "tp2": dict(tp=2, sp=False), "dp2": dict(), "zero1_dp2": dict(zero_1=True),
           "zero3_dp2": dict(zero_stage=3), "cp2": dict(cp=2),
           # each micro-batch's images to its prompts' forward: the pixels on the first stage, token types on both
           "pp2": dict(pp=2, num_microbatches=2),
           "ep2": dict(ep=2),  # an image-text MoE's experts split (Qwen3-VL-MoE; LLaVA has none)
           # the second stage from the layer after the one deepstack's visual tokens are added after (Qwen3-VL)
           "pp2_cut": dict(pp=2, num_microbatches=2, pipeline_cuts=("model.language_model.layers.2",))}
LLAVA = tuple(name for name in LAYOUTS if name not in ("ep2", "pp2_cut"))
# the families of the generic adapter's tiny image-text configs with a position per token: Idefics3 (its
# connector's pixel shuffle), Gemma 3 (token types: its image tokens attend each other in the prompts' forward; a
# sliding window of 6, which the pads of SP's decoding steps filled until they left the cache)
# Qwen2-VL's rotary positions follow the images' grids (M-RoPE: its get_rope_index gives the prompts', each step
# one on); Qwen3-VL adds visual tokens after its first decoder layer (deepstack), cut to each rank's under SP
FAMILIES = {"idefics3": ("tp2_sp", "zero3_dp2"), "gemma3": ("tp2_sp", "dp2", "tp2", "pp2"),
            "qwen2_vl": ("tp2_sp", "dp2", "pp2"), "qwen3_vl_deepstack": ("tp2_sp", "pp2_cut"),
            "qwen3_vl_moe": ("ep2",)}


def llava_prompts(model) -> tuple[torch.Tensor, torch.Tensor, ImageBatch]:
    """Each row's images (16 image tokens each) then 4 text tokens, left padded."""
    generator = torch.Generator().manual_seed(2)
    image, rows = model.config.image_token_index, []
    for count in PER_ROW:
        rows.append([image] * 16 * count + torch.randint(1, image, (4,), generator=generator).tolist())
    pixels = torch.randn(sum(PER_ROW), 3, 16, 16, generator=generator)
    ids, mask = left_padded(rows)
    return ids, mask, ImageBatch({"pixel_values": pixels}, torch.tensor(PER_ROW))


def family_prompts(config) -> tuple[torch.Tensor, torch.Tensor, ImageBatch]:
    """tiny_vision's rows (its placeholders, start and end tokens, per-token extras) moved to the left padding."""
    ids, mask, _, pixels, extras = image_text_batch(config, PER_ROW, text=4, seed=2)
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    ids, mask = left_padded(rows)
    moved = {name: torch.stack([torch.cat([t.new_zeros(int((m == 0).sum())), t[: int(m.sum())]])
                                for t, m in zip(tensor, mask)]) for name, tensor in extras.items()}
    grid = pixels.get("image_grid_thw")  # Qwen-VL's pixels by patch: each image's count
    return ids, mask, ImageBatch({**pixels, **moved}, torch.tensor(PER_ROW), None if grid is None else grid.prod(-1),
                                 row_major=tuple(extras))


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def one_process(model, ids, mask, images: ImageBatch) -> dict[str, list]:
    """transformers' greedy ``generate`` and plait's sampling loop on the plain model, the images in the first
    forward."""
    model.eval()
    with torch.no_grad():
        greedy = model.generate(ids, attention_mask=mask, **images.tensors, max_new_tokens=NEW, do_sample=False,
                                eos_token_id=EOS, pad_token_id=PAD)
        cache, prompts = DynamicCache(), PromptImages(images, slice(0, len(ids)))
        name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

        def forward(step_ids, step_mask, positions, pads):
            out = model(input_ids=step_ids, attention_mask=step_mask, position_ids=positions, use_cache=True,
                        **{name: cache}, **prompts.take(step_ids))
            return drop_pads(out.logits, cache, pads)

        sampled = decode(forward, ids, mask, slice(0, len(ids)), len(ids), max_new_tokens=NEW, eos_token_id=EOS,
                         pad_token_id=PAD, all_done=lambda mine: mine, **SAMPLING,
                         position_ids=grid_position_ids(model, ids, mask, images))
    return {"greedy": greedy[:, ids.shape[1]:].tolist(), "sampled": sampled[:, ids.shape[1]:].tolist()}


def run(model, ids, mask, images: ImageBatch, layout: dict) -> dict[str, list]:
    pmodel = plait.parallelize(copy.deepcopy(model), plait.ParallelConfig(**layout))
    found = {}
    for kind, settings in (("greedy", {}), ("sampled", SAMPLING)):
        out = pmodel.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, images=images,
                              **settings)
        found[kind] = out[:, ids.shape[1]:].tolist()
    return found


def family(name: str) -> tuple:
    """The generic adapter's tiny image-text model ``name`` (seeded) and its prompts: ids, mask, images."""
    config = tiny_config(name)
    torch.manual_seed(0)
    return (tiny_model(config), *family_prompts(config))


def refusals(model, ids, mask, images: ImageBatch) -> dict[str, str]:
    """What generate says, on every rank before any collective, for images it does not serve."""
    text_only = ImageBatch({"pixel_values": images.tensors["pixel_values"][1:]}, torch.tensor([0, 0, 2, 1]))
    pp2 = dict(pp=2, num_microbatches=2)
    deepstack = family("qwen3_vl_deepstack")
    cases = {"pp2_deepstack": (deepstack[0], pp2, *deepstack[1:]),
             "zero3_replica_without_images": (model, dict(zero_stage=3), ids, mask, text_only),
             "rows": (model, dict(tp=2), ids[:2], mask[:2], images),
             "text_model": (tiny_text_model("llama", seed=0), dict(tp=2), ids.clamp(max=60), mask, images)}
    said = {}
    for name, (subject, layout, i, m, pictures) in cases.items():
        pmodel = plait.parallelize(copy.deepcopy(subject), plait.ParallelConfig(**layout))
        try:
            pmodel.generate(i, m, max_new_tokens=2, images=pictures)
            said[name] = None
        except plait.ConfigError as err:
            said[name] = str(err)
    return said


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = llava()
    ids, mask, images = llava_prompts(model)
    results = {"llava": {"one_process": one_process(copy.deepcopy(model), ids, mask, images)}}
    for name in LLAVA:
        results["llava"][name] = run(model, ids, mask, images, LAYOUTS[name])
    for name, layouts in FAMILIES.items():
        subject, f_ids, f_mask, f_images = family(name)
        results[name] = {"one_process": one_process(copy.deepcopy(subject), f_ids, f_mask, f_images)}
        for layout in layouts:
            results[name][layout] = run(subject, f_ids, f_mask, f_images, LAYOUTS[layout])
    results["refusals"] = refusals(model, ids, mask, images)
    ranks = comm.all_gather_object(results, comm.world_group())
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(ranks))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
