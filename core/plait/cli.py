"""The ``plait`` command: train, plan, consolidate, adapters, check-adapter.

Errors that are the user's to fix (bad layout, bad paths, unknown architecture) print one clear line and
exit with status 2, rather than a traceback. Each command imports its implementation when it runs (the
trainer, plait plan's estimates, LoRA export's peft and the conformance kit cost seconds of start-up), so
``plait --help`` or ``plait adapters`` pays for none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import shutil
import traceback
from typing import NoReturn

from plait.base.config import ConfigError, FaultError
from plait.base.words import flag_words
from plait.costs.device import PRESETS
from plait.generate_command import add_generate_parser
from plait.plugin.registry import AdapterError, default_registry, served_architectures
from plait.run.prepare_data import add_prepare_data_parser
from plait.run.runtime import TrainingDiverged
from plait.run.stop import StopRequested
from plait.run.torchrun import launch, report_error
from plait.run.train_args import TrainArgs, add_arguments, from_namespace


def cmd_train(ns: argparse.Namespace) -> None:
    args = from_namespace(ns, TrainArgs)
    args.validate()
    if (args.nproc_per_node > 1 or args.max_restarts) and "LOCAL_RANK" not in os.environ:
        # Not under torchrun yet: become torchrun, running this same command on every process (one process too
        # with --max_restarts: torchrun is what restarts it)
        launch(args.nproc_per_node, args.ddp_timeout, lambda: checked_before_launch(args, ns.argv), args.max_restarts)
        return
    if args.layout == "auto":
        if "LOCAL_RANK" in os.environ:
            raise ConfigError("--layout auto plans once, in the launching process: start it with plait train "
                              "--nproc_per_node N, not under torchrun")
        args, _ = auto_layout(args, ns.argv)
    from plait.run.trainer import train  # when run (module docstring)

    train(args)
    end_process_group(fault=False)


def checked_before_launch(args: TrainArgs, argv: list[str]) -> list[str]:
    """``plait train --nproc_per_node N`` before any worker: the layout chosen (``--layout auto``) and the run
    checked; the command the workers run."""
    if args.layout == "auto":
        args, argv = auto_layout(args, argv)
    from plait.run.trainer import check_before_launch  # when run (module docstring)

    check_before_launch(args, args.nproc_per_node)
    return argv


def auto_layout(args: TrainArgs, argv: list[str]) -> tuple[TrainArgs, list[str]]:
    """``--layout auto``: the command's words with the chosen flags after the user's (argparse takes the last of a
    flag: the batch split among them) and ``--layout manual``, and what they parse to."""
    from plait.auto_layout import choose_layout  # when run (module docstring)

    argv = [*argv, *choose_layout(args, args.nproc_per_node), "--layout", "manual"]
    args = from_namespace(build_parser().parse_args(argv), TrainArgs)
    args.validate()
    return args, argv


def cmd_plan(ns: argparse.Namespace) -> None:
    """The layout ``plait train`` would use with the same flags, planned on a meta model, with its memory,
    communication and bubble; ``--search``: the fastest layouts that fit."""
    from plait.plan_command import run_plan  # when run (module docstring)

    if ns.show_derived:
        print(show_derived(ns.show_derived), end="")
        return
    args = from_namespace(ns, TrainArgs)
    args.validate()
    run_plan(ns, args)


def show_derived(source: str) -> str:
    """The generic adapter's derived plans for ``source`` (a model_type or a config), as adapter code."""
    generic = next((a for a in default_registry().adapters if a.info.generic), None)
    if generic is None or not hasattr(generic.plugin, "show_derived"):
        raise ConfigError("--show-derived needs the generic adapter plait-transformers; install adapters/transformers")
    return generic.plugin.show_derived(source)


