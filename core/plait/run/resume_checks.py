"""What a resume restores, checked against the flags of the run that resumes.

A resume brings back the optimizer's hyperparameters and groups, the schedule, the data order over the blocks and
the batch, and a LoRA checkpoint its adapters' settings; a flag asking for other values would silently not take
effect (or fail after the data was read), so such flags are refused before any worker or weight read. The model a
method's reference is read from (DPO's, GRPO's under --beta) is read again on a resume: the checkpoint records it, and
a resume that leaves its flag out reads the recorded one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from plait.base.config import ConfigError
from plait.checkpoint.store import is_url
from plait.run.train_args import LORA_SETTINGS, TrainArgs

if TYPE_CHECKING:
    from peft import LoraConfig


# what a resume restores from the checkpoint (the optimizer's hyperparameters and groups, the schedule, the data
# order over the blocks and the batch, the seed of that order and of the random streams), so a run resuming with
# other values would silently not use them
RESUMED_FLAGS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay",
                 "exclude_embeddings_from_weight_decay", "block_size", "seed")


# the models a run started from, which a resume reads again where they are a method's reference (DPO's: the policy
# as it started, or --ref_model_name_or_path; GRPO's under --beta): recorded absolute, restored by ``restore_reference``
STARTED_FROM = ("model_name_or_path", "ref_model_name_or_path")


def resumed_flags(args: TrainArgs, global_batch: int) -> dict:
    """What a checkpoint records of RESUMED_FLAGS, the global batch (sequences per step over dp and accumulation)
    and the models the run started from (STARTED_FROM), for ``check_resumed_flags``."""
    return {name: getattr(args, name) for name in RESUMED_FLAGS} | {"global_batch": global_batch} | \
        {name: _absolute(getattr(args, name)) for name in STARTED_FROM}


def _absolute(path: str | None) -> str | None:
    """A model's place as a checkpoint records it: absolute (a resume may run from another directory), a URL as is."""
    return path if path is None or is_url(path) else str(Path(path).resolve())


def check_resumed_flags(args: TrainArgs, saved: dict | None, global_batch: int, resume: object) -> None:
    """Refuse resuming with other values of what a resume restores (a checkpoint from before they were recorded,
    ``saved`` None, is not checked): the flags, then the global batch, which the data order continues by; the models
    a method's reference is read from are restored first (``restore_reference``)."""
    restore_reference(args, saved, resume)
    if saved is None:
        return
    mine = resumed_flags(args, global_batch)
    differ = [name for name in RESUMED_FLAGS if name in saved and saved[name] != mine[name]]
    if differ:
        raise ConfigError(
            f"--resume_from_checkpoint {resume} was saved with {' '.join(f'--{n} {saved[n]}' for n in differ)}, which "
            f"a resume restores (optimizer, schedule and data order), so this run's "
            f"{' '.join(f'--{n} {mine[n]}' for n in differ)} would not take effect; resume with the checkpoint's "
            f"values, or start a new run from its weights (plait consolidate, then --model_name_or_path)")
    if saved.get("global_batch", global_batch) != global_batch:
        raise ConfigError(
            f"--resume_from_checkpoint {resume} was saved by a run of {saved['global_batch']} sequences a step "
            f"(--per_device_train_batch_size x data-parallel ranks x --gradient_accumulation_steps), this run has "
            f"{global_batch}, and the data order continues by the checkpoint's batch; resume with a global batch "
            f"of {saved['global_batch']}")


