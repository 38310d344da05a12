"""Image-text-to-text parity against one process: the pieces a test world or the architecture sweep runs.

A copy of one model trains a few AdamW steps on the same global batches of image-text rows through
``ParallelModel.train_step(..., images=...)`` on a layout; the reference is transformers' model and torch's AdamW on
the whole batch in one process, its cross-entropy computed in the logits' own dtype (transformers' loss casts them
to float32, which would round a float64 recheck's reference). ``compare`` gives each step's loss beside the
reference's and the largest gradient error of any rank at each step in units of 1e-6 + 1e-5 |g| (the conformance
kit's tolerance), with the parameter names compared on some rank (a tied parameter under its first name). fp32
rounding grown by Adam can pass that bound where float64 (``as_double``) shows every layout to be one process's: the
sweep and the tests recheck there.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from plait import ParallelConfig, parallelize
from plait.base.images import ImageBatch
from plait.optim import OptimizerStep, build_optimizer
from plait.optim.param_groups import embedding_params, weight_decay_groups
from plait.parallel.grad_sync import grad_of
from plait_transformers.tiny_vision import TUPLE_FORWARD, image_text_batch, tiny_image_text_config

LR, WEIGHT_DECAY = 1e-2, 0.1
Rows = tuple[torch.Tensor, torch.Tensor, ImageBatch, torch.Tensor]  # ids, labels, images, attention mask


def sweep_config(model_type: str) -> PretrainedConfig:
    """tiny_vision's config with ``architectures`` naming the image-text class as a whole model's checkpoint has it
    (else plait plans the text decoder of a type AutoModelForCausalLM also maps: Llama 4, Qwen 3.5; ``takes_images``),
    and no stochastic depth (Qianfan-OCR's vision tower keeps drop_path_rate 0.1: its draws differ by layout)."""
    config = tiny_image_text_config(model_type)
    config.architectures = [MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]]
    for sub in (config, *(getattr(config, key, None) for key in config.sub_configs)):
        if getattr(sub, "drop_path_rate", None):
            sub.drop_path_rate = 0.0
    return config


def logits_forward(model: torch.nn.Module) -> None:
    """Llama 4's forward raises after its logits unless config.return_dict is False and return_dict=True is passed
    (tiny_vision.TUPLE_FORWARD): its class becomes one whose forward does so and returns the logits, all plait and the
    reference read (the class, not the method: deep copies then call themselves)."""
    model.config.return_dict, base = False, type(model)

    def forward(self, *args, **kwargs) -> CausalLMOutputWithPast:
        return CausalLMOutputWithPast(logits=base.forward(self, *args, **{**kwargs, "return_dict": True})[0])

    model.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})


def tiny_model(config: PretrainedConfig) -> torch.nn.Module:
    """transformers' image-text model of ``config`` (seeded by the caller), its forward giving the logits where the
    class's raises after them (``logits_forward``)."""
    model = AutoModelForImageTextToText.from_config(config)
    if config.model_type in TUPLE_FORWARD:
        logits_forward(model)
    return model


def tiny_batches(config: PretrainedConfig, images: list[list[int]]) -> list[Rows]:
    """Each step's rows as tiny_vision makes them (its placeholders, start and end tokens, per-token extras), with
    ``images[step]`` images a row."""
    out = []
    for step, per_row in enumerate(images):
        ids, mask, labels, pixels, extras = image_text_batch(config, per_row, seed=step)
        grid = pixels.get("image_grid_thw")
        batch = ImageBatch({**pixels, **extras}, torch.tensor(per_row), None if grid is None else grid.prod(-1),
                           row_major=tuple(extras))
        out.append((ids, labels, batch, mask))
    return out


def as_double(data: list[Rows]) -> list[Rows]:
    """The rows with their floating image tensors in float64 (the float64 recheck)."""
    out = []
    for ids, labels, images, mask in data:
        tensors = {k: v.double() if v.is_floating_point() else v for k, v in images.tensors.items()}
        out.append((ids, labels, ImageBatch(tensors, images.per_row, images.patches, images.row_major), mask))
    return out


