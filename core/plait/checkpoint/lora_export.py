"""LoRA out of plait: a peft adapter directory, or the base model with the update merged in.

Both start from full LoRA tensors under plait's names (``model.layers.0.self_attn.q_proj.lora_A.weight``, peft's
names without its ``base_model.model.`` prefix and adapter name), read from a checkpoint (``consolidate_lora``)
or gathered from a running model (``gather_lora``). The adapter is written with peft's own config class and
key names, so ``PeftModel.from_pretrained(base, dir)`` loads it on the unmodified base; the merged model is
``W + scale * B @ A`` (transposed for Conv1D weights; per expert for an expert parameter), saved with
``save_pretrained``. ``plait consolidate``'s flags act on both as on a whole checkpoint: ``--dtype`` casts the
written tensors, ``--format pytorch`` writes ``torch.save`` files; ``--max_shard_size`` splits the merged model
and is refused for an adapter, which peft reads from one file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from torch import nn

from plait.base import comm
from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model, model_class
from plait.checkpoint.consolidate import (
    DEFAULT_SHARD_SIZE, TOKENIZER_FILES, check_output_dir, parse_dtype, parse_size, weight_source,
)
from plait.checkpoint.format import full_box, model_config, read_index, write_json
from plait.checkpoint.gather import gather_full
from plait.checkpoint.load import CheckpointReader
from plait.checkpoint.materialize import load_parallel_model
from plait.checkpoint.st_io import DTYPES
from plait.lora.base import check_base, saved_lora
from plait.lora.config import scaling
from plait.lora.experts import updated
from plait.lora.layout import LORA_A, LORA_B, parameter_targets

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_PT = "adapter_model.bin"  # peft's name for a torch.save adapter, read when no safetensors is there
FORMATS = ("safetensors", "pytorch")


def gather_lora(pmodel) -> dict[str, torch.Tensor]:
    """Every full LoRA tensor of a running ParallelModel, on every rank (a collective over the world: tp
    slices are gathered, pipeline stages exchange theirs)."""
    lora = pmodel.plan.lora
    if lora is None:
        raise ConfigError("this model trains no LoRA adapters (parallelize(..., lora=LoraConfig(...)))")
    local = {}
    for name, param in pmodel.module.named_parameters():
        if name in lora.param_names():
            full = gather_full(pmodel, name, param)
            if pmodel.mesh.tp_rank == 0:
                local[name] = full.cpu()
    merged: dict[str, torch.Tensor] = {}
    for part in comm.all_gather_object(local, comm.world_group()):
        merged.update(part)
    return merged


def adapter_config(config: LoraConfig, base: nn.Module | None, base_path: str | None) -> LoraConfig:
    """The config saved beside the weights: peft sets ``fan_in_fan_out`` for Conv1D bases (GPT2) itself when
    it adapts them, so it is written as peft would."""
    from transformers.pytorch_utils import Conv1D

    saved = LoraConfig(**{k: v for k, v in config.to_dict().items() if k in LoraConfig.__dataclass_fields__
                          and k not in ("peft_type", "auto_mapping", "peft_version")})
    if base is not None:
        saved.fan_in_fan_out = any(isinstance(m, Conv1D) for n, m in base.named_modules()
                                   if n and config.target_modules and _targeted(config, n))
    saved.base_model_name_or_path = base_path
    saved.inference_mode = True
    return saved


def _targeted(config: LoraConfig, name: str) -> bool:
    from peft.tuners.tuners_utils import check_target_module_exists

    return bool(check_target_module_exists(config, name))


def save_adapter(path: str | os.PathLike, tensors: dict[str, torch.Tensor], config: LoraConfig,
                 base: nn.Module | None = None, base_path: str | None = None, format: str = "safetensors") -> Path:
    """Write a peft adapter directory (adapter_config.json + adapter_model.safetensors, or adapter_model.bin for
    ``format="pytorch"``, both read by ``PeftModel.from_pretrained``) to a temporary folder, renamed to ``path``
    when complete."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.writing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    adapter_config(config, base, base_path).save_pretrained(str(tmp))
    weights = {PEFT_PREFIX + name: t.detach().contiguous() for name, t in tensors.items()}
    if format == "pytorch":
        torch.save(weights, tmp / ADAPTER_WEIGHTS_PT)
    else:
        save_file(weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


@torch.no_grad()
def merge_into(model: nn.Module, tensors: dict[str, torch.Tensor], config: LoraConfig) -> nn.Module:
    """Add ``scale * B @ A`` to every adapted weight of ``model`` (a whole transformers model), in place; per
    expert for an expert parameter (``lora/experts.py``). A head tied to the input embedding is untied first (its own
    weight, ``tie_word_embeddings`` off in the config): the update is the head's alone, and written into the one tied
    tensor it moved the embedding too (a tied GPT-2 head merged 0.32 off its peft adapter in the logits)."""
    from transformers.pytorch_utils import Conv1D

    scale = scaling(config)
    suffix = f".{LORA_A}.weight"
    parameters = parameter_targets(model, config)
    for name in (n for n in tensors if n.endswith(suffix)):
        prefix = name[: -len(suffix)]
        a, b = tensors[name].float(), tensors[f"{prefix}.{LORA_B}.weight"].float()
        if prefix in parameters:
            module_name, leaf = parameters[prefix]
            module = model.get_submodule(module_name)
            weight = module.get_parameter(leaf)
            merged = updated(weight.float(), a, b, scale, getattr(module, "is_transposed", False))
        else:
            module = model.get_submodule(prefix)
            if module.weight is model.get_input_embeddings().weight:
                module.weight = nn.Parameter(module.weight.detach().clone())
                model.config.tie_word_embeddings = model.config.get_text_config().tie_word_embeddings = False
            weight = module.weight
            delta = (b @ a) * scale  # [out, in]
            merged = weight.float() + (delta.T if isinstance(module, Conv1D) else delta)
        weight.copy_(merged.to(weight.dtype))
    return model


def save_merged(path: str | os.PathLike, model: nn.Module, tensors: dict[str, torch.Tensor], config: LoraConfig,
                format: str = "safetensors", dtype: torch.dtype | None = None,
                max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """``merge_into`` (in the model's dtype), cast to ``dtype`` if given, then ``save_pretrained`` in files of at
    most ``max_shard_size`` (``format="pytorch"``: as ``torch.save`` files) to a temporary folder renamed to
    ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.writing")
    shutil.rmtree(tmp, ignore_errors=True)
    merged = merge_into(model, tensors, config)
    if dtype is not None:
        merged.to(dtype)  # floating parameters and buffers only; config.json's dtype follows
    merged.save_pretrained(str(tmp), max_shard_size=parse_size(max_shard_size))
    if format == "pytorch":
        _as_pytorch_files(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def _as_pytorch_files(folder: Path) -> None:
    """``save_pretrained`` writes safetensors only (transformers 5): each weight file becomes the ``torch.save``
    file ``consolidate(format="pytorch")`` writes, under its name (pytorch_model[-0000i-of-0000n].bin, and
    pytorch_model.bin.index.json for shards), one file in memory at a time."""
    renamed = {}
    for src in sorted(folder.glob("model*.safetensors")):
        dst = src.with_name("pytorch_model" + src.name.removeprefix("model").removesuffix(".safetensors") + ".bin")
        torch.save(load_file(src), dst)
        src.unlink()
        renamed[src.name] = dst.name
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text())
        shards["weight_map"] = {name: renamed[file] for name, file in shards["weight_map"].items()}
        write_json(folder / "pytorch_model.bin.index.json", shards)
        index.unlink()


def consolidate_lora(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, mode: str,
                     format: str = "safetensors", dtype: str | torch.dtype | None = None,
                     max_shard_size: int | str | None = None) -> Path:
    """A LoRA checkpoint (any layout) as a peft adapter directory (``mode="adapter"``) or as its base with the
    update merged in (``mode="merged"``, a ``from_pretrained`` directory, tokenizer files copied). The base is
    reloaded from the checkpoint's reference, checked against the identity it recorded.

    ``format``, ``dtype`` and ``max_shard_size`` are ``consolidate``'s (None: its default, 5GB); every one acts, or
    is refused before any weight is read: a peft adapter is one file, so it takes no ``max_shard_size``.
    ``dtype`` None writes the adapters as saved, the merged model in float32 (the merge's precision). Adapters
    trained in bf16 are read as their fp32 masters where the checkpoint has them and they are used finer than
    saved: always by the merge (float32), by an adapter written in float32."""
    if mode not in ("adapter", "merged"):
        raise ConfigError(f"--lora {mode!r} is unknown; choose adapter (a peft directory) or merged")
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r} is unknown; choose one of {', '.join(FORMATS)}")
    out_dtype = parse_dtype(dtype)
    if mode == "adapter" and max_shard_size is not None:
        raise ConfigError(f"--max_shard_size {max_shard_size} with --lora adapter (a LoRA checkpoint's default): a "
                          f"peft adapter is one weights file (peft reads no shards); drop --max_shard_size, or write "
                          f"one model with --lora merged")
    max_bytes = parse_size(DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size)
    output = Path(output_dir)
    check_output_dir(output)
    paths, index = read_index(checkpoint_dir)
    saved = saved_lora(index.extra)
    if saved is None:
        raise ConfigError(f"{paths.where} is a full checkpoint, not a LoRA one; consolidate it without --lora")
    config, base = saved
    reader = CheckpointReader(paths, index)
    used_in = out_dtype if mode == "adapter" else torch.float32  # merge_into adds the update in float32
    tensors = {}
    for name in index.params():
        source = weight_source(index, name, used_in)
        entry = index.tensors[source]
        tensors[name] = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
        reader.read(source, full_box(entry.shape), tensors[name])
    model_cfg = model_config(index)
    if mode == "adapter":
        if out_dtype is not None:
            tensors = {n: t.to(out_dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        return save_adapter(output, tensors, config, build_meta_model(model_cfg), base.get("path"), format)
    check_base(base, paths.where)
    if base["kind"] == "hf":  # the base's own class: a causal LM, or an image-text-to-text model
        model = model_class(model_cfg).from_pretrained(base["path"], dtype=torch.float32)
    else:  # seeded random weights: rebuilt exactly as the run built them
        model = load_parallel_model(model_cfg, ParallelConfig(), seed=base["seed"]).module
    save_merged(output, model, tensors, config, format, out_dtype, max_bytes)
    for extra in TOKENIZER_FILES:
        if (paths.root / extra).is_file():
            shutil.copyfile(paths.root / extra, output / extra)
    return output
