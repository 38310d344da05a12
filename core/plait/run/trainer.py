"""``plait train``: one training loop for every layout.

The global batch of a step is a function of (seed, step) only (GlobalBatchSampler); each data-parallel
rank takes its contiguous share of each micro-step, and losses are normalised by the global token count,
so any layout with the same global batch trains on the same tokens and, in fp32, follows the same curve.
"""

from __future__ import annotations

import dataclasses
from contextlib import closing, contextmanager, nullcontext
import datetime
import os
import time
import warnings
from pathlib import Path
from collections.abc import Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn
from transformers import PretrainedConfig, get_scheduler

from plait.base import comm
from plait.base import faults
from plait.base.config import ConfigError
from plait.base.device import peak_memory_bytes, pick_device, use_fused_adamw
from plait.base.host_memory import keep_freed_memory
from plait.base.meta import build_meta_model
from plait.base.seeds import init_seed
from plait.checkpoint import checkpoint_path, latest_checkpoint, load_checkpoint, rotate_checkpoints, should_save
from plait.checkpoint.async_save import BackgroundSaver
from plait.checkpoint.format import read_index, remove_partial_checkpoints
from plait.checkpoint.store import is_url
from plait.checkpoint.materialize import init_fallback_note, materialize, materialize_source
from plait.checkpoint.save import prepare_save, write_save
from plait.checkpoint.shared_dir import check_shared_dir
from plait.checkpoint.state import local_params
from plait.cp.sequence import read_spans
from plait.data import GlobalBatchSampler
from plait.layout_plan import LayoutPlan, check_planned_image_stages, plan_layout
from plait.lora.base import base_source, check_base, saved_lora
from plait.optim import NonFiniteStep, OptimizerStep, UncommittedStep, build_optimizer
from plait.parallel.float8 import check_float8_device
from plait.parallel.fsdp import local
from plait.parallelize import parallelize
from plait.plugin.registry import default_registry
from plait.run.heartbeat import Heartbeat
from plait.run.replicas import join_replica_groups
from plait.run.stragglers import StragglerWatch, straggler_line
from plait.run.log_line import log_line, progress_text
from plait.run.methods.base import TrainingMethod
from plait.run.methods.table import method_for
from plait.run.methods.vision_sft import freeze_vision
from plait.run.metrics import MetricsLog, own_peak_rss_mb, peak_rss_mb, plot_loss_curve, world_rows
from plait.run.model_config import check_model_fits, read_model_config
from plait.run.moe_metrics import RoutingMetrics
from plait.run.prompts import EvalPrompts
from plait.run.run_files import RunFiles
from plait.run.resume_checks import check_resumed_data, check_resumed_flags, check_resumed_lora, resumed_flags
from plait.run.runtime import TrainingDiverged, explain_timeouts, init_distributed, is_main_process
from plait.run.stop import StopRequested, StopSignals
from plait.run.trackers import Trackers, parse_report_to
from plait.run.train_args import TrainArgs
from plait.run.train_data import load_data

def check_resume_matches(args: TrainArgs, meta: nn.Module, resume: Path | None) -> None:
    """A checkpoint of another model than --model_config / --model_name_or_path names is refused, rather than
    silently training the checkpoint's model. Compares every parameter's name and shape: the meta model's
    against the checkpoint's index (no second model is built)."""
    if resume is None or not (args.model_config or args.model_name_or_path):
        return
    _, index = read_index(resume)
    lora = saved_lora(index.extra)
    if lora is not None:  # adapters only: the base is the one the checkpoint names (its identity is checked)
        named = lora[1].get("path")
        if args.model_name_or_path and named != str(Path(args.model_name_or_path).resolve()):
            raise ConfigError(f"--resume_from_checkpoint {resume} holds LoRA adapters of the base {named}, not of "
                              f"--model_name_or_path {args.model_name_or_path}; leave the flag out or name that base")
        return
    saved = {name: tuple(entry.shape) for name, entry in index.params().items()}
    wanted = local_params(meta).shapes()  # parameters and persistent buffers, as a checkpoint saves them
    if saved != wanted:
        flag = "--model_name_or_path" if args.model_name_or_path else "--model_config"
        first = sorted(set(saved.items()) ^ set(wanted.items()))[0][0]
        saved_type = index.model_config.get("model_type")
        raise ConfigError(
            f"--resume_from_checkpoint {resume} holds a {saved_type} model "
            f"({', '.join(index.model_config.get('architectures') or [])}) that differs from {flag}'s "
            f"{meta.config.model_type} model (first difference: {first}); resume with the model it was saved "
            f"from, or leave out {flag} to use the checkpoint's own config"
        )