def padded(data: list[Rows], multiple: int) -> list[Rows]:
    """Each step's rows right-padded to a multiple of ``multiple`` tokens (no label, masked out): SP halves the
    sequence and cp cuts it in 2 cp chunks, and a tiny batch's length is what its images and text make it."""
    def step(ids: torch.Tensor, labels: torch.Tensor, images: ImageBatch, mask: torch.Tensor) -> Rows:
        pad = functools.partial(torch.nn.functional.pad, pad=(0, -ids.shape[1] % multiple))
        tensors = {k: pad(v) if k in images.row_major else v for k, v in images.tensors.items()}
        return pad(ids), pad(labels, value=-100), dataclasses.replace(images, tensors=tensors), pad(mask)
    return [step(*rows) for rows in data]


def reference(base: torch.nn.Module, data: list[Rows]) -> dict:
    """Losses, every step's gradients and the trained parameters' names of one process; each gradient also under a
    tied parameter's other names (``aliases``: named_parameters gives the first), as a pipeline stage holding one
    copy alone (the last's lm_head.weight) steps it under its own name."""
    model = copy.deepcopy(base)
    first: dict[int, str] = {}
    aliases = {name: first[id(param)] for name, param in model.named_parameters(remove_duplicate=False)
               if first.setdefault(id(param), name) != name}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    groups = weight_decay_groups(model.named_parameters(), shapes, embedding_params(model), WEIGHT_DECAY)
    optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, grads = [], []
    for ids, labels, images, mask in data:
        # the cross-entropy in the logits' own dtype: transformers' loss casts them to float32, which would leave
        # the float64 recheck's reference rounded to fp32
        logits = model(input_ids=ids, attention_mask=mask, **images.inputs()).logits
        shifted = labels[:, 1:].flatten()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), shifted, ignore_index=-100,
                                                 reduction="sum") / (shifted != -100).sum()
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        grads[-1].update({alias: grads[-1][name] for alias, name in aliases.items() if name in grads[-1]})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    trained = sorted(set(grads[0]) - set(aliases))  # not the vision tower's unused post_layernorm (a hidden layer read)
    return {"losses": losses, "grads": grads, "trained": trained, "aliases": aliases}


def train(base: torch.nn.Module, data: list[Rows], layout: dict) -> dict:
    """Losses and every step's stepped gradients of a copy of ``base`` on ``layout`` (ParallelConfig kwargs)."""
    pmodel = parallelize(copy.deepcopy(base), ParallelConfig(**layout))
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    step = OptimizerStep(pmodel.grad_sync, optimizer, None)
    owned = {id(p) for p in getattr(optimizer, "owned_params", pmodel.parameters())}
    stepped: list[dict] = []

    def reading(*args, **kwargs):  # the gradients the optimizer steps on (ZeRO-1: its owned ones)
        stepped.append({name: grad_of(p).detach().float().clone() for name, p in pmodel.module.named_parameters()
                        if id(p) in owned and grad_of(p) is not None})
        return type(optimizer).step(optimizer, *args, **kwargs)

    optimizer.step = reading
    losses = []
    for ids, labels, images, mask in data:
        count = int((labels[:, 1:] != -100).sum())
        loss = pmodel.train_step(pmodel.local_batch(ids), pmodel.local_batch(labels), pmodel.local_batch(mask),
                                 num_items_in_batch=count, images=pmodel.local_batch(images))
        step()
        losses.append(pmodel.global_loss(loss).item())
    return {"losses": losses, "grads": stepped, "pmodel": pmodel}


def compare(run: dict, expected: dict) -> dict:
    """The run against the reference, the same on every rank (a collective)."""
    worst, names, by_step = torch.zeros(()), set(), []
    for stepped, reference_grads in zip(run["grads"], expected["grads"], strict=True):
        by_step.append(worst.clone())
        worst = torch.zeros(())
        for name, grad in stepped.items():
            if not grad.numel():  # ZeRO-3 gave this rank none of the parameter's rows
                continue
            if name not in reference_grads:  # a parameter the forward does not read: no gradient, or zeros
                worst = torch.maximum(worst, (grad.abs() / 1e-6).max())
                continue
            want = run["pmodel"].param_specs[name].slice_full(reference_grads[name])
            worst = torch.maximum(worst, ((grad - want).abs() / (1e-6 + 1e-5 * want.abs())).max())
            names.add(expected["aliases"].get(name, name))
    by_step = torch.stack([*by_step[1:], worst])
    dist.all_reduce(by_step, op=dist.ReduceOp.MAX)
    worst = by_step.max()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(names))
    return {"losses": run["losses"], "ref_losses": expected["losses"], "grad_error": worst.item(),
            "grad_error_by_step": by_step.tolist(),
            "compared": sorted(set().union(*everyone))}
