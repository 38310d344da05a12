"""Worker of scripts/vision_sweep.py, a world of 2: ``python -m plait_transformers.vision_sweep_worker PLAN.json OUT``:
for each ``[type, [mode, ...]]`` of PLAN, tiny_vision's model, one process's reference in fp32 and float64 and each
mode's copy trained in both (as tests/workers/vlm_parity.py), a JSON line a case to ``OUT.RANK``. A case has a default
process group of its own (gloo over a key prefix of one TCP store): collectives an exception left unmatched cannot pair
with the next case's; a rank whose partner stays stuck in a case (plait's groups wait 30 minutes), or a watchdog where
both are, records that and ends the world, which the sweep restarts on the cases left."""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from plait import AdapterError, ConfigError
from plait.testing.conformance_worker import Float64Throughout
from plait_transformers.vision_parity import (as_double, compare, padded, reference, sweep_config, tiny_batches,
                                              tiny_model, train)

LAYOUTS = {"tp2-sp": {"tp": 2}, "zero3-dp2": {"zero_stage": 3}, "pp2": {"pp": 2, "num_microbatches": 2},
           "cp2": {"cp": 2}}
PER_ROW = [[1, 2, 1, 1], [2, 0, 1, 2], [1, 0, 0, 1]]  # tests/workers/vlm_parity.py's FSDP_PER_ROW
CASE_SECONDS = 120  # a case (one mode, fp32 and float64) takes seconds; past this both ranks are stuck
PARTNER_SECONDS = 20  # how long after one rank ends a case the other may still be in it
HANG_EXIT = 3  # the exit code of a rank that has recorded why it ends the world


def prepare(model_type: str) -> dict[str, tuple]:
    """precision -> (model, rows, reference): the fp32 model and the float64 copy, built as vlm_parity builds them."""
    config = sweep_config(model_type)
    torch.manual_seed(0)
    model = tiny_model(config)
    rows = padded(tiny_batches(config, PER_ROW), 4)  # SP halves a row, cp=2 cuts it in 4 chunks
    model64, rows64 = copy.deepcopy(model).double(), as_double(rows)
    for module in model64.modules():  # every config an experts module reads (a vision tower's MoE has its own)
        if hasattr(getattr(module, "config", None), "_experts_implementation"):
            module.config._experts_implementation = "eager"  # torch's grouped matmul takes no float64 (as the kit)
    with Float64Throughout():  # transformers' fp32 casts (norms, softmax, Gemma 4's pooler) float64 too, as the kit's
        wanted64 = reference(model64, rows64)
    return {"fp32": (model, rows, reference(model, rows)), "float64": (model64, rows64, wanted64)}


def run_case(store: dist.Store, key: str, prepared: dict[str, tuple], layout: dict) -> dict:
    """Each precision's comparison on ``layout``, on a default process group of this case's own."""
    dist.init_process_group("gloo", store=dist.PrefixStore(key, store), rank=int(os.environ["RANK"]), world_size=2,
                            timeout=datetime.timedelta(seconds=CASE_SECONDS))
    try:
        out = {}
        for precision, (model, rows, wanted) in prepared.items():
            with Float64Throughout() if precision == "float64" else contextlib.nullcontext():
                run = train(model, rows, layout)
                got = compare(run, wanted)
            out[precision] = {k: got[k] for k in ("losses", "ref_losses", "grad_error_by_step")} | {
                "unmatched": sorted(set(got["compared"]) ^ set(wanted["trained"]))}
        return out
    finally:
        dist.destroy_process_group()


def main() -> None:
    plan, out, rank = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2], int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=CASE_SECONDS))

    def write(model_type: str, mode: str, outcome: dict) -> None:
        with open(f"{out}.{rank}", "a") as f:
            f.write(json.dumps({"type": model_type, "mode": mode, "rank": rank, **outcome}) + "\n")

    def stuck(model_type: str, mode: str, why: str) -> None:  # recorded, then the world ends
        write(model_type, mode, {"hang": why})
        os._exit(HANG_EXIT)

    for model_type, modes in plan:
        prepared = None  # built in the type's first case; where that raised, each case raises it again
        for mode in modes:
            key = f"{model_type}/{mode}"
            (timer := threading.Timer(CASE_SECONDS, stuck, (model_type, mode, f"no end in {CASE_SECONDS} s"))).start()
            try:
                prepared = prepared or prepare(model_type)
                outcome = {"result": run_case(store, key, prepared, LAYOUTS[mode])}
            except (ConfigError, AdapterError) as error:  # plait's refusal: the cell, and on to the next case
                outcome = {"refused": " ".join(str(error).split())[:300]}
            except Exception as error:  # anything else likewise, a FAIL
                outcome = {"error": " ".join(f"{type(error).__name__}: {error}".split())[:300]}
            timer.cancel()
            write(model_type, mode, outcome)
            store.set(f"{key}/ended/{rank}", "1")
            try:
                store.wait([f"{key}/ended/{1 - rank}"], datetime.timedelta(seconds=PARTNER_SECONDS))
            except RuntimeError:  # DistStoreError: the partner is still in the case, stuck where this rank left it
                stuck(model_type, mode, f"rank {1 - rank} stuck in the case {PARTNER_SECONDS} s after rank {rank} left")


if __name__ == "__main__":
    main()
