"""A tiny image-text-to-text model of any transformers architecture, and a batch of image-text rows it trains on.

The architecture sweep's image-text column and the tp/dp parity tests need, for each image-text-to-text model type,
a model small enough for a 2-core CI (a 4-layer decoder as tiny.py makes it, a 2-layer vision tower) and rows whose
image placeholders match what the model's forward checks, or a one-line reason why that type is not served.

The config starts from ``tiny_config`` (which shrinks every sub-config) and fixes the vision side: a 16x16 image in
4x4 patches, 2 vision layers, projector widths, and the multimodal token ids moved inside the tiny vocabulary
(checkpoints put them past the text vocabulary). How many placeholder tokens an image takes is measured, not
derived: each family (CLS kept or dropped, pixel shuffle, pooling, spatial merge, anyres tiles) counts differently
and releases change the rule, while the model's own ``get_image_features`` is what its forward checks the
placeholders against; a config's ``image_seq_length`` (the processor's count) is set to that measure.

Run as ``python -m plait_transformers.tiny_vision`` for the table over every installed type.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from plait_transformers import MAX_TINY_PARAMETERS
from plait_transformers.tiny import SIZES, tiny_config

IMAGE, PATCH, VISION_LAYERS, CHANNELS = 16, 4, 2, 3
# Vision-side sizes, set on the keys a sub-config other than the text decoder has: every width the decoder's
# (projectors map one to the other; the models check several are equal), a 16x16 image in 4x4 patches (16 patches,
# 2x2 after a 2x2 merge or pixel shuffle).
VISION: dict[str, Any] = {
    "image_size": IMAGE, "patch_size": PATCH, "num_hidden_layers": VISION_LAYERS, "depth": VISION_LAYERS,
    "num_layers": VISION_LAYERS, "hidden_size": 32, "embed_dim": 32, "out_hidden_size": 32, "projection_dim": 32,
    "text_hidden_size": 32, "output_size": 32, "num_attention_heads": 4, "num_heads": 4, "intermediate_size": 64,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "vision_output_dim": 32, "projector_input_dim": 32,
    "projector_output_dim": 32,
}
# Top-level sizes that count an image's tokens or widths from the full-size tower; derived again from the tiny one.
# (also on the text decoder's config, where PaliGemma keeps its image token count)
TOP: dict[str, Any] = {"projection_dim": 32, "mm_tokens_per_image": 4, "num_image_tokens": (IMAGE // PATCH) ** 2,
                       "vision_feature_layer": -1,
                       "projection_hidden_size": 32, "projector_hidden_size": 32, "out_hidden_size": 32,
                       "alignment_intermediate_size": 64, "num_query_tokens": 4}
# Token ids that open and close an image where the config has them: the processor's layout, and the Qwen-VL
# family's M-RoPE groups consecutive image tokens into one image, so two images in a row need them between.
START_KEYS = ("vision_start_token_id", "image_start_token_id", "boi_token_index", "boi_token_id")
END_KEYS = ("vision_end_token_id", "image_end_token_id", "eoi_token_index", "eoi_token_id")
IMAGE_KEYS = ("image_token_id", "image_token_index")
# Per-type values (dotted keys reach into a sub-config) where the generic fixes above do not build a model that runs.
FIXES: dict[str, dict[str, Any]] = {
    # anyres: one grid pinpoint the size of the image, so each image is its base view and one tile
    **{arch: {"image_grid_pinpoints": [[IMAGE, IMAGE]]} for arch in ("llava_next", "llava_next_video",
                                                                    "llava_onevision")},
    # the projector's learned queries per patch count: the checkpoints' counts (35x35, 70x70 patches) for 4x4
    "aria": {"projector_patch_to_query_dict": {(IMAGE // PATCH) ** 2: 4}},
    # the adapter pools the last two of the tower's layers (the checkpoints' 24th and 18th)
    "molmo2": {"adapter_config.vision_feature_layer": [-1, -2]},
    # its MLA attention expands keys for every head, and divides the heads by num_key_value_heads (tiny.py's rule)
    **{arch: {"text_config.num_key_value_heads": SIZES["num_attention_heads"]} for arch in ("mistral_large4",
                                                                                             "kimi_k25")},
    # its decoder builds a sliding-window mask whatever its layer kinds, and the window defaults to None
    "step3p7": {"text_config.sliding_window": SIZES["sliding_window"]},
    # the thinker's M-RoPE finds images by the token after vision_start_token_id, which its config class lacks
    # (a checkpoint's config.json carries it): the checkpoint's ids, moved into the vocabulary with the others
    **{arch: {"vision_start_token_id": 151652, "vision_end_token_id": 151653}
       for arch in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")},
    # the adapter's first layer reads the pixel-shuffled width (4 x hidden at ratio 0.5) as the vision MLP's width
    "llama4": {"vision_config.intermediate_size": 4 * VISION["hidden_size"]},
    # its pooler averages kernel x kernel blocks of patches, which must tile the image's 4 x 4 patches; its tower's
    # attention has key-value heads of its own (12), which the shrunk head count must divide
    "gemma4": {"vision_config.pooling_kernel_size": 2, "vision_config.num_key_value_heads": VISION["num_heads"],
               "vision_config.head_dim": VISION["hidden_size"] // VISION["num_heads"]},
    # its vision side is an embedder of its own width and positions (3840 wide, 1120 positions by default) over
    # patches of patch_size x pooling_kernel_size pixels (model_patch_size)
    "gemma4_unified": {"vision_config.pooling_kernel_size": 2, "vision_config.mm_embed_dim": VISION["hidden_size"],
                       "vision_config.output_proj_dims": VISION["hidden_size"],
                       "vision_config.mm_posemb_size": VISION["image_size"]},
}

# One flattened patch where it is not channels x temporal_patch_size x patch x patch: Kimi's patch embedding is a
# 2D convolution over it.
PATCH_SHAPES: dict[str, tuple[int, ...]] = {"kimi_k25": (CHANNELS, PATCH, PATCH)}
# Llama4ForConditionalGeneration's forward builds its output from the text model's, which has no ``image_outputs``
# (AttributeError after the loss): with config.return_dict False its body returns the tuple before that, while
# return_dict=True keeps the output-capturing wrapper from converting that tuple again.
TUPLE_FORWARD = ("llama4",)


def tiny_image_text_config(model_type: str) -> PretrainedConfig:
    """A tiny config of ``model_type`` (see the module docstring); raises ValueError for an encoder-decoder type."""
    config_class = CONFIG_MAPPING[model_type]
    if getattr(config_class(), "is_encoder_decoder", False):
        raise ValueError("encoder-decoder model (is_encoder_decoder): the image-text column covers decoders only")
    # shrunk under a class that skips the checks across sub-configs (a vision tower's output width equal to the
    # decoder's), which hold only once the vision side below is fixed; the real class checks the result
    lenient = type(config_class.__name__, (config_class,), {"validate": lambda self: None})
    values = tiny_config(lenient).to_dict()
    if values.get("vision_config", False) is None and "vision_config" in config_class.sub_configs:
        values["vision_config"] = config_class.sub_configs["vision_config"]().to_dict()  # optional (Gemma 4): one
    for key, sub in values.items():
        if key in config_class.sub_configs and isinstance(sub, dict) and key != "text_config":
            sub.update({k: _like(sub[k], v) for k, v in VISION.items() if isinstance(sub.get(k), (int, list))})
            if isinstance(sub.get("layer_types"), list):
                sub["layer_types"] = sub["layer_types"][:VISION_LAYERS]
    for part in (values, values.get("text_config") or {}):
        part.update({k: v for k, v in TOP.items() if k in part and part[k] is not None})
    for dotted, value in FIXES.get(model_type, {}).items():
        *path, last = dotted.split(".")
        functools.reduce(lambda d, k: d[k], path, values)[last] = value
    unset = [k for k in IMAGE_KEYS if k in values and values[k] is None]
    if unset and not any(isinstance(values.get(k), int) for k in IMAGE_KEYS):  # set by a checkpoint's config.json
        values[unset[0]] = max([_vocab(values)] + [values[k] for k in _special_keys(values)]) + 1
    _move_token_ids(values)
    text_type = (values.get("text_config") or {}).get("model_type")
    declared = [config_class] + ([CONFIG_MAPPING[text_type]] if text_type in CONFIG_MAPPING else [])
    if any("mrope_section" in getattr(c, "ignore_keys_at_rope_validation", ()) for c in declared):  # M-RoPE
        _mrope(values.get("text_config") or values)
    config = config_class(**values)
    if getattr(config, "image_seq_length", None) is not None:  # the processor's count (no forward reads it)
        config.image_seq_length = _tokens_per_image(config.to_json_string(), model_type)
    return config


def _like(old: int | list, value: int) -> int | list:
    """``value`` in the form of the value it replaces: one per entry where that is a list (an [height, width] size)."""
    return [value] * len(old) if isinstance(old, list) else value


def _mrope(text: dict[str, Any]) -> None:
    """M-RoPE's temporal/height/width sections of the rotary half of a head, as sized for the full head: shrunk to
    the tiny head (half 4: 2 temporal, 1 height, 1 width), which the rotary module splits the frequencies by."""
    rope = text.get("rope_parameters") or {}
    nested = [v for v in rope.values() if isinstance(v, dict)]  # one entry per layer type
    for entry in nested or [rope]:
        if "rope_type" in entry or "mrope_section" in entry:  # the model's own default is for the full head
            rotary = entry.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
            half = int((text.get("head_dim") or SIZES["head_dim"]) * rotary) // 2
            entry["mrope_section"] = [half - 2 * (half // 4), half // 4, half // 4]


def _special_keys(values: dict[str, Any]) -> list[str]:
    """The keys of a config's multimodal token ids (image, video, start/end of image): not pad, bos or eos."""
    return [k for k, v in values.items() if k.endswith(("_token_id", "_token_index")) and isinstance(v, int)
            and not isinstance(v, bool) and k not in ("pad_token_id", "bos_token_id", "eos_token_id")]


