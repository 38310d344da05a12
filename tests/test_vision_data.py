"""Image-text rows (TRL's vision format) through plait.data.vision, offline: a tiny LLaVA processor (CLIP's PIL image
processor, 16x16 crops in 4x4 patches: 16 image tokens an image) saved and loaded back with load_processor, and a tiny
Qwen2-VL one whose pixel_values count patches. Labels fall on assistant text only, batches cut back into their rows,
and every bad input is one line naming its row."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessorPil, LlavaProcessor, Qwen2VLImageProcessorPil, Qwen2VLProcessor

from plait.base.config import ConfigError
from plait.data.chat_tokenizer import chat_tokenizer
from plait.data.processors import load_processor
from plait.data.vision import VisionBatch, VisionEncoder, collate, read_rows

WORDS = ["describe the picture", "a red square on blue", "what colour is it", "blue", "you see images"]
IMAGE_TOKENS = (16 // 4) ** 2


def template(image: str) -> str:
    """ChatML rendering image parts as ``image``, str or list content (as vision templates are written)."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + image +
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer(*specials: str):
    tok = chat_tokenizer(WORDS * 20, 300)
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    return tok


def llava(chat_template: str | None, crop: int = 16) -> LlavaProcessor:
    images = CLIPImageProcessorPil(size={"shortest_edge": crop}, crop_size={"height": crop, "width": crop})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer("<image>"), patch_size=4,
                          vision_feature_select_strategy="full", image_token="<image>", chat_template=chat_template)


def picture(seed: int, height: int = 12, width: int = 20) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def turn(role: str, *parts) -> dict:
    return {"role": role, "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


def save_tiny_llava(root: Path) -> None:
    """A tiny LLaVA (CLIP tower, Llama decoder) and its processor in ``root / "model"``, and pictures 0-2.png."""
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = tokenizer("<image>")
    images = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=4, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, image_token="<image>",
                   chat_template=template("<image>")).save_pretrained(root / "model")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1, vision_feature_select_strategy="default")).save_pretrained(root / "model")
    for seed in range(3):
        picture(seed).save(root / f"{seed}.png")


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    llava(template("<image>")).save_pretrained(directory)
    return load_processor(directory)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("images")
    for seed in range(3):
        picture(seed).save(directory / f"{seed}.png")
    (directory / "broken.png").write_bytes(b"not a png")
    return directory


ROWS = [
    {"messages": [{"role": "system", "content": "you see images"}, turn("user", "what colour is it"),
                  {"role": "assistant", "content": "blue"}], "images": []},
    {"messages": [turn("user", None, "describe the picture"), turn("assistant", "a red square on blue")],
     "images": ["0.png"]},
    {"messages": [turn("user", None, "describe", None), turn("assistant", "a red square"), turn("user", "what colour"),
                  turn("assistant", "blue")], "images": ["1.png", "2.png"]},
]


def test_load_processor_reads_a_saved_processor_offline(processor):
    assert isinstance(processor, LlavaProcessor)
    assert isinstance(processor.image_processor, CLIPImageProcessorPil)
    assert processor.chat_template == template("<image>")


def test_labels_fall_on_assistant_text_and_end_of_turn_only(processor, files):
    encoder = VisionEncoder(processor, files)
    example = encoder.encode(ROWS[2], "row 2")
    labelled = example.labels != -100
    assert torch.equal(example.labels[labelled], example.input_ids[labelled])
    image = example.input_ids == processor.image_token_id
    assert int(image.sum()) == 2 * IMAGE_TOKENS and not labelled[image].any()
    runs = np.split(np.flatnonzero(labelled.numpy()), np.flatnonzero(np.diff(np.flatnonzero(labelled.numpy())) > 1) + 1)
    decoded = [processor.tokenizer.decode(example.input_ids[run]) for run in runs]
    assert decoded == ["a red square<|im_end|>\n", "blue<|im_end|>\n"]
    assert example.num_images == 2 and example.pixels["pixel_values"].shape == (2, 3, 16, 16)
    assert encoder.encode(ROWS[0], "row 0").pixels == {}


