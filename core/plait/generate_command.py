"""``plait generate``: completions of a file of prompts from a model's own shards, on any layout generation serves
(tp, pp, dp, ep, ZeRO-3: ``ParallelModel.generate``).

    plait generate --model_name_or_path DIR --prompts prompts.jsonl --output completions.jsonl \\
        [--max_new_tokens 64] [--temperature 0] [--nproc_per_node 2 --tensor_parallel_size 2]

DIR is a Hugging Face model directory or a plait checkpoint (any saved layout, no consolidation: its tokenizer files
are saved beside the weights). Each prompt line is a JSON object with a ``prompt`` string, or chat ``messages``
rendered with the tokenizer's chat template and its generation prompt; the output holds each input row with its
``completion`` added, in the input's order. Prompts are left padded and decoded ``--batch_size`` at a time (the global
batch, split over the dp replicas); a ``prompt`` string gets the tokenizer's special tokens (its BOS), as
``tokenizer(prompt)`` gives them; a completion ends at an end token of the model's generation config (one or a list:
a chat model's end of turn too), as transformers' ``generate`` ends, or before the first ``--stop`` string.
The same ``--seed`` and ``--batch_size`` give the same completions in every layout (each batch's noise is drawn for
the whole batch from one generator). An image-text model's prompts may hold images, in TRL's vision format
(``messages`` with image parts beside ``images``: paths relative to the prompt file, as training reads them): its
processor renders and encodes them, and the pixels reach the prompts' forward (``plait.generation.images``: tp, dp,
ZeRO, cp, pp and ep). Bad input (a prompt line, a row with images for a text
model, a prompt with --max_new_tokens past the model's positions, a model, tokenizer or processor directory, an
image that cannot be read, a batch the replicas do not divide, a layout generation does not serve) is one line
before any process group; the output file appears whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from plait.base.config import ConfigError

COUNT_FLAGS = ("--max_new_tokens", "--batch_size", "--top_k")


def add_generate_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("generate", parents=parents, help="complete a file of prompts with a model (a Hugging "
                            "Face dir or a plait checkpoint) on its tp / dp / ep / ZeRO-3 shards")
    parser.add_argument("--model_name_or_path", required=True,
                        help="a Hugging Face model dir or a plait checkpoint (a dir, or its URL in an object store)")
    parser.add_argument("--tokenizer_name", default=None, help="tokenizer dir (default: the model's)")
    parser.add_argument("--prompts", required=True, type=Path,
                        help="JSON lines, each with a 'prompt' string or chat 'messages' (the tokenizer's template)")
    parser.add_argument("--output", required=True, type=Path, help="JSON lines: each prompt's row with 'completion'")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top_k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    parser.add_argument("--top_p", type=float, default=1.0, help="sample from the likeliest tokens of this mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling's seed: the same completions in every layout")
    parser.add_argument("--stop", nargs="+", default=[], metavar="TEXT",
                        help="stop strings: a completion ends before the first of them, its decoding there")
    parser.add_argument("--batch_size", type=int, default=8,
                        help="prompts decoded together, over all data-parallel replicas (a multiple of dp)")
    parser.add_argument("--tensor_parallel_size", type=int, default=1)
    parser.add_argument("--pipeline_parallel_size", type=int, default=1,
                        help="stages the layers are split into, one a rank (each its own KV cache)")
    parser.add_argument("--expert_parallel_size", type=int, default=1)
    parser.add_argument("--zero_stage", type=int, choices=(0, 3), default=0,
                        help="3: each dp rank stores 1/dp of the weights, gathered layer by layer")
    parser.add_argument("--bf16", action="store_true", help="weights and compute in bfloat16")
    parser.add_argument("--nproc_per_node", type=int, default=1, help="launch this many processes with torchrun")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--ddp_timeout", type=int, default=600, help="seconds a collective may wait")
    parser.set_defaults(func=cmd_generate)


def check_args(ns: argparse.Namespace, world: int) -> None:
    """The numbers and the layout, before a weight or a process group: one line each."""
    for flag in COUNT_FLAGS:
        value = getattr(ns, flag[2:])
        if value < (0 if flag == "--top_k" else 1):
            raise ConfigError(f"{flag} {value}: give a positive number" + (" or 0" if flag == "--top_k" else ""))
    if ns.temperature < 0 or not 0 < ns.top_p <= 1:
        raise ConfigError(f"--temperature {ns.temperature} --top_p {ns.top_p}: temperature >= 0 (0: greedy), "
                          f"0 < top_p <= 1")
    sampling = [f"{flag} {getattr(ns, flag[2:])}" for flag, default in (("--top_k", 0), ("--top_p", 1.0))
                if getattr(ns, flag[2:]) != default]
    if ns.temperature == 0 and sampling:
        raise ConfigError(f"{' '.join(sampling)} shape{'' if len(sampling) > 1 else 's'} sampling, and --temperature 0 "
                          f"decodes greedily; give --temperature > 0 (e.g. 1.0) to sample, or drop "
                          f"{'them' if len(sampling) > 1 else 'it'}")
    split = ns.tensor_parallel_size * ns.pipeline_parallel_size
    if ns.tensor_parallel_size < 1 or ns.pipeline_parallel_size < 1 or world % split:
        raise ConfigError(f"--tensor_parallel_size {ns.tensor_parallel_size} x --pipeline_parallel_size "
                          f"{ns.pipeline_parallel_size} does not divide {world} processes")
    dp = world // split
    if ns.batch_size % dp:
        valid = ", ".join(str(dp * k) for k in range(1, 4))
        raise ConfigError(f"--batch_size {ns.batch_size} is split over dp={dp} replicas: give a multiple of {dp} "
                          f"({valid}, ...)")


def cmd_generate(ns: argparse.Namespace) -> None:
    if ns.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        from plait.run.torchrun import launch  # when run: every command builds this parser

        def checked_command() -> list[str]:  # bad input: one line here, not one per worker
            checked_input(ns, ns.nproc_per_node)
            return ns.argv

        launch(ns.nproc_per_node, ns.ddp_timeout, checked_command)
        return
    prompts, tokenizer, ends = checked_input(ns, int(os.environ.get("WORLD_SIZE", "1")))
    complete(ns, prompts, tokenizer, ends)


def checked_input(ns: argparse.Namespace, world: int) -> tuple[list[Any], Any, list[int]]:
    """The prompts (``PromptRow``: chat messages rendered, tokenized), the tokenizer and the tokens a completion ends
    at (the model's generation config's, as transformers' ``generate`` ends), every flag, the model directory and
    each prompt's room for --max_new_tokens checked, for ``world`` processes."""
    from plait.run.prompts import check_room, encode_image_prompts, encode_prompts, end_ids, pad_id, read_prompts

    check_args(ns, world)
    from plait.base.meta import takes_images
    from plait.checkpoint.materialize import resolve_source

    config, _, path = resolve_source(ns.model_name_or_path)
    pictured = takes_images(config)  # an image-text model: its processor encodes the prompts and their images
    rows = read_prompts(ns.prompts, "--prompts", images=pictured)
    if pictured:
        from plait.data.processors import load_processor

        processor = load_processor(ns.tokenizer_name or path)  # as training reads it: --tokenizer_name's dir first
        tokenizer, prompts = processor.tokenizer, encode_image_prompts(rows, processor, ns.prompts)
        check_images_served(ns, world, [p.example.num_images for p in prompts], config)
    else:
        tokenizer = load_prompt_tokenizer(ns, path, config)
        prompts = encode_prompts(rows, tokenizer)
    pad_id(tokenizer)  # one that can pad prompts
    check_room(ns.prompts, prompts, ns.max_new_tokens, "--max_new_tokens", config)
    return prompts, tokenizer, end_ids(tokenizer, generation_config(path, config))


def check_images_served(ns: argparse.Namespace, world: int, images: list[int], config: Any) -> None:
    """Before any process group, what ``ParallelModel.generate`` would refuse of prompts holding ``images`` (per
    prompt) at this layout: on the meta model of ``config``, positions its decoding cannot compute and under pp what
    the planned stages could not get (``check_planned_image_stages``); under ZeRO-2/3 a replica's rows of a batch
    without an image (the batches as ``plait.run.prompts.complete`` forms them)."""
    if not any(images):
        return
    import torch

    from plait.base.meta import build_meta_model
    from plait.generation.images import check_positions_decodable
    from plait.layout_plan import check_planned_image_stages, plan_layout

    meta = build_meta_model(config, torch.float32)
    check_positions_decodable(meta, None)
    if ns.pipeline_parallel_size > 1:
        check_planned_image_stages(meta, plan_layout(meta, generation_config_of(ns), world))
    if ns.zero_stage >= 2:
        from plait.generation.images import check_replicas_hold_images

        dp = world // (ns.tensor_parallel_size * ns.pipeline_parallel_size)
        check_replicas_hold_images(images, ns.batch_size, dp, "--prompts", f"--zero_stage {ns.zero_stage}")


def generation_config_of(ns: argparse.Namespace) -> Any:
    """The layout the flags ask generation for. No sequence parallelism: served (``ParallelModel.generate`` pads each
    forward to a multiple of tp), but a decode step's one token would cost tp tokens of compute and cache for nothing
    a decode step can split; pp's micro-batches are training's (generation runs the stages itself)."""
    from plait.base.config import ParallelConfig

    pp = ns.pipeline_parallel_size
    return ParallelConfig(tp=ns.tensor_parallel_size, pp=pp, ep=ns.expert_parallel_size, sp=False,
                          zero_stage=ns.zero_stage, num_microbatches=pp)


def generation_config(path: Path | None, config: Any) -> Any:
    """The model's generation config: its directory's generation_config.json (a model's or a plait checkpoint's),
    else the one transformers derives from its config."""
    from transformers import GenerationConfig

    if path is not None and (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(config)


def load_prompt_tokenizer(ns: argparse.Namespace, model_dir: Path | None, config: Any) -> Any:
    """The tokenizer of ``--tokenizer_name`` or the model dir."""
    from plait.data.tokenizer import load_tokenizer

    if model_dir is None and ns.tokenizer_name is None:
        raise ConfigError("--model_name_or_path names no directory: give --tokenizer_name")
    try:
        tokenizer = load_tokenizer(Path(ns.tokenizer_name or model_dir), config.get_text_config().vocab_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return tokenizer


def complete(ns: argparse.Namespace, prompts: list[Any], tokenizer: Any, ends: list[int]) -> None:
    """Load the model's shards, decode every batch of prompts, write the output on rank 0 (temporary, then renamed)."""
    import datetime

    import torch

    from plait.base.device import pick_device
    from plait.checkpoint.materialize import load_parallel_model
    from plait.run.prompts import complete as complete_texts
    from plait.run.runtime import init_distributed

    device = pick_device(ns.device)
    init_distributed(device, "auto", ns.ddp_timeout)
    pmodel = load_parallel_model(ns.model_name_or_path, generation_config_of(ns),
                                 dtype=torch.bfloat16 if ns.bf16 else torch.float32,
                                 device=device, timeout=datetime.timedelta(seconds=ns.ddp_timeout))
    start = time.perf_counter()
    done = complete_texts(pmodel, tokenizer, [p.ids for p in prompts], batch_size=ns.batch_size, device=device,
                          max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k,
                          top_p=ns.top_p, seed=ns.seed, stop=ns.stop, ends=ends,
                          examples=[p.example for p in prompts] if prompts[0].example is not None else None)
    out = [{**p.row, "completion": text} for p, (text, _) in zip(prompts, done)]
    generated = sum(count for _, count in done)
    seconds = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) == 0:
        ns.output.parent.mkdir(parents=True, exist_ok=True)
        partial = ns.output.with_name(ns.output.name + ".tmp")
        partial.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in out), encoding="utf-8")
        partial.replace(ns.output)
        print(f"{len(out)} completions, {generated:,} new tokens in {seconds:.1f} s ({generated / seconds:,.1f} "
              f"tokens/s, layout {generation_layout(pmodel.mesh.config)}): {ns.output}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def generation_layout(config: Any) -> str:
    """The layout as generation runs it: its sizes and ZeRO stage, not a training schedule's (pipelined decoding
    runs its stages itself: ``plait.generation.pipelined``)."""
    extra = (f" ep={config.ep}" if config.ep > 1 else "") + (f" zero={config.zero_stage}" if config.zero_stage else "")
    return f"tp={config.tp} pp={config.pp} dp={config.dp}{extra}"
