"""GRPO's flags checked (TRL's rules, one line each, before any process group) and its reward functions found and
called, with TRL's signature: ``f(prompts, completions, completion_ids, **columns) -> list[float | None]`` (None: no
reward for that completion, skipped in the sum as TRL's NaN)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.base.config import ConfigError
from plait.base.words import no_effect
from plait.run.methods.grpo_loss import LOSS_TYPES, SCALE_REWARDS

RewardFunc = Callable[..., list]


def check_grpo(args: Any) -> None:
    """The flags of ``--method grpo``, each against TRL's rules; the reward functions are imported here."""
    if not args.train_file:
        raise ConfigError("--method grpo needs --train_file: a .jsonl of prompts ('prompt': text or chat messages)")
    if args.validation_file:
        raise ConfigError("--method grpo does not evaluate a --validation_file yet; drop it (--eval_prompts shows "
                          "completions at each evaluation)")
    unread = [flag for flag, given in (("--packing", args.packing), (f"--data_format {args.data_format}",
                                                                    args.data_format != "auto"),
                                       (f"--text_field {args.text_field}", args.text_field != "text"),
                                       ("--data_cache_dir", args.data_cache_dir is not None),
                                       ("--train_on_prompt", args.train_on_prompt),
                                       (f"--overlong {args.overlong}", args.overlong != "truncate")) if given]
    if unread:  # the prompts are read as they are: nothing is tokenized into blocks, packed or cached
        raise ConfigError(no_effect(unread, " with --method grpo (its prompts are TRL's prompt-only rows, read as they "
                                            "are)"))
    if args.loss_type not in LOSS_TYPES:
        raise ConfigError(f"--loss_type {args.loss_type!r} is not a GRPO loss; choose one of {', '.join(LOSS_TYPES)}")
    if args.scale_rewards not in SCALE_REWARDS:
        raise ConfigError(f"--scale_rewards {args.scale_rewards!r} is unknown; choose one of "
                          f"{', '.join(SCALE_REWARDS)}")
    if args.num_generations < 2:
        raise ConfigError(f"--num_generations {args.num_generations}: GRPO compares the completions of a prompt; give "
                          f"at least 2")
    if args.num_iterations < 1:
        raise ConfigError(f"--num_iterations {args.num_iterations}: optimizer steps per batch of rollouts, >= 1")
    uneven = [f"--{name} {getattr(args, name)}" for name in ("max_steps", "save_steps")
              if getattr(args, name) % args.num_iterations]
    if uneven:  # a checkpoint inside a cycle would not hold the cycle's rollouts
        raise ConfigError(f"{' '.join(uneven)} with --num_iterations {args.num_iterations}: checkpoints land where a "
                          f"cycle of {args.num_iterations} steps on one batch of rollouts ends; give multiples of "
                          f"{args.num_iterations}")
    if not args.temperature > 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError(f"--temperature {args.temperature:g} --top_p {args.top_p:g} --top_k {args.top_k}: rollouts "
                          f"are sampled: temperature > 0, 0 < top_p <= 1, top_k >= 0")
    if not args.epsilon > 0 or (args.epsilon_high is not None and not args.epsilon_high > 0):
        raise ConfigError(f"--epsilon {args.epsilon:g} --epsilon_high {args.epsilon_high}: the clip's widths are "
                          f"positive")
    if args.beta < 0:
        raise ConfigError(f"--beta {args.beta:g}: the KL penalty's weight is >= 0 (0: no reference model)")
    if not 0 < args.max_completion_length < args.block_size:
        raise ConfigError(f"--max_completion_length {args.max_completion_length} must be positive and below "
                          f"--block_size {args.block_size} (a prompt and its completion fit in --block_size)")
    reward_funcs(args)


def reward_funcs(args: Any) -> list[tuple[str, RewardFunc, float]]:
    """Each --reward_funcs function with its name and --reward_weights weight."""
    specs = [s.strip() for s in (args.reward_funcs or "").split(",") if s.strip()]
    if not specs:
        raise ConfigError("--method grpo needs --reward_funcs: FILE.py:FUNC or module:func, comma-separated")
    weights = [1.0] * len(specs)
    if args.reward_weights is not None:
        try:
            weights = [float(w) for w in args.reward_weights.split(",")]
        except ValueError:
            raise ConfigError(f"--reward_weights {args.reward_weights!r}: give comma-separated numbers") from None
        if len(weights) != len(specs):
            raise ConfigError(f"--reward_weights has {len(weights)} weights for {len(specs)} --reward_funcs; give one "
                              f"per function")
    return [(spec.rpartition(":")[2], load(spec), weight) for spec, weight in zip(specs, weights)]