def restore_reference(args: TrainArgs, saved: dict | None, resume: object) -> None:
    """A method's reference is read again on a resume, from the model the run started from: DPO's is
    --ref_model_name_or_path or the starting policy (--model_name_or_path; a seeded init of the config without it),
    GRPO's under --beta the starting policy. A resume that leaves those flags out would read another one (a seeded
    init) and give other numbers than the uninterrupted run, so they are taken from the checkpoint (``resumed_flags``
    records them); one given that names another model than the recorded one is refused, unless the recorded one is
    gone (moved: the flag gives its new place). A checkpoint from before they were recorded needs the flag given.
    (Under LoRA the reference is the base with its adapters off: a LoRA checkpoint checks its base itself.)"""
    role = "DPO's reference" if args.method == "dpo" else "GRPO's reference (--beta)" \
        if args.method == "grpo" and args.beta else None
    if role is None:
        return
    saved = saved or {}
    flags = ("ref_model_name_or_path", "model_name_or_path") if args.method == "dpo" else ("model_name_or_path",)
    for flag in flags:
        if flag not in saved:  # recorded by a plait from before: the policy's model must be named (--model_config:
            # the run started from the seeded init of that config, which the resume's seed gives again)
            if not any(getattr(args, name) for name in (*flags, "model_config")):
                also = " (or --ref_model_name_or_path, where the run had one)" if len(flags) > 1 else ""
                raise ConfigError(f"--resume_from_checkpoint {resume} does not record the model the run started from, "
                                  f"which is {role}; give it with --model_name_or_path{also}, or --model_config for "
                                  f"a run that started from a config's seeded init")
            return
        recorded, given = saved[flag], getattr(args, flag)
        gone = recorded is not None and not is_url(recorded) and not Path(recorded).exists()
        if given is None and recorded is not None:
            if gone:
                raise ConfigError(f"--resume_from_checkpoint {resume} was started from --{flag} {recorded}, which is "
                                  f"{role} and is gone; give its new place with --{flag}")
            setattr(args, flag, recorded)
        elif given is not None and _absolute(given) != recorded and not gone:
            was, fix = (f"from --{flag} {recorded}", "with that one, or without the flag") if recorded else \
                (f"without --{flag}", "without the flag")
            raise ConfigError(f"--resume_from_checkpoint {resume} was started {was}, which gives {role}; this run's "
                              f"--{flag} {given} would change it: resume {fix}")
        if args.ref_model_name_or_path:  # DPO's reference is that model: the policy's source is not read for it
            return


def check_resumed_lora(args: TrainArgs, saved: LoraConfig | None, resume: object) -> None:
    """The --lora_* flags beside a resume: a LoRA checkpoint brings its own settings, so flags giving other ones are
    refused (they were ignored, or broke the load after the data was read); a full checkpoint has no adapters to
    go on with, so --lora_r is refused and the other --lora_* flags are as without a resume."""
    given = args.given(("lora_r", *LORA_SETTINGS))
    if not given:
        return
    if saved is None:
        fix = "resume without --lora_r, or train adapters on its weights (plait consolidate, then --model_name_or_path)"
        if args.lora_r:
            raise ConfigError(f"--resume_from_checkpoint {resume} holds a whole model, no LoRA adapters; {fix}")
        args.refuse_idle_lora_settings()
    mine = dataclasses.replace(args, lora_r=args.lora_r or saved.r).lora()
    keys = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
            "lora_target_modules": "target_modules", "lora_target_parameters": "target_parameters"}
    norm = lambda v: sorted(v) if isinstance(v, (set, list, tuple)) else v  # noqa: E731
    differ = [n for n in given if norm(getattr(mine, keys[n])) != norm(getattr(saved, keys[n]))]
    if differ:
        held = ", ".join(f"--{n} {norm(getattr(saved, keys[n]))}" for n in differ)
        raise ConfigError(f"--resume_from_checkpoint {resume} holds LoRA adapters of {held}, which it brings back; "
                          f"leave out {', '.join(f'--{n}' for n in differ)} (a LoRA checkpoint gives its own)")


def check_resumed_data(saved: dict | None, examples: int, resume: object) -> None:
    """The data order goes on over the checkpoint's examples (``saved``: its sampler's state): another count (other
    data, or the same laid out otherwise by --packing, --overlong or --block_size) is refused when the data is read,
    before any weight (it failed after the whole checkpoint was loaded, naming the sampler's fields)."""
    if saved is not None and saved["num_blocks"] != examples:
        raise ConfigError(
            f"--resume_from_checkpoint {resume} was trained on {saved['num_blocks']:,} examples (blocks, pairs or "
            f"prompts) and this run's data has {examples:,}; the data order goes on only over the same data laid out "
            f"the same way: resume with the checkpoint's data and its --packing, --overlong and --block_size, or start "
            f"a new run from its weights (plait consolidate, then --model_name_or_path)")
