"""Image-text rows' pixels encoded again off the training thread, a step ahead of the batch that needs them.

A lazy ``VisionEncoder`` keeps no pixel tensors (a real image set's would not fit in memory), so each batch reads its
rows' image files and runs the processor on them again: 4.5 ms of CPU an image at 336 x 336 for CLIP
(bench/vision_memory.py), which, done when the batch is built, adds to every step. Here that work runs on one
background thread with its own copy of the processor (a fast tokenizer refuses calls from two threads at once:
"Already borrowed"), and the trainer names the next step's rows while this step computes
(``TrainingMethod.read_ahead``): PIL's decoding and resizing and numpy's arithmetic release the GIL, so the encoding
overlaps the step's forward and backward (bench/vision_read_ahead.py). The pixels are the same tensors either way, and
a row whose image cannot be read any more still fails when its batch is built, naming the row.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

Pixels = dict[str, torch.Tensor]


class PixelLoader:
    """One background thread and the processor copy only it uses; started by the first encoding it is given."""

    def __init__(self, processor: Any) -> None:
        self.processor = copy.deepcopy(processor)
        self._thread: ThreadPoolExecutor | None = None

    def submit(self, encode: Callable[..., Pixels], *args: Any) -> Future:
        """``encode(processor, *args)`` on the loader's thread."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="plait-pixels")
        return self._thread.submit(encode, self.processor, *args)


class Reload(Protocol):
    """``Example.reload``: called, an example's pixels; ``ahead()`` starts reading them for a batch to come."""

    def __call__(self) -> Pixels: ...

    def ahead(self) -> None: ...


class Encoding:
    """One row's pixels, encoded again on ``loader``'s thread by ``encode(processor, *args)``: started early by
    ``ahead()`` (at most once until they are taken) or when called, which waits for them and forgets them."""

    def __init__(self, loader: PixelLoader, encode: Callable[..., Pixels], *args: Any) -> None:
        self.loader, self.encode, self.args = loader, encode, args
        self._pending: Future | None = None

    @property
    def started(self) -> bool:
        """Whether the pixels are being encoded, or were and are not taken yet."""
        return self._pending is not None

    def ahead(self) -> None:
        if self._pending is None:
            self._pending = self.loader.submit(self.encode, *self.args)

    def __call__(self) -> Pixels:
        self.ahead()
        pending, self._pending = self._pending, None
        return pending.result()


class Joined:
    """A packed row's ``reload``: its documents' pixels (``plait.data.vision.Example``s), one after another, each
    read ahead by its own."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def ahead(self) -> None:
        read_ahead(self.parts)

    def __call__(self) -> Pixels:
        loaded = [pixels_of(part) for part in self.parts]
        return {key: torch.cat([p[key] for p in loaded]) for key in (loaded[0] if loaded else ())}


def pixels_of(example: Any) -> Pixels:
    """An example's image tensors: kept, or encoded again from its row's images (``Example.reload``)."""
    return example.reload() if example.reload is not None else example.pixels


def read_ahead(examples: Iterable[Any]) -> None:
    """Start encoding the pixels of those ``examples`` (``plait.data.vision.Example``) that keep none, each once."""
    for example in examples:
        if example is not None and example.reload is not None:
            example.reload.ahead()