def diverged_message(step: int, bad: NonFiniteStep, args: TrainArgs, skipped: int, last: Path | str | None) -> str:
    """One line: the step, the values, what was (not) done (``skipped`` such steps so far, the newest checkpoint
    ``last``), and the likely fixes with the flags' values."""
    fixes = [f"lower --learning_rate (now {args.learning_rate:g})",
             f"clip harder with --max_grad_norm (now {args.max_grad_norm:g})" if args.max_grad_norm
             else "clip with --max_grad_norm 1.0"]
    if args.bf16 and args.optimizer_dtype != "float32":
        fixes.append("keep fp32 master weights (--optimizer_dtype float32)")
    elif args.bf16 or args.bf16_autocast:
        fixes.append("train in fp32 (drop --bf16 / --bf16_autocast)")
    saved = f"the newest checkpoint is {last}, from before it" if last else "the run has no checkpoint"
    if args.skip_nonfinite_steps:
        skip = (f"or allow more skipped steps than --skip_nonfinite_steps {args.skip_nonfinite_steps} (this was "
                f"non-finite step {skipped})")
    else:
        skip = "or skip such steps with --skip_nonfinite_steps"
    return (f"step {step}: {bad}; the step was not applied and no checkpoint was saved ({saved}); likely fixes: "
            f"{', '.join(fixes)}, {skip}")


def resume_path(args: TrainArgs) -> Path | str | None:
    """The checkpoint to resume from: the given one, or with 'auto' (and in workers torchrun restarted, unless one is
    given) the newest complete one (None: fresh); a URL where it is in a store."""
    resume = args.resume_from_checkpoint
    if resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"  # torchrun restarted the workers (--max_restarts): each goes on from the newest checkpoint
    if resume == "auto":
        return latest_checkpoint(args.output_dir)
    return resume if is_url(resume) else Path(resume) if resume else None


def plan_run(args: TrainArgs, world: int) -> tuple[Path | None, PretrainedConfig, nn.Module, tuple | None, LayoutPlan]:
    """Every check of a run that needs the model but no data and no process group: the flags, the checkpoint to
    resume (it must hold this model), the model's limits and the layout planned on the meta model for ``world``
    processes. The trainer runs it first; ``plait train --nproc_per_node N`` runs it in the launching process,
    so bad input ends in one line before any worker starts. Returns the checkpoint to resume (or None), the
    model config, the meta model, the LoRA settings a LoRA checkpoint saved (or None) and the plan."""
    args.validate()
    args.check_flags_take_effect()
    resume = resume_path(args)
    model_config = read_model_config(args, resume)
    # ZeRO-2/3 keeps fp32 shards (the master weights) and gathers them in bf16 (ParallelConfig.mixed_precision)
    meta = build_meta_model(model_config, torch.bfloat16 if args.bf16 and args.zero_stage < 2 else torch.float32)
    freeze_vision(meta, args.freeze_vision_tower, args.freeze_projector)
    check_resume_matches(args, meta, resume)
    check_model_fits(args, model_config)
    extra = read_index(resume)[1].extra if resume is not None else {}  # what the checkpoint recorded beside its tensors
    saved = saved_lora(extra) if resume is not None else None
    if saved is not None:
        check_base(saved[1], str(resume))
    if resume is not None:
        check_resumed_lora(args, saved and saved[0], resume)
    lora = args.lora() or (saved[0] if saved is not None else None)  # a LoRA checkpoint names its own config
    plan = plan_layout(meta, args.parallel_config(), world, lora=lora)
    args.check_zero_has_ranks(plan.config)
    check_planned_image_stages(meta, plan)
    if resume is not None:
        check_resumed_flags(args, extra.get("flags"), args.global_batch(plan.config.dp), resume)
    return resume, model_config, meta, saved, plan


