"""Tables for humans and JSON for tools, from ``LayoutEstimate`` and ``SearchResult`` values.

JSON schema (``plait plan --json``): {"layout": {...ParallelConfig...}, "world_size", "batch": {"per_device",
"seq", "accumulation"}, "ranks": [{"rank", "tp_rank", "pp_rank", "dp_rank", "cp_rank", "parameters", "gradients",
"optimizer", "activations_per_microbatch", "in_flight_microbatches", "activations_in_flight", "transient",
"peak", "peak_at" ("forward's end" or "backward's end"), "at_peak" (what lives then: {"parameters", "gradients",
"optimizer", "gathered", "second_model", "activations", "transient"}, summing to "peak"), "checkpoint_bytes"}],
"peak", "device_memory" (or null), "usable_memory" (device_memory less the device model's reserve), "fits" (or
null), "communication": [{"pp_rank", "group", "op", "count", "bytes"}], "bubble",
"flops_per_step": {pp_rank: FLOPs}, "step_seconds" (or null), "notes",
"cp_attention" (the strategy for the block size under cp, or null)}. Group "dp" is the replica group: dp x cp
ranks under context parallelism; under expert parallelism "ep" is the experts' all-to-alls and "edp" the expert
gradients' group (the dp x cp / ep ranks holding the same experts).
``--search --json``: {"device": {...}, "usable_memory", "ranked": [{"layout", "micro_batch", "accumulation",
"step_seconds", "peak", "bubble", "mfu", "command"}], "more_devices" and "cheaper_settings" (where nothing fits:
[{"change", "layout", "peak", "step_seconds", "strategy"}]),
"refused": [{"layout", "reason"}], "command"} (the ``plait train`` command of the fastest).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from plait.costs.device import Device
from plait.costs.estimate import LayoutEstimate, RankEstimate
from plait.costs.advice import WORLD_FACTORS, Fit, describe_fit, strategy
from plait.costs.search import SearchResult, batch_split, describe


def gib(n: float) -> str:
    if n < 2**20:
        return f"{n:,.0f} B"
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def estimate_json(estimate: LayoutEstimate, device: Device | None, memory: int | None) -> dict:
    """``memory``: bytes per device to check the peak against (None: no check); ``device``: for the step time."""
    config = estimate.plan.config
    usable = device.usable_bytes if device is not None else memory  # a device model keeps its runtime reserve
    ranks = [{"rank": r.rank, "tp_rank": r.tp_rank, "pp_rank": r.pp_rank, "dp_rank": r.dp_rank, "cp_rank": r.cp_rank,
              "parameters": r.static.parameters, "gradients": r.static.gradients, "optimizer": r.static.optimizer,
              "second_model": r.second,
              "activations_per_microbatch": r.activations.per_microbatch,
              "in_flight_microbatches": r.activations.in_flight_microbatches,
              "activations_in_flight": r.activations.in_flight, "transient": r.transient,
              "peak": sum(live.values()), "peak_at": when, "at_peak": live,
              "checkpoint_bytes": checkpoint_bytes(r)} for r in estimate.ranks for when, live in [r.at_peak()]]
    layout = dataclasses.asdict(config)
    layout["pipeline_cuts"] = list(config.pipeline_cuts)
    return {
        "layout": layout, "world_size": config.processes,
        "batch": dataclasses.asdict(estimate.batch), "ranks": ranks, "peak": estimate.peak,
        "device_memory": memory, "usable_memory": usable, "fits": estimate.peak <= usable if usable else None,
        "communication": [{"pp_rank": pp_rank, "group": op.group, "op": op.op, "count": op.count, "bytes": op.bytes}
                          for pp_rank, ops in estimate.comm.items() for op in ops],
        "bubble": estimate.bubble, "flops_per_step": {str(k): v for k, v in estimate.flops.items()},
        "step_seconds": estimate.step_time(device) if device else None, "notes": estimate.notes,
        "cp_attention": estimate.plan.cp.strategy_for(estimate.batch.seq) if estimate.plan.cp else None,
    }


def checkpoint_bytes(rank: RankEstimate) -> int:
    """The most a rank writes into a checkpoint, its parameters and optimizer state as it holds them: what
    ``--save_async`` copies to host memory per save (a tensor several ranks hold is written by one of them)."""
    return rank.static.parameters + rank.static.optimizer


def async_save_note(estimate: LayoutEstimate) -> str:
    """``plait plan --save_async``'s line: the host memory a save holds while its files are written."""
    most = max(checkpoint_bytes(r) for r in estimate.ranks)
    return (f"--save_async: each save copies up to {gib(most)} per rank to host memory (the parameters and "
            f"optimizer state it writes), held until its files are written")


