"""The base a LoRA checkpoint refers to: it saves only the adapters, plus where the frozen weights came from.

A reference is ``{"kind": "hf", "path": ..., "identity": {file: [size, xxh3_64]}}`` for a model directory, or
``{"kind": "init", "seed": ...}`` for seeded random weights (reproducible from the config and the seed). Resume
and ``plait consolidate --lora`` reload the base from it, and refuse a directory whose files changed since.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

from plait.base.config import ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin")
CHUNK = 1 << 24


def identity(path: Path) -> dict[str, list]:
    """Size and xxh3_64 of every weight file of a model directory (xxh3 reads several GB/s)."""
    found = {}
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        digest = xxhash.xxh3_64()
        with open(file, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        found[file.name] = [file.stat().st_size, digest.hexdigest()]
    return found


def base_reference(kind: str, path: Path | None, seed: int) -> dict[str, Any]:
    """The reference to the frozen base a LoRA run was built from (``materialize``'s kind and path)."""
    if kind == "hf":
        path = Path(path).resolve()
        return {"kind": "hf", "path": str(path), "identity": identity(path)}
    if kind == "init":
        return {"kind": "init", "seed": seed}
    raise ConfigError(f"a LoRA base must be a model directory or seeded init, not a {kind}")


def base_source(reference: dict[str, Any], seed: int) -> tuple[str, Path | None, int]:
    """``base_reference``'s inverse: the kind, path and seed ``materialize`` builds the frozen base from (``seed``
    where the reference holds none)."""
    kind = reference["kind"]
    return kind, Path(reference["path"]) if kind == "hf" else None, reference.get("seed", seed)


def check_base(reference: dict[str, Any], where: str) -> None:
    """Raise ConfigError when the base directory a LoRA checkpoint names is gone or its weights changed."""
    if reference["kind"] != "hf":
        return
    path = Path(reference["path"])
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where} is a LoRA checkpoint of the base model {path}, which no longer exists; "
                          f"restore that directory (the checkpoint holds only the adapters)")
    found = identity(path)
    if found != reference["identity"]:
        changed = sorted(n for n in set(found) | set(reference["identity"]) if found.get(n) != reference["identity"].get(n))
        raise ConfigError(f"{where} is a LoRA checkpoint of {path}, whose weight files changed since "
                          f"(differences: {changed[:4]}); restore the original base")


def saved_lora(extra: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """(peft LoraConfig, base reference) a checkpoint's extra state records, or None for a full checkpoint."""
    from peft import LoraConfig

    record = extra.get("lora")
    if record is None:
        return None
    fields = LoraConfig.__dataclass_fields__
    config = LoraConfig(**{k: v for k, v in record["config"].items() if k in fields and k != "peft_type"})
    return config, record["base"]


def lora_record(pmodel) -> dict[str, Any]:
    """What a checkpoint of a LoRA run records beside the adapters: the config and the base reference."""
    config = pmodel.plan.lora.config.to_dict()
    config["target_modules"] = sorted(config["target_modules"]) if isinstance(config["target_modules"], (set, list)) \
        else config["target_modules"]
    return {"config": {k: v for k, v in config.items() if _json_safe(v)}, "base": pmodel.lora_base}


def _json_safe(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))
