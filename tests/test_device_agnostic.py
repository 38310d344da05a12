"""plait names no device type outside ``core/plait/base/device.py``, and that module answers from torch's own tables.

The scan: every ``.py`` under core/, adapters/, scripts/ and examples/ is tokenized, and any token but a comment
that contains "cuda" in any case (a name such as ``torch.cuda``, a method ``.cuda()``, a string, a docstring,
a help text) fails, named by file and line. Comments may mention CUDA (a measurement, a reason). bench/ and
tests/ are not scanned: they measure or test the CUDA path on purpose. ``plait.base.device`` itself is checked on
the CPU, with torch's accelerator API stood in for where a test needs an accelerator (an XPU, a PrivateUse1
backend, CUDA for the behaviour that must not change).
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.base import comm
from plait.base import device
from plait.base.config import ConfigError
from plait.run.runtime import init_distributed
from plait.run.runtime import pick_device as runtime_pick_device

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("core", "adapters", "scripts", "examples")
DEVICE_MODULE = ROOT / "core" / "plait" / "base" / "device.py"


def cuda_mentions(path: Path) -> list[int]:
    """The lines of ``path`` where a token other than a comment contains "cuda" (any case)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return sorted({tok.start[0] + offset for tok in tokens if tok.type != tokenize.COMMENT
                   for offset, text in enumerate(tok.string.split("\n")) if "cuda" in text.lower()})


def violations(root: Path) -> list[str]:
    """``file:line`` for every mention of cuda in the scanned folders, device.py excepted."""
    found = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            if path.resolve() != DEVICE_MODULE.resolve():
                found += [f"{path.relative_to(root)}:{line}" for line in cuda_mentions(path)]
    return found


def test_no_device_type_is_named_outside_device_py():
    found = violations(ROOT)
    assert not found, ("these name cuda; ask plait.base.device (core/plait/base/device.py) instead:\n" + "\n".join(found))


def test_the_scan_finds_a_planted_mention_and_spares_comments(tmp_path):
    """The scan can fail: a planted call, string and docstring are found; a comment is not."""
    planted = tmp_path / "core" / "plait" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text('"""Runs on\nCUDA."""\n'
                       "import torch\n"
                       "# CUDA: a comment may say so\n"
                       "torch.cuda.synchronize()\n"
                       "x = torch.zeros(1).Cuda()\n"
                       "name = f'{1}cuda'\n")
    assert cuda_mentions(planted) == [2, 5, 6, 7]  # a docstring's line is the one that says it
    assert violations(tmp_path) == ["core/plait/planted.py:2", "core/plait/planted.py:5",
                                    "core/plait/planted.py:6", "core/plait/planted.py:7"]
    assert cuda_mentions(DEVICE_MODULE), "device.py names cuda nowhere? then the scan reads nothing"


# --------------------------------------------------------------------------------------------------
# plait.base.device on the CPU, with torch's accelerator stood in for
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def found(monkeypatch):
    """Make torch's accelerator API report ``found(type)`` (None: no accelerator); LOCAL_RANK is 3."""
    monkeypatch.setenv("LOCAL_RANK", "3")

    def stand_in(kind: str | None) -> None:
        fake = None if kind is None else torch.device(kind)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: fake)

    return stand_in


def test_cpu_without_an_accelerator(found):
    found(None)
    assert device.pick_device("auto") == device.pick_device("cpu") == torch.device("cpu")
    assert runtime_pick_device("auto") == torch.device("cpu")  # the older name still works
    assert device.default_backend(torch.device("cpu")) == "gloo"
    assert device.current_device() == torch.device("cpu")
    assert comm.device_for(None) == torch.device("cpu")
    assert not device.use_fused_adamw(torch.device("cpu"))
    assert device.peak_memory_bytes(torch.device("cpu")) is None
    device.set_device(torch.device("cpu"))  # no-ops on the CPU
    device.synchronize(torch.device("cpu"))
    device.reset_peak_memory(torch.device("cpu"))


def test_an_xpu_is_picked_with_torchs_backend(found):
    found("xpu")
    assert device.pick_device("auto") == device.pick_device("xpu") == torch.device("xpu", 3)
    assert device.pick_device("xpu:1") == torch.device("xpu", 1)
    assert device.pick_device("cpu") == torch.device("cpu")
    assert device.default_backend(torch.device("xpu", 3)) == dist.get_default_backend_for_device("xpu")
    assert device.use_fused_adamw(torch.device("xpu", 3))


def test_cuda_behaves_as_before(found):
    """What the code did before plait.base.device: cuda:LOCAL_RANK, NCCL, AdamW fused on the GPU only."""
    found("cuda")
    assert device.pick_device("auto") == device.pick_device("cuda") == torch.device("cuda", 3)
    assert device.default_backend(torch.device("cuda", 3)) == "nccl"
    assert device.use_fused_adamw(torch.device("cuda", 3)) and not device.use_fused_adamw(torch.device("cpu"))


def test_the_accelerator_api_is_what_is_called(found, monkeypatch):
    found("xpu")
    calls = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: calls.append(("set", index)))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 2)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda d=None: calls.append(("sync", d)))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda d=None: 123)
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda d=None: calls.append(("reset", d)))
    xpu = torch.device("xpu", 2)
    device.set_device(xpu)
    device.synchronize(xpu)
    device.reset_peak_memory(xpu)
    assert device.current_device() == xpu and device.peak_memory_bytes(xpu) == 123
    assert calls == [("set", 2), ("sync", xpu), ("reset", xpu)]
    device.set_device(torch.device("xla"))  # a type torch's accelerator API does not manage: left alone
    device.synchronize(torch.device("cpu"))
    assert device.peak_memory_bytes(torch.device("xla")) is None and len(calls) == 3


def test_a_privateuse1_backend_passes_through(found, monkeypatch):
    """A PrivateUse1 backend (its name here torch's default, ``privateuseone``) is used as named; its
    torch.distributed backend is the one it registered for its device type, and AdamW is not fused on it."""
    name = torch._C._get_privateuse1_backend_name()
    found(None)
    assert device.pick_device(name) == torch.device(name)
    assert device.pick_device("xla") == torch.device("xla")  # XLA is no accelerator of torch's API: as named
    found(name)
    assert device.pick_device("auto") == torch.device(name, 3)
    with pytest.raises(ValueError, match="--backend"):  # none registered for it yet
        device.default_backend(torch.device(name, 3))
    monkeypatch.setitem(dist.Backend.default_device_backend_map, name, "its_own")
    assert device.default_backend(torch.device(name, 3)) == "its_own"
    assert not device.use_fused_adamw(torch.device(name, 3))


@pytest.mark.skipif(dist.is_initialized(), reason="a process group already exists in this process")
def test_auto_backend_for_a_type_torch_has_none_for_says_to_name_one(found, monkeypatch):
    found(None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="no default backend for device type 'xla'; name one with --backend"):
        init_distributed(torch.device("xla"), "auto", 10)
    assert not dist.is_initialized()
