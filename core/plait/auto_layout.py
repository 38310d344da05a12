"""``plait train --layout auto``: the layout ``plait plan --search`` ranks first, chosen for this very run.

The launching process plans once, before any worker starts: the run's model (on the meta device), its global
batch (``--per_device_train_batch_size`` x processes x ``--gradient_accumulation_steps`` as written, the same
sequences whatever split wins), its block size and LoRA settings, ``--nproc_per_node`` processes, and the device
found here (an H100, H200 or A100 by name, with the memory the driver reports; otherwise this machine, its
accelerator or its CPU, measured once by ``--calibrate``'s routine). It prints the top 3 with their numbers and why
the first won, and hands the workers its flags, so every rank runs the one layout chosen.
"""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.table import Table

from plait.base.config import ConfigError, ParallelConfig
from plait.base.device import describe_accelerator
from plait.costs.calibration import calibrate, on_node
from plait.costs.device import GiB, Device, preset_for
from plait.costs.render import gib
from plait.costs.search import batch_split, describe
from plait.plan_command import PlannedRun, layout_flags
from plait.run.train_args import AUTO_LAYOUT_FLAGS, TrainArgs


def detect_device() -> Device:
    """The device model for this machine: a preset by the accelerator's name (its memory as the driver reports
    it), else this machine measured (cached: ``costs.calibration.calibrate``)."""
    found = describe_accelerator()
    preset = preset_for(found[0]) if found is not None else None
    if preset is not None:
        return dataclasses.replace(preset, memory_bytes=found[1])
    return calibrate()


def choose_layout(args: TrainArgs, world: int, device: Device | None = None,
                  console: Console | None = None) -> list[str]:
    """The layout flags of the fastest layout of ``world`` processes that fits (``layout_flags``), after printing
    the top 3 and why the first won; ConfigError where a layout flag was given too, or nothing fits."""
    given = [f"--{name}" for name in args.given(AUTO_LAYOUT_FLAGS)]
    if given:
        raise ConfigError(f"--layout auto chooses {', '.join(given)} itself; drop {'them' if len(given) > 1 else 'it'}"
                          f", or give the layout by hand without --layout auto")
    device = on_node(device or detect_device(), world)  # a CPU's host shared by this run's processes
    console = console or Console(stderr=True)
    result = PlannedRun.of(args, ParallelConfig(), world, device).search(device, world)
    if not result.ranked:
        raise ConfigError(f"--layout auto: no layout of {world} processes fits {device.usable_bytes / GiB:.2f} GiB "
                          f"per device on {device.name}; `plait plan --search` with the same flags says what would")
    top = result.ranked[:3]
    table = Table("#", "layout", "micro-batch", "step (s)", "peak", "MFU",
                  title=f"--layout auto: the fastest of {len(result.ranked)} layouts that fit {world} processes on "
                        f"{device.name} ({device.usable_bytes / GiB:.2f} GiB usable each)")
    for i, (estimate, seconds) in enumerate(top, 1):
        table.add_row(str(i), describe(estimate.plan.config), batch_split(estimate.batch), f"{seconds:.4g}",
                      gib(estimate.peak), f"{estimate.mfu(device, seconds):.1%}")
    console.print(table)
    best, seconds = top[0]
    why = (f"{(top[1][1] / seconds - 1):.1%} faster than #2 by the planner's model" if len(top) > 1
           else "the only layout that fits")
    console.print(f"--layout auto chose #1, {describe(best.plan.config)} {batch_split(best.batch)}: {why}, peak "
                  f"{gib(best.peak)} of {device.usable_bytes / GiB:.2f} GiB")
    return layout_flags(best.plan.config, best.batch.per_device, best.batch.accumulation)