def cmd_adapters(ns: argparse.Namespace) -> None:
    registry = default_registry()
    if ns.architectures:
        print_served_architectures(registry, ns.json)
        return
    rows = [
        {"name": a.name, "version": a.version, "distribution": a.distribution,
         "architectures": list(a.info.architectures), "capabilities": a.info.capabilities.supported(),
         "hooks": a.hooks(registry.pm)}
        for a in registry.adapters
    ]
    if ns.json:
        print(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "version", "architectures", "capabilities", "hooks")
    for row in rows:
        claims = ", ".join(row["architectures"]) or "generic: decoder-only causal LMs with a transformers tp plan (--architectures)"
        table.add_row(row["name"], row["version"] or "-", claims,
                      ", ".join(row["capabilities"]), ", ".join(h.removeprefix("plait_") for h in row["hooks"]))
    Console(width=max(Console().width, 140)).print(table)


def print_served_architectures(registry, as_json: bool) -> None:
    """Which adapter serves each causal-LM architecture of the installed transformers, and why."""
    rows = served_architectures(registry)
    if as_json:
        print(json.dumps([{"architecture": a, "adapter": n, "why": w} for a, n, w in rows], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("architecture", "adapter", "why")
    for arch, name, why in rows:
        table.add_row(arch, name or "[red]none[/]", why)
    Console(width=max(Console().width, 140)).print(table)


def cmd_consolidate(ns: argparse.Namespace) -> None:
    """A whole model for a full checkpoint; for a LoRA checkpoint, which holds only the adapters and a reference
    to its base, what ``--lora`` asks for, by default the peft adapter (the small, lossless export). --format and
    --dtype act on every path; --max_shard_size on a whole or merged model, and is refused for a peft adapter
    (one file) before any weight is read."""
    from plait.checkpoint import consolidate  # when run (module docstring)
    from plait.checkpoint.format import read_index

    lora = ns.lora
    if lora is None and "lora" in read_index(ns.checkpoint_dir)[1].extra:
        lora = "adapter"
    target, local = ns.output_dir, None
    if "://" in target:  # a store: written here first, then copied there (a LoRA export too: it made a local "s3:")
        from plait.checkpoint import store  # when run (module docstring)

        if store.exists(target, "output directory"):
            raise ConfigError(f"output directory {target} exists; choose a new one")
        store.writable(target, "output directory")
        local = store.stage(target, 0) / "consolidated"
        shutil.rmtree(local, ignore_errors=True)
    if lora:
        from plait.checkpoint.lora_export import consolidate_lora  # when run (module docstring)

        out = consolidate_lora(ns.checkpoint_dir, local or target, lora, format=ns.format, dtype=ns.dtype,
                               max_shard_size=ns.max_shard_size)
        loader = "peft.PeftModel.from_pretrained(base, {!r})" if lora == "adapter" else \
            f"transformers.{auto_class(out)}.from_pretrained({{!r}})"
    else:
        shard = {} if ns.max_shard_size is None else {"max_shard_size": ns.max_shard_size}
        out = consolidate(ns.checkpoint_dir, local or target, format=ns.format, dtype=ns.dtype, **shard)
        loader = f"transformers.{auto_class(out)}.from_pretrained({{!r}})"
    if local is not None:
        store.upload_tree(out, target)
        shutil.rmtree(local, ignore_errors=True)
    how = loader.format(target) + (" on a local copy" if local is not None else "")
    if lora and ns.lora is None:
        print(f"{ns.checkpoint_dir} is a LoRA checkpoint: wrote its adapters as a peft directory, {target}: load it "
              f"with {how}; for one model with the adapters merged into the base, run "
              f"`plait consolidate {ns.checkpoint_dir} NEW_DIR --lora merged`")
    else:
        print(f"wrote {target}: load it with {how}")


def auto_class(directory: str | os.PathLike) -> str:
    """The Auto class that loads the consolidated ``directory``: an image-text-to-text model's, or a causal LM's."""
    from transformers import AutoConfig  # when run (module docstring)

    from plait.base.meta import model_class

    return model_class(AutoConfig.from_pretrained(directory)).__name__


def cmd_check_adapter(ns: argparse.Namespace) -> None:
    from plait.testing.conformance import check_adapter_command  # when run (module docstring)

    sys.exit(check_adapter_command(ns.name, ns.modes, ns.dtype))


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (a value of the wrong type or not among the choices, an unknown flag or
    command) are the one ``plait: error:`` line every failure ends in, exit status 2; argparse printed the whole
    usage above its message (74 lines for plait train). Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"plait: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="plait", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=None,
                       help=f"on a failure, print the traceback above its one-line error (or set {DEBUG_ENV}=1)")
    common = [debug]  # every subcommand's parents
    train = sub.add_parser("train", parents=common, help="train a transformers causal LM under any layout")
    add_arguments(train, TrainArgs)
    train.set_defaults(func=cmd_train)

    plan = sub.add_parser("plan", parents=common,
                          help="how a model would be split, what each rank holds and sends, which layout "
                                       "is fastest (plait train's flags), without its weights")
    add_arguments(plan, TrainArgs)
    plan.add_argument("--world_size", type=int, default=None,
                      help="processes of the run (default: --nproc_per_node, at least tp * pp)")
    plan.add_argument("--device_memory", default=None, help="memory per device the layout's tensors may take: 80GB, "
                      "78GiB, 512MiB, or a number of GiB (default: the --hardware preset's memory less its reserve "
                      "for the runtime's context, communication buffers and fragmentation)")
    plan.add_argument("--hardware", type=str.lower, choices=sorted(PRESETS), default=None,
                      help="device model for step times (any case)")
    plan.add_argument("--calibrate", action="store_true", help="device model measured on this machine (cached)")
    plan.add_argument("--recalibrate", action="store_true", help="measure again, replacing the cached calibration")
    plan.add_argument("--search", action="store_true", help="rank every layout of the world that fits, each with "
                      "the micro-batch size and accumulation steps that split the global batch best")
    plan.add_argument("--global_batch_size", type=int, default=None, help="--search: sequences per optimizer step "
                      "(default: --per_device_train_batch_size x dp x --gradient_accumulation_steps as given)")
    plan.add_argument("--images_per_sample", type=int, default=0,
                      help="an image-text-to-text model's images a training row: its vision tower's activations and "
                           "FLOPs, traced on one image its processor prepares, join the estimate (default: 0, text)")
    plan.add_argument("--top", type=int, default=5, help="layouts --search prints (default: 5)")
    plan.add_argument("--show_refused", action="store_true",
                      help="--search: list every refused layout with its reason (default: a summary by reason)")
    plan.add_argument("--moe_imbalance", type=float, default=1.0, help="MoE under ep: the busiest rank's routed "
                      "(token, expert) pairs over its even share, sizing its expert activations and FLOPs "
                      "(default: 1, balanced routing)")
    plan.add_argument("--json", action="store_true", help="print JSON for tools")
    plan.add_argument("--show-derived", metavar="ARCH", default=None,
                      help="print the plans plait-transformers derives for ARCH (a model_type, a config.json or a "
                           "model directory) as the code of an explicit adapter to start from")
    plan.set_defaults(func=cmd_plan)

    cons = sub.add_parser("consolidate", parents=common, help="write a checkpoint as one Hugging Face model dir")
    cons.add_argument("checkpoint_dir", help="a checkpoint-N dir (or its shard folder)")
    cons.add_argument("output_dir", help="new (or empty) directory for config.json, weights, tokenizer")
    cons.add_argument("--format", choices=("safetensors", "pytorch"), default="safetensors",
                      help="weight files: safetensors, or pytorch (torch.save .bin files); LoRA adapters too")
    cons.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="cast floating tensors (default: as saved; --lora merged: float32, the merge's precision); "
                      "float32 of a --bf16 checkpoint writes its fp32 master weights")
    cons.add_argument("--max_shard_size", default=None, help="split weights into files of at most this size, e.g. "
                      "500MB (default: 5GB); not with --lora adapter, whose peft file is never split")
    cons.add_argument("--lora", choices=("merged", "adapter"), default=None,
                      help="a LoRA checkpoint: the base with the adapters merged in, or a peft adapter dir "
                           "(default for a LoRA checkpoint: adapter)")
    cons.set_defaults(func=cmd_consolidate)

    from plait.testing.conformance_modes import modes_help

    check = sub.add_parser("check-adapter", parents=common,
                           help="prove an adapter matches one process under every parallel mode",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="modes (each trains 3 AdamW steps against one process):\n" + modes_help()
                           + "\n\nA mode the adapter does not declare, or its tiny config cannot express, is skipped "
                             "with the reason; exit status 1 when a mode that ran failed.")
    check.add_argument("name", help="an installed adapter (see `plait adapters`) or an importable module of hooks")
    check.add_argument("--modes", nargs="+", metavar="MODE", help="only these modes (default: all)")
    check.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                       help="float64 tells a mis-split layer from fp32 noise that Adam amplified by step 2-3")
    check.set_defaults(func=cmd_check_adapter)

    add_prepare_data_parser(sub, common)  # plait prepare-data: tokenize into the cache first
    add_generate_parser(sub, common)  # plait generate: completions from a model's shards

    adapters = sub.add_parser("adapters", parents=common, help="list installed architecture adapters")
    adapters.add_argument("--json", action="store_true", help="print a JSON list")
    adapters.add_argument("--architectures", action="store_true",
                          help="list every causal-LM architecture of the installed transformers with the adapter "
                               "serving it and why (explicit adapters take precedence over the generic one)")
    adapters.set_defaults(func=cmd_adapters)
    return parser


