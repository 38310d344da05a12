"""An image-text model's processor, read from its model dir: what renders, tokenizes and encodes image-text rows.

transformers' ``AutoProcessor`` loads every part a processor class declares, and Qwen2-VL's, Qwen2.5-VL's,
Qwen3-VL's, LLaVA-OneVision's and SmolVLM's declare a video processor, which needs torchvision: without it (a CPU
build of torch, where the registry's torchvision does not load) the whole processor fails to load, though training on
image rows never calls the video part. There the processor is loaded again without its video processor (its image
processor then has a PIL backend, as transformers picks one without torchvision) and works on image rows as the whole
one would; a dir whose processor fails for any other reason is refused in one line.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from plait.base.config import ConfigError

# where a model dir names its processor class, in the order transformers' AutoProcessor reads them
NAMED_IN = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
            "tokenizer_config.json")


def one_line(err: BaseException) -> str:
    """An exception's message on one line: transformers' and PIL's messages span several."""
    return " ".join(str(err).split()) or type(err).__name__


def load_processor(model_dir: str | Path) -> Any:
    """The model dir's processor (tokenizer + image processor + chat template), from local files only: a
    training run must never reach the network, and a dir without a processor must fail at start-up in one
    line rather than as a traceback from inside transformers. Without torchvision, a processor whose video part
    needs it is loaded without that part (module docstring)."""
    from transformers import AutoProcessor

    try:
        try:
            processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        except ImportError as missing:  # a part needs a library that is not installed: the video one, then drop it
            processor = _without_video(model_dir, missing)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... for a dir it cannot read
        raise ConfigError(f"{model_dir}: no processor could be loaded ({one_line(err)}); image-text training needs "
                          f"the model's processor files (preprocessor_config.json, tokenizer) in the dir") from err
    if not (hasattr(processor, "image_processor") and hasattr(processor, "tokenizer")):
        raise ConfigError(f"{model_dir}: holds a {type(processor).__name__}, not an image-text processor; image-text "
                          f"training needs the model's processor (preprocessor_config.json) in the dir")
    return processor


def processor_of(folder: str | Path, model_config: Any) -> Any:
    """An image-text model's processor in ``folder`` (where its data's was read), for its checkpoints to save; None
    for a text model."""
    from plait.base.meta import takes_images  # transformers' model classes: only once a model is at hand

    return load_processor(folder) if takes_images(model_config) else None


def _without_video(model_dir: str | Path, missing: ImportError) -> Any:
    """The processor of ``model_dir`` without its video processor, whose library (``missing``) is not installed
    (``images_only``). ``missing`` again where the class has no video part, or loading without it still needs the
    library."""
    whole = _processor_class(Path(model_dir))
    if whole is None or not any("video" in part for part in whole.get_attributes()):
        raise missing
    return images_only(whole).from_pretrained(str(model_dir), local_files_only=True)


@functools.cache
def images_only(whole: type) -> type:
    """The processor class ``whole``'s subclass of the same name that declares every part but its video processor
    (transformers reads a processor's parts from ``get_attributes``); one per class, pickled by its class."""
    parts = [part for part in whole.get_attributes() if "video" not in part]

    def save_pretrained(self: Any, save_directory: str | Path, *args: Any, **kwargs: Any) -> Any:
        """As the whole class saves, and the image processor's config on its own beside it, the file a checkpoint
        from the hub holds: where torchvision is, AutoProcessor builds the video processor from it."""
        saved = whole.save_pretrained(self, save_directory, *args, **kwargs)
        self.image_processor.save_pretrained(save_directory)
        return saved

    return type(whole.__name__, (whole,), {"get_attributes": classmethod(lambda cls: parts), "__reduce__": _reduce,
                                           "save_pretrained": save_pretrained, "__module__": whole.__module__,
                                           "__qualname__": whole.__qualname__})


def _reduce(processor: Any) -> tuple:
    """How an ``images_only`` processor is pickled (its class is not where its name leads): by the whole class."""
    return _blank, (type(processor).__mro__[1],), processor.__dict__


def _blank(whole: type) -> Any:
    cls = images_only(whole)
    return cls.__new__(cls)


def _processor_class(model_dir: Path) -> type | None:
    """The processor class ``model_dir`` names (its processor, image processor or tokenizer config), else its model
    type's in transformers' mapping; None where neither names one."""
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    for name in NAMED_IN:
        path = model_dir / name
        named = json.loads(path.read_text()).get("processor_class") if path.is_file() else None
        if named:
            return processor_class_from_name(named)
    model_type = AutoConfig.from_pretrained(str(model_dir), local_files_only=True).model_type
    named = PROCESSOR_MAPPING_NAMES.get(model_type)
    return processor_class_from_name(named) if named else None