def _move_token_ids(values: dict[str, Any]) -> None:
    """Multimodal token ids at the top of the tiny vocabulary, each distinct checkpoint id a distinct tiny id in the
    checkpoint's order, so text tokens drawn below them never collide."""
    vocab = _vocab(values)
    keys = _special_keys(values)
    ordered = sorted({values[k] for k in keys})
    new = {old: vocab - len(ordered) + i for i, old in enumerate(ordered)}
    values.update({k: new[values[k]] for k in keys})


def _vocab(values: dict[str, Any]) -> int:
    """The text vocabulary size of a config's dict: its text decoder's, else its own."""
    text = values.get("text_config")
    return (text or {}).get("vocab_size") or values.get("vocab_size") or SIZES["vocab_size"]


def _image_token(config: PretrainedConfig) -> int:
    """The placeholder token the model scatters image features onto."""
    token = _first_id(config, IMAGE_KEYS)
    if token is None:
        raise ValueError("no image placeholder token in the config (image_token_id): the model does not take images "
                         "as placeholders its features replace")
    return token


def _first_id(config: PretrainedConfig, keys: tuple[str, ...]) -> int | None:
    return next((getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)), None)


def _forward_names(model_type: str, features: bool = False) -> set[str]:
    """The argument names of the model's forward and get_image_features (that alone with ``features``: a forward
    may accept ``image_sizes`` only to pass it on, to a tower that does not take it)."""
    import transformers

    model_class = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
    functions = [getattr(model_class, "get_image_features", None)] + ([] if features else [model_class.forward])
    return {name for f in functions if f is not None for name in inspect.signature(f).parameters}


