"""The flags of ``plait train`` and what they mean together: one dataclass, so the command line and a config file
share their names. The flags themselves (names, defaults, help) are ``plait.run.train_flags.TrainFlags``; here are
the checks before any process group, the layout they give, and the command line and config file readers.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.base.config import CP_ATTENTION, FLOAT8_RECIPES, MOE_AUX_LOSS_SCOPES, ConfigError, ParallelConfig
from plait.base.words import no_effect
from plait.base.pipeline_schedules import DEFAULT_SCHEDULE, SCHEDULES, microbatch_refusal
from plait.cp.sequence import check_length
from plait.data.sft_blocks import OVERLONG
from plait.data.sft_records import SFTSource
from plait.lora.config import lora_config
from plait.parallel.float8 import ALIGN, require_torchao
from plait.run.method_args import MethodArgs, _names
from plait.run.train_flags import DATA_FORMATS, LAYOUTS, LR_SCHEDULERS, TrainFlags
from plait.run.prompts import read_prompts
from plait.run.replicas import check_fault_tolerance
from plait.run.runtime import under_plait_launcher
from plait.run.trackers import parse_report_to

if TYPE_CHECKING:
    from peft import LoraConfig


# the flags --layout auto chooses (plait.auto_layout); giving one beside it is refused
AUTO_LAYOUT_FLAGS = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "expert_parallel_size",
                     "virtual_pipeline_size", "num_microbatches", "pipeline_schedule", "disable_sequence_parallel",
                     "zero_1", "gradient_checkpointing", "pipeline_cuts")


LORA_SETTINGS = ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters")  # need --lora_r


@dataclass
class TrainArgs(TrainFlags):
    """``plait train``'s flags (``TrainFlags``) and what they mean together: the checks before any process
    group, the parallel layout, LoRA's config, the global batch."""

    def lora(self) -> "LoraConfig | None":
        """peft's LoraConfig from the --lora_* flags (None without --lora_r)."""
        if not self.lora_r:
            return None
        targets = None if self.lora_target_modules is None else _names(self.lora_target_modules)
        parameters = {"target_parameters": _names(self.lora_target_parameters)} if self.lora_target_parameters else {}
        return lora_config(self.lora_r, self.lora_alpha, self.lora_dropout, targets, **parameters)

    def validate(self) -> None:
        """Checks that need no model: fail before any process group or file exists."""
        self._validate_method()
        if self.model_config and self.model_name_or_path:
            raise ConfigError("give --model_config (random init) or --model_name_or_path (load weights), not both")
        for path_flag in ("model_config", "model_name_or_path"):
            value = getattr(self, path_flag)
            if value is not None and not Path(value).exists():
                raise ConfigError(f"--{path_flag} {value!r} does not exist")
        if self.model_config and Path(self.model_config).is_dir():
            raise ConfigError(f"--model_config {self.model_config!r} is a directory; give its config.json, or load "
                              f"the model's weights with --model_name_or_path {self.model_config}")
        for path_flag in ("train_file", "validation_file"):  # a file, a directory, or a glob of them
            value = getattr(self, path_flag)
            if value is not None and not Path(value).exists() and not glob.glob(value, recursive=True):
                raise ConfigError(f"--{path_flag} {value!r} does not exist (nor matches a file as a glob)")
        resume = self.resume_from_checkpoint
        if resume not in (None, "auto") and "://" not in resume and not Path(resume).exists():
            raise ConfigError(f"--resume_from_checkpoint {resume!r} does not exist (give a checkpoint dir, or 'auto')")
        for path_flag in ("tokenizer_name", "dataset_name"):
            value = getattr(self, path_flag)
            if value is not None and not Path(value).exists():
                raise ConfigError(f"--{path_flag} {value!r} does not exist")
        if self.train_file and self.dataset_name:
            raise ConfigError("give --train_file or --dataset_name, not both")
        positive = ("per_device_train_batch_size", "block_size", "logging_steps", "ddp_timeout",
                    "gradient_accumulation_steps", "tensor_parallel_size", "nproc_per_node", "pipeline_parallel_size",
                    "context_parallel_size", "expert_parallel_size",
                    "virtual_pipeline_size", "eval_max_new_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name}={getattr(self, name)} must be positive")
        if self.block_size < 2:
            raise ConfigError(f"--block_size={self.block_size} leaves no token to train on (a block's first token has "
                              f"no label); use --block_size 2 or more")
        if self.pipeline_schedule not in SCHEDULES:
            raise ConfigError(f"--pipeline_schedule={self.pipeline_schedule!r} is unknown; choose one of "
                              f"{', '.join(SCHEDULES)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.zero_1 and self.zero_stage not in (0, 1):
            raise ConfigError(f"--zero_1 is ZeRO stage 1 but --zero_stage is {self.zero_stage}; give one of them")
        if self.moe_aux_loss_scope not in MOE_AUX_LOSS_SCOPES:
            raise ConfigError(f"--moe_aux_loss_scope={self.moe_aux_loss_scope!r} is unknown; choose one of "
                              f"{', '.join(MOE_AUX_LOSS_SCOPES)}")
        if self.eval_prompts is not None:
            read_prompts(Path(self.eval_prompts), "--eval_prompts", images=True)  # a text model's: EvalPrompts
        if self.context_parallel_size > 1:
            config = self.parallel_config()
            check_length(self.block_size, config.cp, config.tp, config.sequence_parallel)
        if self.per_device_train_batch_size % self.microbatches():
            raise ConfigError(
                f"--per_device_train_batch_size={self.per_device_train_batch_size} is not divisible by "
                f"--num_microbatches={self.num_microbatches}; use a batch that is a multiple of {self.num_microbatches}"
            )
        for name in ("num_microbatches", "max_steps", "eval_steps", "warmup_steps", "save_steps", "save_total_limit",
                     "skip_nonfinite_steps", "max_restarts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name}={getattr(self, name)} must be >= 0")
        if self.fault_tolerance not in ("none", "torchft"):
            raise ConfigError(f"--fault_tolerance={self.fault_tolerance!r} is unknown; choose none or torchft")
        check_fault_tolerance(self.fault_tolerance, self.replica_group_id, self.num_replica_groups,
                              self.zero_1 or self.zero_stage > 0)
        if self.save_async and not 0 < self.save_steps < self.max_steps:
            raise ConfigError(f"--save_async overlaps a checkpoint's writing with the steps after it, and no "
                              f"--save_steps save falls before the last step (--save_steps {self.save_steps}, "
                              f"--max_steps {self.max_steps}); set --save_steps below --max_steps or drop --save_async")
        for name in ("learning_rate", "weight_decay"):  # a learning rate of 0 measures the loss without training
            if not 0 <= getattr(self, name) < math.inf:  # nan and inf fail too
                raise ConfigError(f"--{name}={getattr(self, name)} must be a finite number >= 0")
        if not self.moe_capacity_factor >= 0:
            raise ConfigError(f"--moe_capacity_factor={self.moe_capacity_factor} must be >= 0 (0: dropless)")
        if not self.max_grad_norm >= 0:  # inf clips nothing, as 0 does
            raise ConfigError(f"--max_grad_norm={self.max_grad_norm} must be >= 0 (0 turns clipping off)")
        check_backend(self.backend)
        if self.optimizer_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--optimizer_dtype={self.optimizer_dtype!r} is unknown; choose float32 or bfloat16")
        if self.bf16 and self.bf16_autocast:
            raise ConfigError("give --bf16 (bf16 parameters) or --bf16_autocast (fp32 parameters), not both")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"--layout={self.layout!r} is unknown; choose one of {', '.join(LAYOUTS)}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as err:
                raise ConfigError(f"--device={self.device!r} is not a device torch knows ({err}); use auto, cpu, or "
                                  f"the name of an accelerator type torch has, with or without an index") from None
        if self.data_format not in DATA_FORMATS:
            raise ConfigError(f"--data_format={self.data_format!r} is unknown; choose one of {', '.join(DATA_FORMATS)}")
        if self.overlong not in OVERLONG:
            raise ConfigError(f"--overlong={self.overlong!r} is unknown; choose one of {', '.join(OVERLONG)}")
        if self.lora_r < 0:
            raise ConfigError(f"--lora_r={self.lora_r} must be >= 0 (0: no LoRA)")
        self.lora()  # the LoRA flags' own checks
        if self.cp_attention not in CP_ATTENTION:
            raise ConfigError(f"--cp_attention={self.cp_attention!r} is unknown; choose one of "
                              f"{', '.join(CP_ATTENTION)}")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ConfigError(f"--lr_scheduler_type={self.lr_scheduler_type!r} is unknown; choose one of "
                              f"{', '.join(LR_SCHEDULERS)}")
        parse_report_to(self.report_to)  # known trackers, their packages installed
        self._check_output_dir()
        if self.float8 is not None:
            if self.float8 not in FLOAT8_RECIPES:
                raise ConfigError(f"--float8={self.float8!r} is unknown; choose one of {', '.join(FLOAT8_RECIPES)}")
            require_torchao(self.float8)
            if self.block_size % (ALIGN * self.context_parallel_size):
                per = f" / cp={self.context_parallel_size}" if self.context_parallel_size > 1 else ""
                raise ConfigError(
                    f"--float8 {self.float8}: --block_size={self.block_size}{per} is not a multiple of {ALIGN}, which "
                    f"float8's weight-gradient matmul (torch._scaled_mm) needs for the tokens it contracts over "
                    f"(checked under --float8_emulate too); use a --block_size that is a multiple of "
                    f"{ALIGN * self.context_parallel_size}")
        elif self.float8_emulate:
            raise ConfigError(f"--float8_emulate emulates float8 matmuls, but --float8 is not given; add --float8 "
                              f"{' or '.join(FLOAT8_RECIPES)}")

    def _check_output_dir(self) -> None:
        """Refuse an output directory the run could not write its checkpoints to, before anything starts, not at the
        first save. A store's URL: its package installed and the store usable there (credentials, endpoint, bucket:
        a look-up or two, ``store.exists``) and writable by these credentials (``store.writable``)."""
        if "://" in self.output_dir:
            from plait.checkpoint import store  # noqa: PLC0415 (the package is heavy; only for a URL)

            store.exists(self.output_dir, "--output_dir")  # the answer does not matter here, its refusals do
            store.writable(self.output_dir, "--output_dir")
            return
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--output_dir {self.output_dir!r} is an existing file, not a directory; "
                              f"give a directory")
        existing = next(p for p in (out, *out.absolute().parents) if p.exists())
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"--output_dir {self.output_dir!r} cannot be written: {existing} is not writable by this "
                              f"user; give a directory you can write to")

    def check_flags_take_effect(self) -> None:
        """A flag that does nothing in the chosen layout is refused, not silently ignored: the user meant
        something by it (most often a layout flag they forgot). For a run only: ``plait plan --search`` reads
        --cp_attention and --pipeline_schedule for the layouts it tries."""
        pp, cp, tp, ep = (self.pipeline_parallel_size, self.context_parallel_size, self.tensor_parallel_size,
                          self.expert_parallel_size)
        idle = [
            (pp == 1 and self.virtual_pipeline_size > 1, f"--virtual_pipeline_size={self.virtual_pipeline_size}",
             "pipeline parallelism", "--pipeline_parallel_size"),
            (pp == 1 and self.pipeline_schedule in SCHEDULES and self.pipeline_schedule != DEFAULT_SCHEDULE,
             f"--pipeline_schedule={self.pipeline_schedule}",
             "pipeline parallelism", "--pipeline_parallel_size"),
            (pp == 1 and bool(self.pipeline_cuts), "--pipeline_cuts", "pipeline parallelism",
             "--pipeline_parallel_size"),
            (cp == 1 and self.cp_attention != "auto", f"--cp_attention={self.cp_attention}", "context parallelism",
             "--context_parallel_size"),
            (ep == 1 and self.moe_capacity_factor > 0, f"--moe_capacity_factor={self.moe_capacity_factor:g}",
             "expert parallelism", "--expert_parallel_size"),
            (tp == 1 and self.disable_expert_tensor_parallel, "--disable_expert_tensor_parallel", "tensor parallelism",
             "--tensor_parallel_size"),
            (tp == 1 and self.disable_sequence_parallel, "--disable_sequence_parallel", "tensor parallelism",
             "--tensor_parallel_size"),
            (tp == 1 and self.disable_embedding_parallelization, "--disable_embedding_parallelization",
             "tensor parallelism", "--tensor_parallel_size"),
        ]
        for unused, flag, axis, size in idle:
            if unused:
                raise ConfigError(f"{flag} has no effect without {axis} ({size} 1); drop it, or set {size}")
        if self.eval_steps and self.validation_file is None and self.eval_prompts is None:
            raise ConfigError(f"--eval_steps={self.eval_steps} has no effect without something to evaluate; give "
                              f"--validation_file or --eval_prompts, or drop it")
        if self.exclude_embeddings_from_weight_decay and not self.weight_decay:
            raise ConfigError("--exclude_embeddings_from_weight_decay has no effect with --weight_decay 0 (nothing is "
                              "decayed); give --weight_decay, or drop it")
        if self.save_steps > self.max_steps > 0:
            raise ConfigError(f"--save_steps={self.save_steps} never saves: the run ends at step {self.max_steps} "
                              f"(--max_steps); use a smaller --save_steps, or drop it (the final save is made anyway)")
        if self.save_total_limit and not self.save_steps and not self.save_final:
            raise ConfigError(f"--save_total_limit={self.save_total_limit} has no effect: with --save_steps 0 and "
                              f"--no_save_final this run saves no checkpoint; drop it, or give --save_steps")
        if self.warmup_steps and self.lr_scheduler_type == "constant":
            raise ConfigError(f"--warmup_steps={self.warmup_steps} has no effect under --lr_scheduler_type constant; "
                              f"use --lr_scheduler_type constant_with_warmup, or drop it")
        if "LOCAL_RANK" in os.environ and not under_plait_launcher():  # a worker of a torchrun started by hand
            if self.max_restarts:
                raise ConfigError(f"--max_restarts={self.max_restarts} is for plait's launcher, and this process is "
                                  f"a worker of a torchrun started by hand; give torchrun --max-restarts "
                                  f"{self.max_restarts} instead (its restarts resume from the newest checkpoint too)")
            if self.nproc_per_node > 1:
                raise ConfigError(f"--nproc_per_node={self.nproc_per_node} launches plait's processes, and this "
                                  f"process is a worker of a torchrun started by hand, whose own --nproc_per_node "
                                  f"gives the processes; drop it")
        if self.eval_prompts is None and self.eval_max_new_tokens != 32:
            raise ConfigError(f"--eval_max_new_tokens={self.eval_max_new_tokens} has no effect without --eval_prompts; "
                              f"drop it, or give --eval_prompts FILE.jsonl")
        if not self.lora_r and not self.resume_from_checkpoint:  # a resume's are checked against its checkpoint
            self.refuse_idle_lora_settings(", or set --lora_r (e.g. 8)")

    def check_zero_has_ranks(self, config: ParallelConfig) -> None:
        """--zero_1 / --zero_stage with one data-parallel rank in the planned layout (``config``, its world
        resolved) would do nothing: refused as ``layout_plan.check_zero_has_ranks`` does, naming the flag as typed."""
        from plait.layout_plan import check_zero_has_ranks  # noqa: PLC0415 (the planner is heavy; trainer has it)

        check_zero_has_ranks(config, "--zero_1" if self.zero_1 else f"--zero_stage {self.zero_stage}")

    def given(self, names: tuple[str, ...]) -> list[str]:
        """Those of ``names`` whose value is not the default: the flags the user gave."""
        defaults = {f.name: f.default for f in fields(self)}
        return [name for name in names if getattr(self, name) != defaults[name]]

    def refuse_unread(self, names: tuple[str, ...], reason: str) -> None:
        """Those of the flags ``names`` the user gave, which the run's data path never reads (``reason``: why, e.g.
        plain text has no prompt to train on), refused in one line."""
        given = [f"--{name}" for name in self.given(names)]
        if given:
            raise ConfigError(no_effect(given, f": {reason}"))

    def refuse_idle_lora_settings(self, fix: str = "") -> None:
        """--lora_alpha and the other LoRA settings without LoRA (--lora_r 0) do nothing: refused, with ``fix``."""
        given = [f"--{name}" for name in self.given(LORA_SETTINGS)]
        if given:
            raise ConfigError(no_effect(given, " without LoRA (--lora_r 0)", fix))

    def global_batch(self, dp: int) -> int:
        """Sequences (rows) a step trains: the per-device batch over ``dp`` ranks and the accumulation steps."""
        return self.per_device_train_batch_size * dp * self.gradient_accumulation_steps

    def microbatches(self) -> int:
        """--num_microbatches, or when 0 the default: 1 without pipeline parallelism; with it the smallest count
        of at least pp microbatches that divides the per-device batch and the schedule accepts
        (``microbatch_refusal``), so that ``--pipeline_parallel_size P`` alone works and keeps the bubble smallest."""
        if self.num_microbatches:
            return self.num_microbatches
        pp, batch = self.pipeline_parallel_size, self.per_device_train_batch_size
        if pp == 1:
            return 1
        # an unknown schedule is refused later
        schedule = self.pipeline_schedule if self.pipeline_schedule in SCHEDULES else DEFAULT_SCHEDULE
        for count in range(pp, batch + 1):
            if batch % count == 0 and microbatch_refusal(schedule, pp, count) is None:
                return count
        raise ConfigError(
            f"--pipeline_parallel_size={pp} needs at least {pp} microbatches per micro-step, but "
            f"--per_device_train_batch_size={batch} cannot be split into them; use --per_device_train_batch_size {pp} "
            f"(or a multiple of it), or --pipeline_schedule gpipe --num_microbatches 1"
        )

    def sft_source(self) -> SFTSource:
        """The data flags the SFT data layer reads, as plain values."""
        return SFTSource(**{f.name: getattr(self, f.name) for f in fields(SFTSource)})

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tp=self.tensor_parallel_size,
            cp=self.context_parallel_size,
            cp_attention=self.cp_attention,
            ep=self.expert_parallel_size,
            moe_capacity_factor=self.moe_capacity_factor or None,
            moe_aux_loss_scope=self.moe_aux_loss_scope,
            expert_tensor_parallel=not self.disable_expert_tensor_parallel,
            pp=self.pipeline_parallel_size,
            virtual_pipeline_size=self.virtual_pipeline_size,
            num_microbatches=self.microbatches(),
            pipeline_schedule=self.pipeline_schedule,
            pipeline_cuts=tuple(c.strip() for c in self.pipeline_cuts.split(",") if c.strip())
            if self.pipeline_cuts else (),
            sp=not self.disable_sequence_parallel,
            disable_embedding_parallelization=self.disable_embedding_parallelization,
            zero_1=self.zero_1,
            zero_stage=self.zero_stage,
            mixed_precision=self.bf16 and self.zero_stage >= 2,
            gradient_checkpointing=self.gradient_checkpointing,
            bf16_autocast=self.bf16_autocast,
            float8=self.float8,
            float8_emulate=self.float8_emulate,
        )


