"""Worker of the conformance kit: (adapter, mode) pairs of one world size, in one torchrun world.

``python -m plait.testing.conformance_worker SPEC.json``, launched by ``run_conformance`` through
``plait.testing.launch``. SPEC: ``{"out": dir, "dtype": "float32" | "float64", "runs": [[adapter ref, mode
name], ...]}``. Each rank appends to ``rank<N>.jsonl`` a ``start`` line before each pair and a ``done`` line
with its record (worst errors, failures, the parameters it compared) after it, so what finished survives a
world that does not.

A pair that raises is recorded, and the ranks agree through the rendezvous store before the next pair. When
every rank finished the pair and none raised, or all raised the same error (plait's own errors are raised
before any collective, at the same point on every rank), the world goes on. When they raised different errors
(one the real one, another "connection closed by peer" from a collective its partner left), every rank ends
the world after writing its record. When one rank raised and another is still inside the pair (waiting in a
collective the failed rank will never join), the failed rank waits ``RAISED_WAIT`` seconds, asks the ranks still
inside for their Python stacks (``faulthandler`` on SIGUSR1, into ``rank<N>.stack``) and ends the world.
``run_conformance`` reports such a pair with every rank's part and runs the remaining pairs in a fresh world.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from plait.base import comm
from plait.base.config import ParallelConfig
from plait.checkpoint import consolidate, save_checkpoint
from plait.optim import OptimizerStep, build_optimizer
from plait.parallel.fsdp import local
from plait.parallel_model import ParallelModel
from plait.parallelize import parallelize
from plait.testing.conformance_modes import (
    ADAM_EPS, ATOL, BATCH, LOSS_RTOL, LR, MODES, RTOL, SEQ, STEPS, Mode, Subject, load_subject, with_overrides,
)

MAX_FAILURES = 20


class Record:
    """The worst errors of one pair on this rank, and the first failures in the order they happened."""

    def __init__(self, expected: list[str]) -> None:
        self.no_grad: set[str] = set()  # parameters one process computes no gradient for
        self.values: dict[str, Any] = {"loss_rel": None, "norm_rel": None, "grad_err": None, "grad_tol": None,
                                       "failures": [],
                                       "checked": set(), "expected": expected, "crashed": False}

    def fail(self, message: str) -> None:
        if len(self.values["failures"]) < MAX_FAILURES:
            self.values["failures"].append(message)

    def worst(self, key: str, value: float) -> None:
        self.values[key] = max(self.values[key] or 0.0, value)

    def json(self) -> dict[str, Any]:
        return {**self.values, "checked": sorted(self.values["checked"])}


def reference_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32, as plait's loss
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def perturb(model: torch.nn.Module) -> None:
    """Add noise to every parameter, so that no zero-initialised bias or all-ones norm hides a mis-sharded
    one (identical on every rank: the generator is seeded)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.02)


def forward_backward(pmodel: ParallelModel, ids: torch.Tensor, num_items: int) -> torch.Tensor:
    """One step's forward and backward: through ``train_step`` (pipeline schedules) where plait has it."""
    train_step = getattr(pmodel, "train_step", None)
    if train_step is not None:
        return train_step(ids, labels=ids, num_items_in_batch=num_items).detach()
    loss = pmodel(ids, labels=ids, num_items_in_batch=num_items)
    loss.backward()
    return loss.detach()