DEBUG_ENV = "PLAIT_DEBUG"  # =1: a failure also prints its traceback, as --debug does


def one_line(err: BaseException) -> str:
    """The error as one line: plait's own errors are written to be read as they are; anything else (a fault
    inside torch, the OS, a library) is named by its type and its first line of text."""
    if isinstance(err, (ConfigError, AdapterError, TrainingDiverged, FaultError)):
        text = str(err)
    else:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        text = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return " ".join(text.split())


def end_process_group(fault: bool, status: int = 1) -> None:
    """Leave torch.distributed's world, if this process joined one. After a run, or an error every rank met
    alike, tear it down: a live process group's threads destroyed in static destructors can abort the process
    ("terminate called without an active exception"). After a fault a peer may be stopped or gone, and the
    teardown can wait on it for half a minute: the error is said, so end the process at once."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if fault:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    dist.destroy_process_group()


def fail(err: BaseException, status: int, debug: bool) -> NoReturn:
    """End the command with ``err`` as one ``plait: error:`` line (said once per job: ``report_error``)."""
    if debug:
        traceback.print_exception(err)
    hint = "" if debug or status != 1 else f" (--debug or {DEBUG_ENV}=1 prints the traceback)"
    report_error(f"plait: error: {one_line(err)}{hint}")
    end_process_group(fault=status == 1, status=status)
    sys.exit(status)


def main(argv: list[str] | None = None) -> None:
    """Run one ``plait`` command. Every failure ends as one ``plait: error:`` line on stderr and an exit status:
    2 for input to fix (a flag, a file, a layout), 3 for a run that diverged, 1 for a fault (a crash, a stuck or
    dead rank, a full disk); the traceback only with ``--debug`` (or PLAIT_DEBUG=1)."""
    ns = build_parser().parse_args(argv)
    ns.argv = list(argv) if argv is not None else sys.argv[1:]
    debug = getattr(ns, "debug", False) or os.environ.get(DEBUG_ENV) == "1"
    try:
        with flag_words():  # refusals name this command's flags, not ParallelConfig's fields (plait.base.words)
            ns.func(ns)
    except (ConfigError, AdapterError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:
        fail(err, 2, debug)
    except TrainingDiverged as err:
        fail(err, 3, debug)
    except StopRequested as stop:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"plait: {stop}", file=sys.stderr)
        end_process_group(fault=False)  # every rank stopped at the same step, together
        # Under torchrun, a worker that stopped as asked exits 0 so torchrun reports no crash; whoever sent
        # the signal (plait's launcher, a scheduler) knows. A run of its own exits as a signalled process does.
        sys.exit(0 if "TORCHELASTIC_RUN_ID" in os.environ else stop.exit_status)
    except Exception as err:  # a fault: still one line, the traceback on request
        fail(err, 1, debug)