def image_pixels(config: PretrainedConfig, images: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Pixel inputs of ``images`` images, batched by image along dim 0, in the layout the model's forward takes:
    flattened patches beside ``image_grid_thw`` (Qwen-VL) or ``spatial_shapes`` (NaFlex), one crop a row beside
    its pixel mask (Idefics), a base view and a tile beside ``image_sizes`` (LLaVA-NeXT), or plain
    [images, channels, 16, 16] (beside ``image_sizes`` where the tower takes them)."""
    names, features = _forward_names(config.model_type), _forward_names(config.model_type, features=True)
    vision = getattr(config, "vision_config", None)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or CHANNELS
    sizes = torch.tensor([[IMAGE, IMAGE]] * images)
    if "image_grid_thw" in names:
        side = IMAGE // PATCH
        width = channels * getattr(vision, "temporal_patch_size", 1) * PATCH**2
        shape = PATCH_SHAPES.get(config.model_type, (width,))
        grid = {"pixel_values": torch.randn(images * side * side, *shape, generator=generator),
                "image_grid_thw": torch.tensor([[1, side, side]] * images)}
        if "image_merge_sizes" in names:  # VideoLLaMA3: each image's own merge (its processor's, 1 for images)
            grid["image_merge_sizes"] = torch.ones(images, dtype=torch.long)
        return grid
    if "image_position_ids" in names:  # Gemma 4: each image's flattened patches and their (x, y) positions
        patch = getattr(vision, "model_patch_size", PATCH)  # Gemma 4 unified's embedder: patch x pooling pixels
        side = IMAGE // patch
        positions = torch.tensor([[x, y] for y in range(side) for x in range(side)])
        return {"pixel_values": torch.randn(images, side * side, channels * patch**2, generator=generator),
                "image_position_ids": positions.expand(images, -1, -1).clone()}
    if "spatial_shapes" in names:  # NaFlex (LFM2-VL): each image's flattened patches, grid and patch mask
        side = IMAGE // PATCH
        return {"pixel_values": torch.randn(images, side * side, channels * PATCH**2, generator=generator),
                "spatial_shapes": torch.tensor([[side, side]] * images),
                "pixel_attention_mask": torch.ones(images, side * side, dtype=torch.bool)}
    if "pixel_attention_mask" in names:  # one crop an image; Granite-Docling's mask marks real tiles, not pixels
        tiles = (images, 1) if config.model_type == "granite_docling" else (images, 1, IMAGE, IMAGE)
        return {"pixel_values": torch.randn(images, 1, channels, IMAGE, IMAGE, generator=generator),
                "pixel_attention_mask": torch.ones(tiles, dtype=torch.bool)}
    if getattr(config, "image_grid_pinpoints", None):
        return {"pixel_values": torch.randn(images, 2, channels, IMAGE, IMAGE, generator=generator),
                "image_sizes": sizes}
    pixels = {"pixel_values": torch.randn(images, channels, IMAGE, IMAGE, generator=generator)}
    return {**pixels, "image_sizes": sizes} if "image_sizes" in features else pixels


@functools.cache
def _tokens_per_image(config_json: str, model_type: str) -> int:
    """How many placeholder tokens one image takes: the rows of the model's own image features for one image,
    measured on a model built under a forked RNG so the caller's seeds are untouched."""
    config = CONFIG_MAPPING[model_type].from_dict(json.loads(config_json))
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config).eval()
        pixels = image_pixels(config, 1, torch.Generator().manual_seed(0))
        inner = getattr(model, "model", model)
        features = getattr(inner, "get_image_features", None) or model.get_image_features
        accepted = set(inspect.signature(features).parameters)
        output = features(**{k: v for k, v in pixels.items() if k in accepted or "kwargs" in accepted})
    if hasattr(output, "last_hidden_state"):  # projected features, else (Llama4) the tower's, projected later
        output = output.last_hidden_state if output.pooler_output is None else output.pooler_output
    tensors = list(output) if isinstance(output, (list, tuple)) else [output]
    return sum(t.numel() // t.shape[-1] for t in tensors)


def image_text_batch(config: PretrainedConfig, images_per_row: list[int], text: int = 6, seed: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor],
                                dict[str, torch.Tensor]]:
    """Rows of each row's images (placeholder tokens, between the start/end tokens where the config has them) then
    ``text`` random text tokens, labels on the text only, right-padded; pixel tensors by image in row order (none
    for a row without images), and ``extras``: the per-token tensors the forward reads ([rows, seq])."""
    generator = torch.Generator().manual_seed(seed)
    image, start, end = _image_token(config), _first_id(config, START_KEYS), _first_id(config, END_KEYS)
    per_image = _tokens_per_image(config.to_json_string(), config.model_type)
    wrapped = [t for t in (start,) if t is not None] + [image] * per_image + [t for t in (end,) if t is not None]
    values = config.to_dict()
    low = min([_vocab(values)] + [values[k] for k in _special_keys(values)])
    rows, kinds = [], []
    for count in images_per_row:
        words = torch.randint(3, low, (text,), generator=generator).tolist()
        rows.append(wrapped * count + words)
        kinds.append([2 if t == image else 1 for t in wrapped] * count + [0] * text)  # 2 image, 1 marker, 0 text
    length = max(len(r) for r in rows)
    pad = [length - len(r) for r in rows]
    input_ids = torch.tensor([r + [0] * p for r, p in zip(rows, pad)])
    kind = torch.tensor([k + [-1] * p for k, p in zip(kinds, pad)])
    attention_mask = (kind >= 0).long()
    labels = torch.where(kind == 0, input_ids, torch.full_like(input_ids, -100))
    total = sum(images_per_row)
    pixels = image_pixels(config, total, generator) if total else {}
    names = _forward_names(config.model_type)
    extras = {}
    if "mm_token_type_ids" in names:
        extras["mm_token_type_ids"] = (kind == 2).long()
    if "token_type_ids" in names:  # PaliGemma: 0 on the bidirectional prefix, 1 on the suffix; Gemma3: 1 on images
        extras["token_type_ids"] = (kind == 0).long() if config.model_type == "paligemma" else (kind == 2).long()
    return input_ids, attention_mask, labels, pixels, extras


