"""Worker: MoE model directories saved by transformers (experts stored one by one) loaded at tp=2 and ep=2.

``python hf_moe_load.py DIRS OUT``, world of 2: DIRS holds one ``save_pretrained`` directory per family (the
test writes them). For each family and layout every rank loads its directory through plait, compares each
local parameter and persistent buffer with its slice of transformers' own load of the directory
(``ShardSpec.slice_full``) and counts the bytes it read of each stored tensor (``st_io._pread`` wrapped: every
tensor byte plait reads goes through it). Each rank writes ``rank<R>.json``: {"arch|layout": {"mismatched":
[names], "checked": count, "experts": [first, stop) held, "read": {stored key: bytes}}}.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from plait.base.config import ParallelConfig
from plait.checkpoint import st_io
from plait.checkpoint.materialize import load_parallel_model
from plait.checkpoint.state import persistent_buffers

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")
LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2)}
READS: list[tuple[str, int, int]] = []  # (file, offset, bytes) of every read since the last case


def _counting_pread(fd, view, offset, path) -> None:
    READS.append((str(path), offset, len(view)))
    _pread(fd, view, offset, path)


_pread, st_io._pread = st_io._pread, _counting_pread


def bytes_read() -> dict[str, int]:
    """Bytes read of each stored tensor since the last call, by the tensor the read starts in."""
    found: dict[str, int] = defaultdict(int)
    headers = {path: st_io.SafetensorsFile(path).entries for path in {path for path, _, _ in READS}}
    for path, offset, size in READS:
        key = next(k for k, e in headers[path].items() if e.start <= offset < e.stop)
        found[key] += size
    READS.clear()
    return dict(found)


def run_case(path: Path, layout: dict) -> dict:
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    READS.clear()
    pmodel = load_parallel_model(path, ParallelConfig(**layout))
    read = bytes_read()
    local = {name: p.detach() for name, p in pmodel.module.named_parameters()}
    wanted = {name: pmodel.param_specs[name].slice_full(reference[name]) for name in local}
    buffers = persistent_buffers(pmodel.module)
    local.update(buffers)
    wanted.update({name: reference[name] for name in buffers})
    mismatched = [name for name in local if not torch.equal(local[name], wanted[name])]
    held = {spec.experts for spec in pmodel.param_specs.values() if spec.experts is not None}
    return {"mismatched": mismatched, "checked": len(local), "experts": sorted(held), "read": read}


def main() -> None:
    dirs, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    results = {f"{arch}|{name}": run_case(dirs / arch, layout) for arch in ARCHS for name, layout in LAYOUTS.items()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