def _kind(f: dataclasses.Field) -> type:
    """A field's type for the command line and the config file: ``float | None`` (unset by default) is a float."""
    return {"int": int, "float": float, "bool": bool}.get(str(f.type).removesuffix(" | None"), str)


def add_arguments(parser: argparse.ArgumentParser, cls: type = TrainArgs) -> None:
    """One ``--name`` flag per dataclass field; booleans are switches. Defaults are None here, so that
    ``from_namespace`` can tell a flag given on the command line from one left to the config file."""
    methods = {f.name for f in fields(MethodArgs)}  # the base class's fields, listed after the run's own
    for f in sorted(fields(cls), key=lambda f: f.name in methods):
        help_text = f.metadata.get("help", "")
        if _kind(f) is bool:
            parser.add_argument(f"--{f.name}", action="store_true", default=None, help=help_text)
            if f.default is True:  # a switch that is on by default is turned off as Hugging Face's parser does
                parser.add_argument(f"--no_{f.name}", action="store_false", dest=f.name, default=None,
                                    help=f"turn --{f.name} off")
        else:
            parser.add_argument(f"--{f.name}", type=_kind(f), default=None, help=f"{help_text} (default: {f.default})")


def read_config_file(path: str, cls: type = TrainArgs) -> dict:
    """The TOML file's keys, checked against the flag names and types."""
    import tomllib

    try:
        values = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r} does not exist") from None
    except (IsADirectoryError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config {path!r} is not a TOML file ({err.__class__.__name__}); give a file of "
                          f"`flag = value` lines") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}: not valid TOML ({err})") from None
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {', '.join(unknown)}; valid keys: "
                          f"{', '.join(sorted(known))}")
    for key, value in values.items():
        kind = _kind(known[key])
        if (not isinstance(value, kind) and not (kind is float and isinstance(value, int))) or \
                (isinstance(value, bool) and kind is not bool):  # a bool is an int to isinstance
            raise ConfigError(f"--config {path}: {key} = {value!r} should be of type {kind.__name__}")
    return values


def check_backend(name: str) -> None:
    """``--backend``: auto, or backends torch.distributed knows here (``gloo``, ``nccl``, or per device type
    ``TYPE:BACKEND,...``; ``xla`` where torch_xla is installed), refused before any process starts rather than by
    torch in every rank."""
    if name == "auto":
        return
    known = set(dist.Backend.backend_list) - {"undefined"}
    if importlib.util.find_spec("torch_xla"):  # registers its backend when imported
        known.add("xla")
    unknown = [part for part in (p.split(":")[-1].strip().lower() for p in name.split(",")) if part not in known]
    if unknown:
        raise ConfigError(f"--backend={name!r}: {', '.join(unknown)} is not a torch.distributed backend here; use auto "
                          f"or one of {', '.join(sorted(known))}")


def from_namespace(ns: argparse.Namespace, cls: type = TrainArgs):
    """Defaults, then the --config file, then flags given on the command line."""
    given = {f.name: getattr(ns, f.name) for f in fields(cls) if getattr(ns, f.name) is not None}
    from_file = read_config_file(given["config"], cls) if given.get("config") else {}
    return cls(**{**from_file, **given})