def test_image_tokens_inside_an_assistant_turn_get_no_label(processor):
    row = {"messages": [turn("user", "describe the picture"), turn("assistant", "a red", None, " square")],
           "images": [picture(5)]}
    example = VisionEncoder(processor).encode(row, "row 0")
    labelled = example.labels != -100
    assert not labelled[example.input_ids == processor.image_token_id].any()
    assert processor.tokenizer.decode(example.input_ids[labelled]) == "a red square<|im_end|>\n"


def test_every_image_form_gives_the_same_pixels(processor, files):
    image = Image.open(files / "0.png")
    forms = ["0.png", str(files / "0.png"), png(image), image, {"bytes": png(image), "path": None},
             {"bytes": None, "path": "0.png"}]
    encoder = VisionEncoder(processor, files)
    pixels = [encoder.encode({**ROWS[1], "images": [form]}, "row 1").pixels["pixel_values"] for form in forms]
    assert all(torch.equal(p, pixels[0]) for p in pixels)


def as_parts(content) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def test_jsonl_and_parquet_rows_read_back(processor, files, tmp_path):
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(row) for row in ROWS) + "\n\n")
    assert read_rows(tmp_path / "rows.jsonl") == [(f"line {n}", row) for n, row in enumerate(ROWS, start=1)]
    # as a datasets Image column stores them: {bytes, path} structs, every part with every field
    stored = [{"messages": [{"role": m["role"], "content": [{"type": p["type"], "text": p.get("text")}
                                                            for p in as_parts(m["content"])]}
                            for m in row["messages"]],
               "images": [{"bytes": (files / name).read_bytes(), "path": None} for name in row["images"]]}
              for row in ROWS]
    pq.write_table(pa.Table.from_pylist(stored), tmp_path / "rows.parquet")
    encoder = VisionEncoder(processor, files)
    parquet_rows = read_rows(tmp_path / "rows.parquet")
    assert [place for place, _ in parquet_rows] == [f"row {n}" for n in range(1, len(ROWS) + 1)]
    for row, (place, parquet_row) in zip(ROWS, parquet_rows):
        a, b = encoder.encode(row, place), encoder.encode(parquet_row, place)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert a.pixels.keys() == b.pixels.keys() and all(torch.equal(a.pixels[k], b.pixels[k]) for k in a.pixels)


def assert_same_rows(cut: VisionBatch, alone: VisionBatch) -> None:
    """``cut`` (rows taken from a wider batch) equals ``alone`` (those rows collated by themselves) up to padding."""
    width = alone.input_ids.shape[1]
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(getattr(cut, key)[:, :width], getattr(alone, key)), key
    assert (cut.attention_mask[:, width:] == 0).all()
    held = {key: value for key, value in cut.images.tensors.items() if len(value)}  # none of rows without images
    assert held.keys() == alone.images.tensors.keys()
    for key, value in alone.images.tensors.items():
        got = held[key]
        assert torch.equal(got[:, :width] if key in alone.images.row_major else got, value), key
    assert torch.equal(cut.images.per_row, alone.images.per_row)


def check_cuts(examples, pad_id: int) -> None:
    batch = collate(examples, pad_id)
    assert batch.images.per_row.tolist() == [e.num_images for e in examples]
    for start in range(len(examples)):
        for stop in range(start + 1, len(examples) + 1):
            assert_same_rows(batch.take(slice(start, stop)), collate(examples[start:stop], pad_id))


def test_rows_with_0_1_2_images_collate_and_cut_back(processor, files):
    encoder = VisionEncoder(processor, files)
    examples = [encoder.encode(row, f"row {i}") for i, row in enumerate(ROWS)]
    pad_id = processor.tokenizer.pad_token_id
    batch = collate(examples, pad_id)
    width = max(len(e.input_ids) for e in examples)
    assert batch.input_ids.shape == batch.labels.shape == (3, width)
    assert batch.images.tensors["pixel_values"].shape == (3, 3, 16, 16)
    assert torch.equal(batch.images.tensors["pixel_values"][1:], examples[2].pixels["pixel_values"])
    assert (batch.labels[0, len(examples[0].input_ids):] == -100).all()
    assert (batch.input_ids[0, len(examples[0].input_ids):] == pad_id).all()
    check_cuts(examples, pad_id)
    check_cuts(examples[::-1], pad_id)