def _line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def check(model_type: str, images_per_row: tuple[int, ...] = (1, 2, 0, 1)) -> str:
    """"pass" when the tiny model runs forward with labels on a batch of ``images_per_row`` and backward gives a
    finite loss and finite gradients reaching the vision tower, else "refused: <step>: <why>" in one line."""
    step = "config"
    try:
        config = tiny_image_text_config(model_type)
        step = "model"
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config).float().train()
        count = sum(p.numel() for p in model.parameters())
        if count >= MAX_TINY_PARAMETERS:
            return f"refused: model: {count:,} parameters, over the {MAX_TINY_PARAMETERS:,} a tiny model may have"
        step = "batch"
        input_ids, attention_mask, labels, pixels, extras = image_text_batch(config, list(images_per_row))
        step = "forward"
        if model_type in TUPLE_FORWARD:
            model.config.return_dict = False
            extras = {**extras, "return_dict": True}
        output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **pixels, **extras)
        loss = output[0] if isinstance(output, tuple) else output.loss
        if loss is None or not torch.isfinite(loss):
            return f"refused: forward: loss {loss}"
        step = "backward"
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        bad = next((n for n, g in grads.items() if not torch.isfinite(g).all()), None)
        if bad is not None:
            return f"refused: backward: non-finite gradient of {bad}"
        if not any(g.abs().sum() > 0 for n, g in grads.items() if _is_vision(n)):
            return "refused: backward: no gradient reaches the vision tower"
    except Exception as error:  # one line of what failed, for the sweep's table
        return f"refused: {step}: {_line(error)}"
    return "pass"


def _is_vision(name: str) -> bool:
    return any(part in name for part in ("vision", "visual", "image", "projector", "patch", "vit"))


def table() -> list[tuple[str, str]]:
    """(model type, check result) for every image-text-to-text type of the installed transformers."""
    return [(model_type, check(model_type)) for model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES]


if __name__ == "__main__":
    for model_type, result in table():
        print(f"{model_type:28s} {result}")