@functools.cache  # a process checks the flags and then builds the method: the user's file runs once
def load(spec: str) -> RewardFunc:
    """The function a spec names: ``path/to/file.py:func`` or ``package.module:func``."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"--reward_funcs {spec!r}: give FILE.py:FUNC or module:func")
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise ConfigError(f"--reward_funcs {spec!r}: {where} does not exist")
            found = importlib.util.spec_from_file_location(f"plait_rewards_{Path(where).stem}", where)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as err:  # the user's module failed to import: its error, in one line
        raise ConfigError(f"--reward_funcs {spec!r}: importing {where} raised {type(err).__name__}: {err}") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise ConfigError(f"--reward_funcs {spec!r}: {where} has no function {name!r}")
    return func


def call_rewards(funcs: list[tuple[str, RewardFunc, float]], prompts: list, completions: list,
                 completion_ids: list[list[int]], columns: dict[str, list]) -> list[list[float]]:
    """Each function's reward of each completion [completions][functions] (NaN where it gave None); one line naming
    the function (and the row) for an error, a wrong count or a value that is not a number."""
    found = []
    for name, func, _ in funcs:
        try:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as err:
            row = failing_row(func, prompts, completions, completion_ids, columns)
            where = f" at completion {row} (prompt {prompts[row]!r:.60}, completion {completions[row]!r:.60})" \
                if row is not None else ""
            raise ConfigError(f"reward function {name} raised {type(err).__name__}: {err}{where}") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ConfigError(f"reward function {name} returned {count} rewards for {len(completions)} completions; "
                              f"it returns one number (or None) per completion")
        for row, value in enumerate(values):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"reward function {name} returned {value!r} for completion {row} "
                                  f"({completions[row]!r:.60}); rewards are numbers or None")
        found.append([math.nan if v is None else float(v) for v in values])
    return [list(row) for row in zip(*found)]


def failing_row(func: RewardFunc, prompts: list, completions: list, completion_ids: list,
                columns: dict[str, list]) -> int | None:
    """The first completion the function raises for on its own (it raised for the batch), or None."""
    for row in range(len(completions)):
        try:
            func(prompts=prompts[row:row + 1], completions=completions[row:row + 1],
                 completion_ids=completion_ids[row:row + 1], **{k: v[row:row + 1] for k, v in columns.items()})
        except Exception:
            return row
    return None


def unrewarded(rewards: list[list[float]], names: list[str], prompts: list, completions: list,
               step: int) -> str | None:
    """The completions of step ``step`` (as logged, from 1) that no reward function scored (None or NaN from every
    one, ``rewards`` [completions][functions] as ``call_rewards`` gives them): TRL's unscorable ones, which it warns
    about and trains at advantage 0 (``grpo_loss.advantages``); the warning's line is returned (None where every
    completion has a reward), naming the functions, the step and the first such completion. A step where no
    completion got any reward is refused: every advantage would be 0, so it would train nothing but the KL term (if
    any) while the run went on as if rewarded (TRL logs a NaN reward and goes on); a function that never scores (a
    column it misreads, a parse that never matches) is almost always why, and going on would hide it (the run's
    checkpoints stay: fix the function and resume)."""
    missing = [row for row, values in enumerate(rewards) if all(math.isnan(v) for v in values)]
    if not missing:
        return None
    funcs, row = ", ".join(names), missing[0]
    first = f"prompt {prompts[row]!r:.60}, completion {completions[row]!r:.60}"
    if len(missing) == len(rewards):
        raise ConfigError(f"step {step}: no completion got a reward: every reward function ({funcs}) returned None or "
                          f"NaN for all {len(rewards)} (the first: {first}), so the step would train on nothing; make "
                          f"at least one return a number for each completion (0.0 for no reward)")
    return (f"warning: step {step}: every reward function ({funcs}) returned None or NaN for {len(missing)} of "
            f"{len(rewards)} completions (the first: {first}); as TRL, they train at advantage 0, left out of their "
            f"group's baseline and the logged reward; make at least one return a number for each completion (said "
            f"once per run)")