def reference_grads(reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The one-process gradients ``compare_grads`` compares with: zeros for a parameter the forward did not use
    (ZeRO-1's flat gradient buffers give it zeros, torch gives None); a tied parameter under each of its names (a
    pipeline stage holds the head's tied copy as ``lm_head.weight``)."""
    return {name: p.grad if p.grad is not None else torch.zeros_like(p)
            for name, p in reference.named_parameters(remove_duplicate=False)}


def compare_grads(record: Record, step: int, pmodel: ParallelModel, reference: dict[str, torch.Tensor],
                  grads: dict[str, torch.Tensor]) -> None:
    """Compare this rank's gradient shards with the same slices of the reference's full gradients
    (``reference_grads``).

    No communication: ``ShardSpec.slice_full`` cuts a full tensor the way this rank holds it (vocab padding
    modes included, which must stay zero), so a pipeline stage or a ZeRO owner checks exactly what it has.
    """
    for name, grad in grads.items():
        expected = pmodel.param_specs[name].slice_full(reference[name])
        if expected.numel() == 0:  # ZeRO-3: a parameter too small to give this rank a piece; another checks it
            continue
        diff = (grad - expected).abs()
        err, tol = diff.max().item(), (diff / (ATOL + RTOL * expected.abs())).max().item()
        record.worst("grad_err", err)
        record.worst("grad_tol", tol)
        if tol > 1:
            record.fail(f"step {step} grad {name}: max |Δ| {err:.2e} ({tol:.1e}x tolerance)")
        record.values["checked"].add(name)


def local_grads(record: Record, step: int, named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in named:
        if param.grad is None and name not in record.no_grad:
            record.fail(f"step {step}: {name} has no gradient")
        elif param.grad is None:
            record.values["checked"].add(name)  # one process gives it none either (used only under no_grad)
        else:
            grads[name] = local(param.grad).detach().clone()  # under ZeRO-2/3 this rank's rows
    return grads


class PlainStep:
    """AdamW on every local parameter after ``finish_grad_sync``: the ParallelModel contract; the global gradient
    norm as plait's OptimizerStep counts it (each slice once over the layout), not applied."""

    def __init__(self, pmodel: ParallelModel) -> None:
        self.pmodel, self.optimizer = pmodel, torch.optim.AdamW(pmodel.parameters(), lr=LR, eps=ADAM_EPS)
        self.norm = OptimizerStep(pmodel.grad_sync, self.optimizer).grad_norm

    def __call__(self, record: Record, step: int) -> tuple[dict[str, torch.Tensor], float]:
        self.pmodel.grad_sync.finish()
        grads = local_grads(record, step, list(self.pmodel.module.named_parameters()))
        norm = self.norm().item()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return grads, norm


class ZeroStep:
    """plait's ZeRO optimizer step. Under ZeRO-1 it reduces each gradient only to the rank that owns the parameter
    and zeroes them after stepping, so the owners' gradients are read just before the inner step; under ZeRO-2/3
    each rank reads the rows FSDP2 reduced into it."""

    def __init__(self, pmodel: ParallelModel) -> None:
        self.optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=LR, eps=ADAM_EPS)
        self.run = OptimizerStep(pmodel.grad_sync, self.optimizer)
        owned = {id(p) for p in getattr(self.optimizer, "owned_params", pmodel.parameters())}
        self.named = [(n, p) for n, p in pmodel.module.named_parameters() if id(p) in owned]
        # frozen parameters (a router's expert_bias, moved by its own rule, not by gradients) are in no optimizer
        # shard: no rank owns them, and one process gives them no gradient either
        self.frozen = [n for n, p in pmodel.module.named_parameters() if not p.requires_grad]

    def __call__(self, record: Record, step: int) -> tuple[dict[str, torch.Tensor], float]:
        seen: dict[str, torch.Tensor] = {}
        record.values["checked"].update(self.frozen)
        inner = self.optimizer.step

        def step_reading_grads(*args: Any, **kwargs: Any) -> Any:
            seen.update(local_grads(record, step, self.named))
            return inner(*args, **kwargs)

        self.optimizer.step = step_reading_grads
        try:
            norm = self.run().item()
        finally:
            del self.optimizer.step  # the class's own method again
        return seen, norm


class Float64Throughout:
    """A float64 run in float64 throughout: every float32 asked for (``x.to(torch.float32)``, ``x.float()``,
    ``torch.zeros(..., dtype=torch.float32)``, ``softmax(..., dtype=torch.float32)``, ``torch.tensor(2.5,
    dtype=torch.float32)``) is float64 instead, on the reference and on plait's side alike, and so is the default
    dtype (``torch.tensor(2.5)``: Gemma's embedding scale is such a buffer, which plait's vocab-parallel embedding
    builds with an explicit float32: both must be float64). transformers computes RMSNorm, softmax and Mamba2's scan
    in fp32 even in a float64 model (``hidden_states.to(torch.float32)``, ``.float()``), so without this their fp32
    rounding stays in a float64 run, and any reordering of the work (a split sum of squares, microbatches) shows it
    at 1e-7: measured on one process without plait, a float64 tiny mamba2's gradients over 4 microbatches differ
    from one batch's by 5e-8 of the largest entry, 6e-16 under this mode. What the float64 recheck exists for,
    reordering noise at 1e-16 against a mis-split module's 1e-4, then holds for every module.

    Two modes: one over torch's Python functions (a dtype asked for before a tensor exists: ``torch.tensor``) and one
    over aten operators, which stays on in backward, where activation checkpointing recomputes its forward (a
    torch-function mode is off inside ``Tensor.backward``, which it dispatches itself). Bit reinterpretation
    (``view(dtype)``) is left alone."""

    def __enter__(self) -> Float64Throughout:
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        self._modes = [_Float64Operators(), _Float64Functions()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        torch.set_default_dtype(self._default)


def _float64(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return (tuple(torch.float64 if a is torch.float32 else a for a in args),
            {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()})


class _Float64Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.view:
            return func(*args, **(kwargs or {}))
        args, kwargs = _float64(args, kwargs or {})
        return (torch.Tensor.double if func is torch.Tensor.float else func)(*args, **kwargs)


class _Float64Operators(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.view.dtype:
            return func(*args, **(kwargs or {}))
        args, kwargs = _float64(args, kwargs or {})
        return func(*args, **kwargs)


def run_pair(subject: Subject, mode: Mode, out: Path, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    with Float64Throughout() if dtype == torch.float64 else contextlib.nullcontext():
        return _run_pair(subject, mode, out, dtype)


def _run_pair(subject: Subject, mode: Mode, out: Path, dtype: torch.dtype) -> dict[str, Any]:
    config = with_overrides(subject.config, mode.model)
    if dtype == torch.float64 and hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # torch's grouped matmul (the default) takes no float64
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # built in the run's dtype: what its init creates in the default dtype (Gemma's embed_scale buffer) is float64
    # in a float64 run, as Float64Throughout makes plait's own float32 requests (transformers sets the default dtype
    # to the one it builds a model in)
    reference = AutoModelForCausalLM.from_config(config, dtype=dtype).to(dtype)
    perturb(reference)
    record = Record([name for name, _ in reference.named_parameters()])
    try:
        pmodel = parallelize(copy.deepcopy(reference), ParallelConfig(**mode.layout), registry=subject.registry)
        train(record, pmodel, reference_run(subject, mode, reference, pmodel.mesh.dp), mode)
        if mode.after == "consolidate":
            check_consolidated(record, pmodel, out / f"{subject.name.replace(':', '-')}-{mode.name}")
    except Exception as err:  # recorded: the table shows it, and the next pair still runs
        frame = traceback.extract_tb(err.__traceback__)[-1]
        record.fail(f"raised {type(err).__name__}: {err} (at {Path(frame.filename).name}:{frame.lineno})")
        record.values["crashed"] = True
    return record.json()


@dataclass
class ReferenceStep:
    """One step of the one-process run: its batch, loss, global gradient norm (before clipping), the gradients the
    layout's are compared with (after clipping, where the mode clips) and the parameters it gave none."""

    ids: torch.Tensor
    loss: float
    norm: float
    grads: dict[str, torch.Tensor]
    no_grad: set[str]


# The one-process runs of the current subject, by what decides them (model overrides, dtype, global batch, steps,
# clipping): the modes of a subject share a few (tp2-sp, tp2, pp2-*, cp2-tp2 ... run the same one), so each is
# computed once per world instead of once per mode. Only one subject's runs are kept (the worker runs its pairs
# subject by subject).
_REFERENCE_RUNS: dict[tuple, list[ReferenceStep]] = {}


def reference_run(subject: Subject, mode: Mode, reference: torch.nn.Module, dp: int) -> list[ReferenceStep]:
    """The one-process run ``mode`` is compared with: AdamW steps of ``reference`` (trained in place when first
    computed) on the global batch of ``dp`` data-parallel ranks, clipped as the mode clips. Rank 0 computes it and
    sends it to the others, which wait without computing (in a world of 2 on 2 cores, the other core serves the
    other test worker): every rank of a world held the same run, computed again on each (a tenth of the generic
    kit's time). An error computing it is raised on every rank from here: the same message at the same line."""
    dtype = next(reference.parameters()).dtype
    key = (subject.ref, json.dumps(mode.model, sort_keys=True, default=str), str(dtype), dp, mode.steps, mode.clip)
    if key in _REFERENCE_RUNS:
        return _REFERENCE_RUNS[key]
    if any(k[0] != subject.ref for k in _REFERENCE_RUNS):
        _REFERENCE_RUNS.clear()
    _REFERENCE_RUNS[key] = sent_from_rank_0(mode, reference, dp)
    return _REFERENCE_RUNS[key]


def sent_from_rank_0(mode: Mode, reference: torch.nn.Module, dp: int) -> list[ReferenceStep]:
    """``one_process_steps`` computed on rank 0 and sent to every rank: each step's numbers as one small object,
    its batch and gradients as tensors, one flat tensor per dtype (pickled, each gradient took as long to send as to
    compute; a float64 model may keep some parameters in fp32)."""
    steps: list[ReferenceStep] = []
    summary: list[Any] = [None, None]  # each step's loss, norm and no_grad set; or what computing them raised
    if dist.get_rank() == 0:
        try:
            steps = one_process_steps(mode, reference, dp)
            summary[0] = [(step.loss, step.norm, step.no_grad) for step in steps]
        except Exception as err:  # noqa: BLE001 (raised on every rank below; a transformers error may not pickle)
            summary[1] = f"{type(err).__name__}: {err}"
    dist.broadcast_object_list(summary, src=0)
    if summary[1] is not None:
        raise RuntimeError(f"the one-process run raised {summary[1]}")
    by_dtype: dict[torch.dtype, list[tuple[str, torch.nn.Parameter]]] = {}  # reference_grads' names, in its order
    for name, param in reference.named_parameters(remove_duplicate=False):
        by_dtype.setdefault(param.dtype, []).append((name, param))
    if dist.get_rank() == 0:
        for step in steps:
            dist.broadcast(step.ids, src=0)
            for named in by_dtype.values():
                dist.broadcast(torch.cat([step.grads[name].reshape(-1) for name, _ in named]), src=0)
        return steps
    for loss, norm, no_grad in summary[0]:
        ids = torch.empty(BATCH * dp, SEQ, dtype=torch.long)
        dist.broadcast(ids, src=0)
        grads = {}
        for named in by_dtype.values():
            # a buffer of the parameters' dtype made without naming it: Float64Throughout turns an fp32 asked for
            # into float64, while the fp32 parameters a float64 model keeps (its strict fp32 modules) send fp32
            flat = torch.cat([p.detach().reshape(-1) for _, p in named])
            dist.broadcast(flat, src=0)
            pieces = flat.split([p.numel() for _, p in named])
            grads.update({name: piece.view(p.shape) for (name, p), piece in zip(named, pieces)})
        steps.append(ReferenceStep(ids, loss, norm, grads, no_grad))
    return steps


def one_process_steps(mode: Mode, reference: torch.nn.Module, dp: int) -> list[ReferenceStep]:
    """``reference_run``'s steps, computed here."""
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=ADAM_EPS)
    gen = torch.Generator().manual_seed(1)
    vocab = reference.config.get_text_config().vocab_size  # a composite config (Gemma4) holds it in its text config
    steps = []
    for _ in range(mode.steps):
        # The global batch is the same for every layout; each dp rank takes its contiguous rows.
        ids = torch.randint(0, vocab, (BATCH * dp, SEQ), generator=gen)
        loss = reference_loss(reference, ids)
        loss.backward()
        no_grad = {name for name, p in reference.named_parameters() if p.grad is None}
        norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None]).item()
        if mode.clip is not None:  # clipped as plait clips: by the global norm, before the step
            torch.nn.utils.clip_grad_norm_(reference.parameters(), mode.clip * norm)
        grads = {name: g.detach().clone() for name, g in reference_grads(reference).items()}
        steps.append(ReferenceStep(ids, loss.item(), norm, grads, no_grad))
        ref_opt.step()
        ref_opt.zero_grad()
    return steps


def train(record: Record, pmodel: ParallelModel, reference: list[ReferenceStep], mode: Mode) -> None:
    mesh = pmodel.mesh
    sharded = pmodel.config.zero_1 or pmodel.fsdp is not None
    optimizer_step = ZeroStep(pmodel) if sharded else PlainStep(pmodel)
    for step, ref in enumerate(reference, start=1):
        record.no_grad = ref.no_grad
        loss = forward_backward(pmodel, ref.ids.chunk(mesh.dp)[mesh.dp_rank], ref.ids.shape[0] * (SEQ - 1))
        global_loss = comm.all_reduce(loss.clone(), mesh.replica_group).item()  # dp ranks' rows, cp ranks' tokens
        rel = abs(global_loss - ref.loss) / abs(ref.loss)
        record.worst("loss_rel", rel)
        if rel > LOSS_RTOL:
            record.fail(f"step {step} loss {global_loss:.6f} vs {ref.loss:.6f}: rel err {rel:.2e} > {LOSS_RTOL:g}")
        if mode.clip is not None:  # the reference clipped at this fraction of its norm: below it, so it bites
            optimizer_step.run.max_grad_norm = mode.clip * ref.norm
        grads, plait_norm = optimizer_step(record, step)
        compare_grads(record, step, pmodel, ref.grads, grads)
        rel = abs(plait_norm - ref.norm) / ref.norm  # every slice counted once: one process's norm, before clipping
        record.worst("norm_rel", rel)
        if rel > LOSS_RTOL:
            record.fail(f"step {step} gradient norm {plait_norm:.6g} vs {ref.norm:.6g}: rel err {rel:.2e} > "
                        f"{LOSS_RTOL:g}")


def check_consolidated(record: Record, pmodel: ParallelModel, path: Path) -> None:
    """Save the trained model as a plait checkpoint, consolidate it (rank 0) to a Hugging Face directory,
    load that with ``from_pretrained`` on every rank and compare it with this rank's trained shards: a
    round trip copies bytes, so they must be equal."""
    from transformers import AutoModelForCausalLM

    save_checkpoint(path / "checkpoint", pmodel, step=STEPS)
    if dist.get_rank() == 0:
        consolidate(path / "checkpoint", path / "hf")
    dist.barrier()
    dtype = next(pmodel.module.parameters()).dtype
    loaded, info = AutoModelForCausalLM.from_pretrained(path / "hf", dtype=dtype, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        record.fail(f"consolidated model: missing keys {sorted(info['missing_keys'])}, "
                    f"unexpected keys {sorted(info['unexpected_keys'])}")
    for name, param in pmodel.module.named_parameters():
        expected = pmodel.param_specs[name].slice_full(loaded.get_parameter(name).detach())
        # at the loaded dtype: transformers keeps some modules in fp32 whatever dtype is asked for (a float64 run's
        # conv1d and A_log under _keep_in_fp32_modules_strict), rounding what the file holds
        mine = local(param).detach().to(expected.dtype)
        if not torch.equal(mine, expected):
            err = (mine - expected).abs().max().item()
            record.fail(f"consolidated {name} differs from the trained shard by up to {err:.2e}")


RAISED_WAIT = 5  # seconds a rank that raised waits for the others to finish the pair (a pair takes ~1 s; a rank
# that would have raised the same error later is reported as still inside the pair: the verdict is the same)
PASSED_WAIT = 120  # seconds a rank that passed waits (the others may be slower, not stuck: gloo times out at 60)
DESYNC_EXIT = 3  # the exit status of a rank that ends the world because the ranks left a pair apart


def agree(store: dist.Store, key: str, record: dict[str, Any]) -> tuple[list[int], bool]:
    """Check in as done with pair ``key``. Returns the ranks that did not check in within the wait (empty: all
    did) and whether the world is fit for the next pair: no rank raised, or every rank raised the same error
    at the same point. Ranks that raised differently (one the real error, another "connection closed by peer"
    from a collective its partner left) may leave messages in flight, so the next pair gets a fresh world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    raised = record["failures"][-1] if record["crashed"] else ""
    store.set(f"done/{key}/{rank}", raised)
    keys = [f"done/{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=RAISED_WAIT if raised else PASSED_WAIT))
    except RuntimeError:  # torch's DistStoreError: the wait timed out
        return [r for r, k in enumerate(keys) if not store.check([k])], False
    try:
        return [], len({store.get(k) for k in keys}) == 1
    except RuntimeError:  # the store's host rank ended the world already: so does this one
        return [], False


def end_world(store: dist.Store, stuck: list[int]) -> None:
    """Ask the ranks still inside the pair to write their stacks, then end this rank (the launcher ends theirs)."""
    for rank in stuck:
        if hasattr(signal, "SIGUSR1"):
            try:
                os.kill(int(store.get(f"pid/{rank}")), signal.SIGUSR1)
            except (OSError, RuntimeError, ValueError):
                pass  # gone already: the launcher reports how it exited
    time.sleep(1.0)  # time to write them
    os._exit(DESYNC_EXIT)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out, dtype = Path(spec["out"]), getattr(torch, spec.get("dtype", "float32"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    store.set(f"pid/{rank}", str(os.getpid()))
    stack_file = open(out / f"rank{rank}.stack", "w")  # noqa: SIM115 (open while the process lives)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    subjects: dict[str, Subject] = {}
    with open(out / f"rank{rank}.jsonl", "a") as log:
        for ref, mode_name in spec["runs"]:
            key = f"{ref}|{mode_name}"
            log.write(json.dumps({"key": key, "event": "start"}) + "\n")
            log.flush()
            try:
                if ref not in subjects:
                    subjects[ref] = load_subject(ref)
                record = run_pair(subjects[ref], MODES[mode_name], out, dtype)
            except Exception as err:  # the adapter itself failed to load on this rank
                record = {**Record([]).json(), "failures": [f"raised {type(err).__name__}: {err}"], "crashed": True}
            log.write(json.dumps({"key": key, "event": "done", "record": record}) + "\n")
            log.flush()
            stuck, fit = agree(store, key, record)
            if stuck:
                end_world(store, stuck)
            if not fit:
                os._exit(DESYNC_EXIT)  # every rank: the records are written, the next pair gets a fresh world
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