def check_before_launch(args: TrainArgs, world: int) -> None:
    """What ``plait train --nproc_per_node N`` does in the launching process before any worker starts: plan the
    run (``plan_run``) and prepare its data, so bad input (a layout, a model, an empty or unreadable data file)
    is one line there instead of one per worker and torchrun's dump. The data is tokenized into the cache here,
    once; the workers read it back."""
    resume, model_config, _, _, plan = plan_run(args, world)
    _, _, tokenizer = run_data(args, model_config, plan, method_for(args), resume)
    EvalPrompts.of_run(args, tokenizer, model_config, plan.config)


def run_data(args: TrainArgs, model_config: PretrainedConfig, plan: LayoutPlan, method: type[TrainingMethod],
             resume: Path | str | None) -> tuple:
    """The method's training data (next-token blocks by default), validation data and tokenizer, the count
    checked against the checkpoint a run resumes (``check_resumed_data``)."""
    data = method.load_data(args, model_config, plan) or load_data(args, model_config.vocab_size)
    if resume is not None:
        check_resumed_data(read_index(resume)[1].extra.get("sampler"), len(data[0]), resume)
    return data


class Trainer:
    """One training job: ``Trainer(args)`` builds everything (checks first, then the process group, the model,
    optimizer and state), ``step(step)`` runs one optimizer step, ``train()`` runs the loop with logging,
    evaluation and checkpoints.

    The model is built once on the meta device; the layout is planned (every refusal) before any process
    group exists; each rank then materialises only its shards, and a resume reads the checkpoint once
    (weights, optimizer, scheduler and RNG together).
    """

    def __init__(self, args: TrainArgs, method: type[TrainingMethod] | None = None) -> None:
        """``method``: the training method (default: the one --method names); it reads its data
        (``TrainingMethod.load_data``) and is made once the model is laid out (``TrainingMethod.create``)."""
        method = method or method_for(args)
        self.args = args
        resume, model_config, meta, saved, plan = plan_run(args, int(os.environ.get("WORLD_SIZE", "1")))
        self.device = device = pick_device(args.device)
        if device.type == "cpu":  # the next step reuses what this one frees, not page-faulting it in again
            keep_freed_memory()
        check_float8_device(plan.config, device)  # float8 off a float8 GPU: before any data is read
        # Data before any process group: a bad file fails every rank at once, never inside a collective.
        self.blocks, self.val_blocks, self.tokenizer = run_data(args, model_config, plan, method, resume)
        self.eval_prompts = EvalPrompts.of_run(args, self.tokenizer, model_config, plan.config)
        init_distributed(device, args.backend, args.ddp_timeout)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.heartbeat = Heartbeat.start(int(os.environ.get("RANK", "0")), world)  # names a stuck rank on a timeout
        self.stragglers = StragglerWatch(world)  # names a rank that stays slow (plait.run.stragglers)
        self.step_started = time.perf_counter()
        if not is_url(args.output_dir):  # a store is shared by every node
            check_shared_dir(Path(args.output_dir))  # node-local dirs would fail only at the first save
        torch.manual_seed(args.seed)  # the stream dropout draws from: a function of --seed, as is everything else
        self.console = Console(stderr=True, quiet=not is_main_process())

        # Each rank materialises only its own shards: from the checkpoint, the model dir, or seeded init.
        load_start = time.perf_counter()
        source = resume or args.model_name_or_path or model_config
        self.pmodel = pmodel = parallelize(meta, plan, timeout=datetime.timedelta(seconds=args.ddp_timeout))
        if resume is None:  # the weights to start from: seeded, a model directory's or a plait checkpoint's
            kind = materialize_source(pmodel, source, seed=args.seed, device=device)
        else:  # allocated for load_checkpoint below; a LoRA checkpoint's frozen base from its reference
            kind, path, seed = ("checkpoint", resume, args.seed) if saved is None else base_source(saved[1], args.seed)
            materialize(pmodel, kind, path, seed=seed, device=device)
        note = init_fallback_note(default_registry(), pmodel.adapter, model_config) if kind == "init" else None
        if note:
            self.console.print(f"note: {note}")
        if args.torch_compile:
            pmodel.torch_compile(default_registry().leaf_modules(pmodel.adapter, model_config))
        self.mesh = mesh = pmodel.mesh
        # a cp rank reads only the tokens of its slice of each block (and their labels) from a token file
        self.spans = read_spans(args.block_size, mesh.cp, mesh.cp_rank) if mesh.cp > 1 else None
        if mesh.cp > 1:  # each cp rank drops out its own tokens: its own stream (alike over its tp group)
            torch.manual_seed(init_seed(args.seed, "dropout", mesh.cp_rank))
        self.global_batch = args.global_batch(mesh.dp)
        self.method = method.create(self)
        # replica groups (--fault_tolerance torchft) each train on their share of a global batch R times theirs
        self.sampler = GlobalBatchSampler(len(self.method), self.method.rows_per_step(self.global_batch)
                                          * args.num_replica_groups, args.seed)
        # AdamW's fused kernel (one launch for all parameters) where torch has one for the device, not on the CPU
        fused = {"fused": True} if use_fused_adamw(device) else {}
        self.optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=args.learning_rate,
                                         weight_decay=args.weight_decay,
                                         decay_embeddings=not args.exclude_embeddings_from_weight_decay,
                                         optimizer_dtype=getattr(torch, args.optimizer_dtype), **fused)
        self.optimizer_step = OptimizerStep(pmodel.grad_sync, self.optimizer, args.max_grad_norm or None)
        self.scheduler = get_scheduler(args.lr_scheduler_type, self.optimizer, num_warmup_steps=args.warmup_steps,
                                       num_training_steps=max(args.max_steps, 1))
        self.first_step, self.skipped_steps, self.empty_steps = 0, 0, 0
        self.loop_step, self.healed_step, self.replicas = 0, None, None
        if args.fault_tolerance == "torchft":
            self.replicas = join_replica_groups(self)
            self.optimizer_step.across = self.replicas
        self.signals, self.stop_signal = StopSignals(is_main_process(), args.ddp_timeout), 0
        self.saver = BackgroundSaver(datetime.timedelta(seconds=args.ddp_timeout)) if args.save_async else None
        if resume is not None:
            state = load_checkpoint(resume, pmodel, self.optimizer, self.scheduler)
            # the optimizer brings back the lr of the saved schedule's step; under a longer --max_steps this run's
            # schedule gives another (the saved 4-step linear one had reached 0: the first resumed step trained at 0)
            for group, base, scale in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                          self.scheduler.lr_lambdas):
                group["lr"] = base * scale(self.scheduler.last_epoch)
            self.sampler.load_state_dict(state.extra["sampler"])
            self.skipped_steps = state.extra.get("skipped_steps", 0)
            self.empty_steps = state.extra.get("empty_steps", 0)
            self.first_step = state.step
            self.console.print(f"resumed from {resume} at step {self.first_step}"
                               + (" (resharded)" if state.resharded else ""))
        self.routing = RoutingMetrics.install(pmodel)  # None for a dense model
        # checkpoints go to --output_dir; the run's other files (metrics.jsonl, loss.png, trackers') to it too, or
        # for a store to a local folder first, copied there at each save and at the end (RunFiles)
        self.checkpoints = args.output_dir
        self.files = RunFiles(args.output_dir, self.mesh.rank, fetch=resume is not None)
        self.output_dir = self.files.local
        if is_main_process():
            for partial in remove_partial_checkpoints(self.checkpoints):
                self.console.print(f"removed {partial}: a save that never finished")
        self.log = MetricsLog(self.output_dir, fresh=resume is None)
        self.log.write({"event": "load", "step": self.first_step, "load_seconds": time.perf_counter() - load_start,
                        "peak_rss_mb": peak_rss_mb(), "source": "init" if kind == "init" else str(source),
                        **({"moe_layers": self.routing.names} if self.routing is not None else {})})
        count = sum(local(p).numel() for p in pmodel.parameters())  # ZeRO-3: the rows this rank stores
        trained = sum(local(p).numel() for p in pmodel.parameters() if p.requires_grad)
        lora = f" (LoRA r={pmodel.plan.lora.config.r}: {trained:,} trained)" if pmodel.plan.lora is not None else ""
        cp = f" | cp attention {pmodel.plan.cp.strategy_for(args.block_size)}" if pmodel.plan.cp is not None else ""
        self.console.print(
            f"[bold]plait[/] layout {mesh.config.describe()}{cp} | adapter {pmodel.adapter.name} "
            f"({pmodel.adapter.distribution or 'in-process'}) | parameters on rank 0: {count:,}{lora} | "
            f"{self.method.describe(args.block_size)}, global batch {self.global_batch}")

    def rows_of(self, step: int) -> torch.Tensor:
        """The rows of step ``step``'s global batch that this job trains on (its replica group's share)."""
        return self.sampler.indices(self.method.sampler_step(step)).chunk(self.args.num_replica_groups)[
            self.args.replica_group_id]

    def step(self, step: int) -> dict:
        """Forward, backward and optimizer update of step ``step`` (0-based); returns its metrics record.

        A step whose loss or gradient norm is not finite is not applied; up to --skip_nonfinite_steps of them
        are skipped (counted in the record), the next one stops the run with ``TrainingDiverged``."""
        args, mesh = self.args, self.mesh
        start = time.perf_counter()
        indices = self.rows_of(step)
        # the loss's divisor over the whole global batch (every micro-step, every dp rank)
        num_items = self.method.divisor(indices)
        if num_items == 0:
            return self.empty_step(step, start)
        self.heartbeat.at(step + 1, "forward-backward")
        step_loss = torch.zeros((), device=self.device)
        batches = self.method.micro_batches(indices, mesh, args.gradient_accumulation_steps, self.device)
        self.method.before_step(self.pmodel, batches, step)
        if step + 1 < args.max_steps:  # read while this step computes (image-text rows' pixels)
            self.method.read_ahead(step + 1, self.rows_of(step + 1), mesh, args.gradient_accumulation_steps)
        for batch in batches:
            step_loss += self.method.micro_step(self.pmodel, batch, num_items)
        faults.maybe_inject(step + 1, params=self.optimizer_step.grad_sync.params)  # testing aid (as at the start)
        self.heartbeat.step_s = time.perf_counter() - self.step_started  # this rank's own work (stragglers)
        loss = comm.all_reduce(step_loss, mesh.replica_group)  # equal on every rank: all of them decide alike
        lr = self.optimizer_step.lr
        record = {"step": step + 1, "loss": loss.item(), "lr": lr, "trainable_tokens": num_items,
                  **self.method.step_metrics(self.pmodel)}
        if self.routing is not None:
            record.update(self.routing.take().record())
        self.heartbeat.at(step + 1, "optimizer")
        try:
            record["grad_norm"] = self.optimizer_step(loss).item()
        except UncommittedStep as lost:  # a replica group failed during the step: no group applies it
            record.update(grad_norm=lost.grad_norm, committed=False, replica_groups=self.replicas.participants)
            self.console.print(f"step {step + 1} not committed: a replica group failed during it; the live groups go "
                               f"on without it")
            self.end_step(record, start)
            return record
        except NonFiniteStep as bad:
            self.skipped_steps += 1
            record.update(grad_norm=bad.values["grad_norm"], skipped=True)
            if self.skipped_steps > args.skip_nonfinite_steps:
                self.log.write({**record, "skipped_steps": self.skipped_steps})
                raise TrainingDiverged(diverged_message(step + 1, bad, args, self.skipped_steps,
                                                        latest_checkpoint(self.checkpoints))) from None
        self.scheduler.step()
        if self.replicas is not None:
            record["replica_groups"] = self.replicas.participants
        self.end_step(record, start)
        if self.skipped_steps:
            record["skipped_steps"] = self.skipped_steps
        return record

    def quorum(self, step: int) -> int:
        """The step to run next: ``step``, or with replica groups (--fault_tolerance torchft) after their quorum the
        live groups' step where this group rejoined them (it took their state: ``plait.run.replicas``)."""
        if self.replicas is None:
            return step
        self.loop_step = step
        self.replicas.start_step()
        if self.healed_step is not None:
            step, self.healed_step = self.healed_step, None
            self.console.print(f"replica group {self.args.replica_group_id} joined the live groups at step {step + 1}, "
                               f"with their weights and optimizer state ({self.replicas.participants} groups)")
        return step

    def empty_step(self, step: int, start: float) -> dict:
        """A step whose global batch holds no token to train on (every label truncated away or masked): it
        contributes zero, as the global-token normalisation defines, so nothing is run or applied; the learning
        rate schedule moves on, and the step is counted, never taken for a divergence (a 0/0 loss)."""
        self.empty_steps += 1
        self.heartbeat.step_s = time.perf_counter() - self.step_started
        lr = self.optimizer_step.lr
        with warnings.catch_warnings():  # torch warns when the very first step is empty: the order is meant
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
            self.scheduler.step()
        self.console.print(f"step {step + 1}: no token to train on in this step's global batch (every label was "
                           f"truncated away or masked); nothing was applied")
        record = {"step": step + 1, "loss": 0.0, "lr": lr, "trainable_tokens": 0, "grad_norm": 0.0,
                  "empty_steps": self.empty_steps}
        self.end_step(record, start)
        return record

    def end_step(self, record: dict, start: float) -> None:
        """The step's throughput and peak memory (host, and the accelerator's allocator where there is one); and,
        in the same max-reduction over the world, the stop signal any rank received and a failed background save
        (raised on every rank), so that every rank sees them after the same step (``plait.run.stop``)."""
        accelerator_peak = peak_memory_bytes(self.device)  # None on the CPU: the same on every rank
        extra = [] if accelerator_peak is None else [accelerator_peak / 2**20]
        save_failed = self.saver is not None and self.saver.failed()
        rows = world_rows([self.heartbeat.step_s, own_peak_rss_mb(), self.signals.signum, save_failed, *extra])
        times = [row[0] for row in rows]
        peak, signum, save_failed, *device_peak = [max(column) for column in zip(*rows)][1:]
        if save_failed:
            self.wait_saved()
        self.stop_signal = int(signum)
        for rank, ratio in self.stragglers.observe(times):
            if is_main_process():
                self.console.print(straggler_line(rank, self.heartbeat.host_of(rank), ratio), soft_wrap=True)
        if len(times) > 1:
            record["stragglers"] = len(self.stragglers.named)
        tokens = 0 if record["trainable_tokens"] == 0 else self.method.step_tokens() or \
            self.global_batch * self.args.block_size  # an empty step ran nothing: no tokens a second
        record.update(tokens_per_s=tokens / (time.perf_counter() - start),
                      peak_rss_mb=peak)
        if device_peak:
            record["peak_device_mb"] = device_peak[0]

    def save(self, step: int) -> Path | str:
        """Save the checkpoint of ``step``; with --save_async its writing goes on in the background (``wait_saved``
        waits for it) and its path is returned at once."""
        self.heartbeat.at(step, "save")
        extra = {"sampler": self.sampler.state_dict(), "skipped_steps": self.skipped_steps,
                 "empty_steps": self.empty_steps, "flags": resumed_flags(self.args, self.global_batch)}
        path = checkpoint_path(self.checkpoints, step)
        pending = prepare_save(path, self.pmodel, self.optimizer, self.scheduler, step, extra,
                               tokenizer=self.method.preprocessor(self.tokenizer))
        if self.saver is None:
            self._saved(write_save(pending, comm.world_group()))
        else:
            self.saver.start(pending, self._saved)
        self.files.publish()
        return path

    def _saved(self, path: Path | str) -> None:
        """A checkpoint is complete: rotate the old ones out and say so (on the saving thread)."""
        rotate_checkpoints(self.checkpoints, self.args.save_total_limit, self.mesh.rank)
        self.console.print(f"saved {path}")

    def wait_saved(self) -> None:
        """Return once no checkpoint is being written in the background (--save_async); raise its error if any."""
        if self.saver is not None:
            self.saver.wait()

    def train(self) -> list[dict]:
        """Steps from the first (0, or the resumed one) to --max_steps; returns each one's metrics (every rank).

        On a terminal rank 0 shows a progress bar; elsewhere (a log file, a pipe) it prints one readable line per
        --logging_steps instead, its ETA from the mean step so far. The --report_to trackers, opened on rank 0
        only, get every step's metrics and are closed however the loop ends, with its exit status. SIGTERM or
        SIGINT stops the run after the step in progress, saving it (``plait.run.stop``)."""
        args, history = self.args, []
        terminal = self.console.is_terminal
        progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                            TextColumn("{task.description}"), TimeRemainingColumn(), console=self.console,
                            disable=not (is_main_process() and terminal))
        names = parse_report_to(args.report_to) if is_main_process() else []
        trackers = Trackers.open(names, self.output_dir, dataclasses.asdict(args), self.first_step)
        started = time.perf_counter()
        explained = explain_timeouts(args.ddp_timeout, self.heartbeat)
        replicas = closing(self.replicas) if self.replicas else nullcontext()
        with self.finishing(history), closing(self.heartbeat), replicas, trackers, progress, explained, self.signals:
            task = progress.add_task("", total=args.max_steps, completed=self.first_step)
            step = self.first_step
            while step < args.max_steps and (step := self.quorum(step)) < args.max_steps:
                self.step_started = time.perf_counter()
                self.heartbeat.at(step + 1, "data")
                faults.maybe_inject(step + 1)  # testing aid: a no-op unless PLAIT_FAULT_INJECT is set
                record = self.step(step)
                is_last = step + 1 == args.max_steps
                evaluating = (args.eval_steps and (step + 1) % args.eval_steps == 0) or is_last
                if evaluating and (self.val_blocks is not None or self.eval_prompts):
                    self.heartbeat.at(step + 1, "evaluation")
                if self.val_blocks is not None and evaluating:
                    record.update(self.method.evaluate(self.pmodel, self.val_blocks, args.per_device_train_batch_size,
                                                       self.device))
                if self.eval_prompts and evaluating:  # completions from this step's weights (plait.run.prompts)
                    record["samples"] = self.eval_prompts.samples(self.pmodel, self.device)
                history.append(record)
                self.log.write(record)
                trackers.log(record)
                progress.update(task, advance=1, description=progress_text(record))
                if ((step + 1) % args.logging_steps == 0 or "eval_loss" in record or is_last) and not terminal:
                    seconds_per_step = (time.perf_counter() - started) / (step + 1 - self.first_step)
                    self.console.print(log_line(record, args.max_steps, seconds_per_step), soft_wrap=True)
                saved = None
                if should_save(step + 1, args.save_steps) or (is_last and args.save_final):
                    saved = self.save(step + 1)
                # a stop waits for a step a checkpoint resumes exactly from (GRPO: a cycle of iterations' end)
                signum = 0 if is_last or not self.method.resumable_after(step + 1) else self.stop_signal
                if signum:
                    if saved is None and args.save_on_signal:
                        saved = self.save(step + 1)
                    self.wait_saved()
                    last = latest_checkpoint(self.checkpoints)
                    raise StopRequested(signum, step + 1, args.max_steps, saved and str(saved), last and str(last))
                step += 1
            self.wait_saved()  # the last checkpoint complete before the run ends
        return history

    @contextmanager
    def finishing(self, history: list[dict]) -> Iterator[None]:
        """The loss curve, and a store's copy of the run's files, when the run ends: at its last step, or stopped by
        a signal or a divergence (so the store's metrics.jsonl holds the diverged step's record, and loss.png is
        there after a stop); not after a fault, where the store may be what failed."""
        try:
            yield
        except (StopRequested, TrainingDiverged):
            self.finish_files(history)
            raise
        self.finish_files(history)

    def finish_files(self, history: list[dict]) -> None:
        plotted = is_main_process() and history and plot_loss_curve(history, self.output_dir / "loss.png")
        self.files.publish()
        if plotted:
            self.console.print(f"loss curve: {self.files.location('loss.png')}")


def train(args: TrainArgs) -> list[dict]:
    """Run the training job described by ``args``; returns the per-step metrics (every rank)."""
    return Trainer(args).train()