def test_rows_whose_pixels_differ_in_shape_are_refused_naming_them(processor, files):
    small = VisionEncoder(llava(template("<image>"), crop=8), files).encode(ROWS[1], "b.jsonl line 4")
    assert small.pixels["pixel_values"].shape == (1, 3, 8, 8) and small.labels.ne(-100).any()
    large = VisionEncoder(processor, files).encode(ROWS[1], "a.jsonl line 1")
    with pytest.raises(ConfigError, match=one_line(
            "a.jsonl line 1 and b.jsonl line 4: the processor gives their images pixel_values of shapes (1, 3, 16, 16) "
            "and (1, 3, 8, 8), which cannot be concatenated into one batch")):
        collate([large, small], 0)


class ImageOnlyQwen2VL(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor, which needs torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)


def test_qwen2_vl_pixel_patches_are_cut_by_image_grid(files):
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=1024)
    processor = ImageOnlyQwen2VL(images, tokenizer("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
                                 chat_template=template("<|vision_start|><|image_pad|><|vision_end|>"))
    rows = [{**ROWS[2], "images": [picture(1), picture(2, 30, 17)]}, ROWS[0], {**ROWS[1], "images": [picture(3)]}]
    encoder = VisionEncoder(processor, files)
    examples = [encoder.encode(row, f"row {i}") for i, row in enumerate(rows)]
    grid = examples[0].pixels["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4], [1, 8, 4]] and examples[0].pixels["pixel_values"].shape == (48, 96)
    assert int((examples[0].input_ids == processor.image_token_id).sum()) == 48 // 4
    labelled = examples[0].labels != -100
    assert not labelled[examples[0].input_ids == processor.image_token_id].any()
    assert processor.tokenizer.decode(examples[0].input_ids[labelled]) == "a red square<|im_end|>\nblue<|im_end|>\n"
    assert "mm_token_type_ids" in examples[0].tokens
    check_cuts(examples, processor.tokenizer.pad_token_id)


def one_line(message: str) -> str:
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize("row, message", [
    ({**ROWS[2], "images": ["1.png"]},
     'data.jsonl line 7: 1 images for 2 image parts in its messages; give one image per {"type": "image"} part, '
     'in order'),
    ({**ROWS[1], "images": ["https://example.com/cat.png"]},
     ("data.jsonl line 7: images[0] is a URL (https://example.com/cat.png); images are read offline: download it "
      "and give its path")),
    ({"images": []}, "data.jsonl line 7: has no messages (a non-empty list of {role, content} turns)"),
    ({"messages": [], "images": []}, "data.jsonl line 7: has no messages (a non-empty list of {role, content} turns)"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "data.jsonl line 7: messages[0].content[0] is not an image or text part (got {'type': 'video'})"),
])
def test_bad_rows_are_one_line_naming_the_row(processor, files, row, message):
    with pytest.raises(ConfigError, match=one_line(message)):
        VisionEncoder(processor, files).encode(row, "data.jsonl line 7")


@pytest.mark.parametrize("name, reason", [("broken.png", "cannot identify image file"),
                                          ("missing.png", "No such file or directory")])
def test_an_unreadable_image_is_one_line_naming_its_path(processor, files, name, reason):
    prefix = f"data.jsonl line 3: images[1] ({files / name}) cannot be read: "
    with pytest.raises(ConfigError, match="^" + re.escape(prefix) + f"[^\n]*{reason}[^\n]*$"):
        VisionEncoder(processor, files).encode({**ROWS[2], "images": ["1.png", name]}, "data.jsonl line 3")


def test_a_processor_without_chat_template_is_refused():
    with pytest.raises(ConfigError, match=one_line(
            "the LlavaProcessor: the processor has no chat template, which renders the conversations; give a model dir "
            "whose processor has one (chat_template.jinja)")):
        VisionEncoder(llava(None))


def test_a_dir_without_a_processor_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="^" + re.escape(f"{tmp_path}: no processor could be loaded (") + r"[^\n]*"
                       + re.escape("); image-text training needs the model's processor files "
                                   "(preprocessor_config.json, tokenizer) in the dir") + "$"):
        load_processor(tmp_path)


def test_bad_files_are_one_line(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(ConfigError, match=one_line(f"{tmp_path / 'rows.jsonl'} line 2: not JSON (Expecting property "
                                                   f"name enclosed in double quotes at column 2)")):
        read_rows(tmp_path / "rows.jsonl")
    with pytest.raises(ConfigError, match=one_line(f"{tmp_path / 'rows.csv'}: image-text rows are read from .jsonl or "
                                                   f".parquet files")):
        read_rows(tmp_path / "rows.csv")


def test_lazy_examples_keep_no_pixels_and_give_the_same_batches(processor, files):
    """``VisionEncoder(lazy=True)``, as training and GRPO / DPO read their rows: each example keeps its ids, labels and
    per-token tensors but no pixel tensor (a training set's would not fit in memory: bench/vision_memory.py), and a
    batch, packed or not, encodes them again into the same tensors as the examples that kept them."""
    from plait.data.pixel_loader import pixels_of
    from plait.data.vision import pack

    eager = [VisionEncoder(processor, files).encode(row, f"row {i}") for i, row in enumerate(ROWS)]
    lazy = [VisionEncoder(processor, files, lazy=True).encode(row, f"row {i}") for i, row in enumerate(ROWS)]
    assert [e.pixels for e in lazy] == [{}, {}, {}] and [e.reload is None for e in lazy] == [True, False, False]
    for a, b in zip(eager, lazy):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert pixels_of(a).keys() == pixels_of(b).keys()
        assert all(torch.equal(pixels_of(a)[k], pixels_of(b)[k]) for k in pixels_of(a))
    for first, second in ((eager, lazy), (pack(eager, 4096), pack(lazy, 4096))):
        a, b = collate(first, 0), collate(second, 0)
        assert a.images.tensors.keys() == b.images.tensors.keys()
        assert all(torch.equal(a.images.tensors[k], b.images.tensors[k]) for k in a.images.tensors)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.images.per_row, b.images.per_row)
    assert pack(lazy, 4096)[0].pixels == {}  # packing keeps none either


class Recorded:
    """A processor that records the thread of each call (the loader's copy: the training thread must never use it,
    as a fast tokenizer refuses two threads at once)."""

    def __init__(self, processor):
        self.processor, self.threads = processor, []

    def __call__(self, *args, **kwargs):
        import threading

        self.threads.append(threading.current_thread().name)
        return self.processor(*args, **kwargs)


def test_read_ahead_encodes_a_batchs_pixels_once_on_the_loaders_thread(processor, files, tmp_path):
    """``read_ahead`` (the trainer's, for the next step during this one) starts each lazy example's pixels on the
    loader's one thread with its own processor; the batch built later takes them, encoding nothing again, and equals
    the one built without reading ahead; a packed row reads its documents'. An image gone before its batch is built
    still fails there, naming its row."""
    import shutil

    from plait.data.pixel_loader import read_ahead
    from plait.data.vision import pack

    encoder = VisionEncoder(processor, files, lazy=True)
    assert encoder.loader.processor is not processor and encoder.loader.processor.tokenizer is not processor.tokenizer
    recorded = encoder.loader.processor = Recorded(encoder.loader.processor)
    examples = [encoder.encode(row, f"row {i}") for i, row in enumerate(ROWS)]
    expected = collate(examples, 0)
    assert len(recorded.threads) == 2  # the two rows with images, each once, encoded when the batch was built
    read_ahead([*examples, None])
    assert [e.reload is not None and e.reload.started for e in examples] == [False, True, True]
    batch = collate(examples, 0)
    assert len(recorded.threads) == 4 and not any(e.reload.started for e in examples[1:])
    assert all(name.startswith("plait-pixels") for name in recorded.threads), recorded.threads
    assert all(torch.equal(batch.images.tensors[k], expected.images.tensors[k]) for k in expected.images.tensors)
    packed = pack(examples, 4096)
    read_ahead(packed)
    assert [e.reload.started for e in examples[1:]] == [True, True] and len(pack(examples, 4096)) == 1
    assert torch.equal(collate(packed, 0).images.tensors["pixel_values"], expected.images.tensors["pixel_values"])
    assert len(recorded.threads) == 6
    moved = tmp_path / "images"
    shutil.copytree(files, moved)
    gone = VisionEncoder(processor, moved, lazy=True).encode(ROWS[1], "row 1")
    (moved / "0.png").unlink()
    read_ahead([gone])
    with pytest.raises(ConfigError, match=r"^row 1: images\[0\] \(.*0.png\) cannot be read: "):
        collate([gone], 0)