def print_estimate(console: Console, estimate: LayoutEstimate, device: Device | None, memory: int | None) -> None:
    """Memory per rank (ranks with equal numbers folded into one row), communication per pipeline rank, the
    bubble and, with a device, the fit and step time."""
    config = estimate.plan.config
    b = estimate.batch
    examples = f"{b.per_device} sequences" if b.rows_per_example == 1 else \
        f"{b.per_device} examples of {b.rows_per_example} sequences"
    console.print(f"batch per data-parallel rank: {examples} x {b.seq} tokens x {b.accumulation} "
                  f"accumulation steps (--per_device_train_batch_size, --block_size, --gradient_accumulation_steps)")
    rows: dict[tuple, list[int]] = defaultdict(list)
    for r in estimate.ranks:
        a, (when, live) = r.activations, r.at_peak()
        key = (r.static.parameters, r.static.gradients, r.static.optimizer, r.second, a.per_microbatch,
               a.in_flight_microbatches, a.in_flight, r.transient, sum(live.values()), when)
        rows[key].append(r.rank)
    second = any(r.second for r in estimate.ranks)  # a column only where the training method has a second model
    table = Table("ranks", "parameters", "gradients", "optimizer", *(["second model"] if second else []),
                  "activations / micro-batch", "in flight", "activations", "transient", "peak", "peak at",
                  title=f"memory per rank ({config.describe()})",
                  caption="the peak is at the forward's end (activations; gradients only where an earlier micro-step "
                          "or main_grad keeps them) or at the backward's end (gradients, activations freed)")
    for (params, grads, optim, frozen, per_mb, flight, acts, transient, peak, when), ranks in rows.items():
        mark = "" if memory is None or peak <= memory else " [red](does not fit)[/]"
        table.add_row(_ranks(ranks), gib(params), gib(grads), gib(optim), *([gib(frozen)] if second else []),
                      gib(per_mb), f"{flight:g}", gib(acts), gib(transient), gib(peak) + mark, when)
    console.print(table)
    comm = Table("pp rank", "group", "op", "count", "bytes", title="communication per optimizer step (one rank)",
                 caption="bytes: what this rank hands the collective, summed over its calls (an all_gather's output "
                         "is group size times that; a ring all_reduce sends about 2(n-1)/n of it per rank)")
    for pp_rank, ops in estimate.comm.items():
        for op in ops:
            replicas = "dp×cp" if config.cp > 1 else "dp"
            group = {"dp": replicas, "edp": f"{replicas}/ep"}.get(op.group, op.group)
            comm.add_row(str(pp_rank), group, op.op, f"{op.count:,}", gib(op.bytes))
    console.print(comm)
    if config.pp > 1:
        console.print(f"pipeline bubble ({config.pipeline_schedule}, p={config.pp}, m={config.num_microbatches}, "
                      f"v={config.virtual_pipeline_size}): {estimate.bubble:.3f} of a step idle")
    for note in estimate.notes:
        console.print(note)
    if device is not None:
        fits = estimate.peak <= device.usable_bytes
        console.print(f"peak {gib(estimate.peak)} of {device.describe_memory()}: "
                      + ("fits" if fits else "[red]does not fit[/]: see plait plan --search"))
    elif memory is not None:
        fits = estimate.peak <= memory
        console.print(f"peak {gib(estimate.peak)} of {gib(memory)} per device (no reserve for the runtime without "
                      f"a device model: --hardware): " + ("fits" if fits else "[red]does not fit[/]: see plait plan "
                                                                            "--search"))
    if device is not None:
        seconds = estimate.step_time(device)
        b = estimate.batch
        tokens = b.rows * b.seq * b.accumulation * (config.dp or 1) / config.processes
        console.print(f"estimated step on {device.name}: {seconds:.4g} s, {tokens / seconds:,.0f} tokens/s/device, "
                      f"MFU {estimate.mfu(device, seconds):.1%} at {device.describe_efficiency()}")


