"""Worker of scripts/vision_sweep.py: image-text-to-text types trained on parallel layouts against one process.

Run as a world of 2: ``python -m plait_transformers.vision_sweep_worker PLAN.json OUT`` where PLAN lists
``[model_type, [mode, ...]]``. Each type gets tiny_vision's model and rows (every replica and micro-batch holding an
image, as ZeRO-3 needs: tests/workers/vlm_parity.py's FSDP_PER_ROW), one process's reference in fp32 and in float64,
and each mode trains a copy in both, as that worker does. Each rank appends one JSON line per case to ``OUT.RANK``
as it finishes it, so a world that dies keeps what it did and the sweep reruns the rest in a new world.

Many types share a world, so a case must not poison the next: each case runs on a default process group of its own
(a fresh gloo group over a key prefix of one TCP store), so collectives left unmatched by an exception on one rank
cannot pair with the next case's; and a rank stuck in one (its partner gone on after an error: plait's groups wait
30 minutes) is ended by a watchdog that records the hang first.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from plait import AdapterError, ConfigError
from plait_transformers.tiny_vision import TUPLE_FORWARD, tiny_image_text_config
from plait_transformers.vision_parity import as_double, compare, reference, tiny_batches, train

# mode -> ParallelConfig kwargs (a world of 2)
LAYOUTS = {"tp2-sp": dict(tp=2), "zero3-dp2": dict(zero_stage=3), "pp2": dict(pp=2, num_microbatches=2)}
PER_ROW = [[1, 2, 1, 1], [2, 0, 1, 2], [1, 0, 0, 1]]  # tests/workers/vlm_parity.py's FSDP_PER_ROW
CASE_SECONDS = 150  # one mode of a tiny type (fp32 and float64 runs) takes seconds; past this it is a hang
HANG_EXIT = 3


def one_line(error: BaseException) -> dict:
    """The error for the table: plait's refusals (ConfigError, AdapterError) as "refused", anything else as a
    failure, with its type."""
    if isinstance(error, (ConfigError, AdapterError)):
        return {"refused": " ".join(str(error).split())[:300]}
    return {"error": " ".join(f"{type(error).__name__}: {error}".split())[:300]}


def sweep_config(model_type: str) -> PretrainedConfig:
    """tiny_vision's config as a checkpoint of the whole model has it: ``architectures`` naming the image-text
    class, without which plait builds and plans the text decoder of a type AutoModelForCausalLM also maps
    (Llama 4, Qwen 3.5: ``plait.base.meta.takes_images``) and the plan does not fit the model trained."""
    config = tiny_image_text_config(model_type)
    config.architectures = [MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]]
    return config


def logits_forward(model: torch.nn.Module) -> None:
    """Llama4ForConditionalGeneration's forward raises after its logits (its text model's output has no
    ``image_outputs``) unless config.return_dict is False and return_dict=True is passed (tiny_vision.TUPLE_FORWARD):
    its class is swapped for one whose forward does that and hands back the logits, which is all that plait and the
    reference read. Swapping the class, not wrapping the instance's method, keeps deep copies calling themselves."""
    model.config.return_dict = False
    base = type(model)

    def forward(self, *args, **kwargs) -> CausalLMOutputWithPast:
        return CausalLMOutputWithPast(logits=base.forward(self, *args, **{**kwargs, "return_dict": True})[0])

    model.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})


def tied(model: torch.nn.Module) -> dict[str, str]:
    """Each second name of a tied parameter -> the name the reference trains it under (named_parameters gives the
    first only): a pipeline stage holding the tied copy alone (the last stage's lm_head.weight, tied to the first
    stage's embeddings) steps it under the other name, and its gradient must be the one of the pair."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name}


def expected(model: torch.nn.Module, rows: list) -> dict:
    """One process's reference, its gradients listed under every name of a tied parameter."""
    wanted, aliases = reference(model, rows), tied(model)
    wanted["grads"] = [{**g, **{a: g[c] for a, c in aliases.items() if c in g}} for g in wanted["grads"]]
    wanted["aliases"] = aliases
    return wanted


def prepare(model_type: str) -> dict[str, tuple]:
    """precision -> (model, rows, reference): the fp32 model and the float64 copy, built as vlm_parity builds them."""
    config = sweep_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    if model_type in TUPLE_FORWARD:
        logits_forward(model)
    rows = tiny_batches(config, PER_ROW)
    model64, rows64 = copy.deepcopy(model).double(), as_double(rows)
    model64.config._experts_implementation = "eager"  # torch's grouped matmul takes no float64 (as the kit's recheck)
    return {"fp32": (model, rows, expected(model, rows)), "float64": (model64, rows64, expected(model64, rows64))}


def run_case(store: dist.Store, key: str, prepared: dict[str, tuple], layout: dict) -> dict:
    """Each precision's comparison on ``layout``, on a default process group of this case's own."""
    dist.init_process_group("gloo", store=dist.PrefixStore(key, store), rank=int(os.environ["RANK"]), world_size=2,
                            timeout=datetime.timedelta(seconds=CASE_SECONDS))
    try:
        out = {}
        for precision, (model, rows, expected) in prepared.items():
            run = train(model, rows, layout)
            # ZeRO-3 leaves a rank an empty shard of a parameter with fewer rows than ranks: nothing to compare
            # there (compare's max() of it raises), its rows are compared on the rank holding them
            run["grads"] = [{n: g for n, g in step.items() if g.numel()} for step in run["grads"]]
            got = compare(run, expected)
            out[precision] = {"losses": got["losses"], "ref_losses": got["ref_losses"],
                              "grad_error_by_step": got["grad_error_by_step"],
                              "unmatched": sorted({expected["aliases"].get(n, n) for n in got["compared"]}
                                                  ^ set(expected["trained"]))}
        return out
    finally:
        dist.destroy_process_group()


class Log:
    """This rank's JSON lines, one a case, written through at once."""

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank

    def write(self, model_type: str, mode: str, outcome: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"type": model_type, "mode": mode, "rank": self.rank, **outcome}) + "\n")


def watchdog(log: Log, model_type: str, mode: str) -> threading.Timer:
    """A timer that records ``mode`` of ``model_type`` as a hang on this rank and ends the process."""
    def fire() -> None:
        log.write(model_type, mode, {"hang": f"no result within {CASE_SECONDS} s on rank {os.environ['RANK']} "
                                              "(a hang; the world was ended)"})
        os._exit(HANG_EXIT)

    timer = threading.Timer(CASE_SECONDS, fire)
    timer.daemon = True
    timer.start()
    return timer


def main() -> None:
    plan, out = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
    rank = int(os.environ["RANK"])
    log = Log(f"{out}.{rank}", rank)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=CASE_SECONDS))
    for model_type, modes in plan:
        timer = watchdog(log, model_type, modes[0])
        try:
            prepared = prepare(model_type)
        except Exception as error:  # the type's own model or reference: every mode of it, on this rank
            for mode in modes:
                log.write(model_type, mode, one_line(error))
            continue
        finally:
            timer.cancel()
        for mode in modes:
            timer = watchdog(log, model_type, mode)
            try:
                outcome = {"result": run_case(store, f"{model_type}/{mode}", prepared, LAYOUTS[mode])}
            except Exception as error:  # recorded as the cell, and the world goes on with the next case
                outcome = one_line(error)
            timer.cancel()
            log.write(model_type, mode, outcome)


if __name__ == "__main__":
    main()