def search_json(result: SearchResult, device: Device, commands: list[str], top: int,
                advice: tuple[list[Fit], list[Fit]] | None = None) -> dict:
    more, cheaper = advice or ([], [])
    return {
        "more_devices": [describe_fit(fit, describe) for fit in more],
        "cheaper_settings": [describe_fit(fit, describe) for fit in cheaper],
        "device": dataclasses.asdict(device),
        "usable_memory": device.usable_bytes,
        "ranked": [{"layout": describe(e.plan.config), "micro_batch": e.batch.per_device,
                    "accumulation": e.batch.accumulation, "step_seconds": s, "peak": e.peak, "bubble": e.bubble,
                    "mfu": e.mfu(device, s), "command": c} for (e, s), c in zip(result.ranked[:top], commands)],
        "refused": [{"layout": label, "reason": reason} for label, reason in result.refused],
        "command": commands[0] if commands else None,
    }


def print_search(console: Console, result: SearchResult, device: Device, commands: list[str], top: int,
                 show_refused: bool = False, advice: tuple[list[Fit], list[Fit]] | None = None) -> None:
    table = Table("#", "layout", "micro-batch", "step (s)", "peak", "bubble", "tokens/s/device", "MFU",
                  title=f"fastest layouts on {device.name} ({len(result.ranked)} fit, {len(result.refused)} refused)",
                  caption=f"memory: {device.describe_memory()}; MFU: the model's FLOPs (recomputation not counted) "
                          f"over the device's peak, at {device.describe_efficiency()}")
    for i, (estimate, seconds) in enumerate(result.ranked[:top], 1):
        b = estimate.batch
        tokens = b.rows * b.seq * b.accumulation * (estimate.plan.config.dp or 1)
        world = estimate.plan.config.processes
        table.add_row(str(i), describe(estimate.plan.config), batch_split(b), f"{seconds:.4g}", gib(estimate.peak),
                      f"{estimate.bubble:.3f}", f"{tokens / seconds / world:,.0f}",
                      f"{estimate.mfu(device, seconds):.1%}")
    console.print(table)
    if result.refused:
        console.print(refused_table(result.refused, every=show_refused))
    if commands:
        console.print(f"[bold]best:[/] {commands[0]}")
        return
    console.print("[red]no layout fits[/]: see the refusals above")
    more, cheaper = advice or ([], [])
    if more or cheaper:
        table = Table("what changes", "strategy", "best layout", "peak", "step (s)", title="what would fit")
        for fit in [*more, *cheaper]:
            table.add_row(fit.change, strategy(fit.layout), describe(fit.layout.plan.config), gib(fit.layout.peak),
                          f"{fit.seconds:.4g}")
        console.print(table)
    else:
        console.print(f"nothing fits up to {WORLD_FACTORS[-1]} times as many devices, nor with bf16 or LoRA")


def refused_table(refused: list[tuple[str, str]], every: bool = False) -> Table:
    """The refused layouts: with ``every``, one row each with its own reason; by default one row per kind of
    reason (the reason with its numbers left out: "does not fit: peak # GiB > # GiB per device"), with how many
    layouts it refused, one of them, and its reason in full (the range of the numbers where they vary)."""
    if every:
        table = Table("layout", "reason", title=f"refused ({len(refused)} layouts)")
        for label, reason in refused:
            table.add_row(label, reason)
        return table
    groups: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for label, reason in refused:
        groups[re.sub(r"\d+(?:\.\d+)?", "#", reason)].append((label, reason))
    table = Table("layouts", "for example", "reason", title=f"refused ({len(refused)} layouts, by reason; "
                                                               f"--show_refused lists each)")
    for template, rows in sorted(groups.items(), key=lambda item: -len(item[1])):
        table.add_row(str(len(rows)), rows[0][0], _number_ranges(template, [reason for _, reason in rows]))
    return table


def _number_ranges(template: str, reasons: list[str]) -> str:
    """``template`` with each "#" replaced by the number the reasons share there, or their range."""
    columns = list(zip(*(re.findall(r"\d+(?:\.\d+)?", reason) for reason in reasons)))
    parts = template.split("#")
    out = parts[0]
    for column, tail in zip(columns, parts[1:]):
        values = sorted(set(column), key=float)
        out += values[0] if len(values) == 1 else f"{values[0]}-{values[-1]}"
        out += tail
    return out


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]},... ({len(ranks)} ranks)"
