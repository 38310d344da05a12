"""What the console shows of a step, for a person: the progress bar's text on a terminal, and where there is no
terminal (a log file, a CI job, a pipe) one line per --logging_steps, as Hugging Face's Trainer prints.
metrics.jsonl (plait.run.metrics) stays the record a program reads."""

from __future__ import annotations


def progress_text(record: dict) -> str:
    """What the progress bar shows of a step: its loss, throughput and, for an MoE model, the worst layer's load."""
    text = f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s"
    if "moe_load_max_over_mean" in record:
        text += f" | moe max/mean {record['moe_load_max_over_mean']:.2f}"
    return text


def log_line(record: dict, max_steps: int, seconds_per_step: float) -> str:
    """One readable line of a step's record, e.g. ``step 12/100 | loss 4.1234 | lr 9.0e-04 | grad_norm 0.812 |
    12,345 tok/s | eta 1m02s``, with the evaluation, skipped steps and MoE load where the record has them.
    The time left is ``seconds_per_step`` (the mean so far, evaluations and saves included) per step to go."""
    parts = [f"step {record['step']}/{max_steps}", f"loss {record['loss']:.4f}"]
    if "eval_loss" in record:
        parts.append(f"eval_loss {record['eval_loss']:.4f}")
    if "eval_ppl" in record:  # next-token evaluation (a preference evaluation has rewards instead)
        parts.append(f"eval_ppl {record['eval_ppl']:.2f}")
    parts += [f"lr {record['lr']:.1e}", f"grad_norm {record['grad_norm']:.3f}"]
    if record.get("skipped"):
        parts.append("not applied (non-finite)")
    if "skipped_steps" in record:
        parts.append(f"skipped {record['skipped_steps']}")
    if "moe_load_max_over_mean" in record:
        parts.append(f"moe max/mean {record['moe_load_max_over_mean']:.2f}")
    left = seconds_per_step * (max_steps - record["step"])
    parts += [f"{record['tokens_per_s']:,.0f} tok/s", f"eta {duration(left)}"]
    return " | ".join(parts)


def duration(seconds: float) -> str:
    """``seconds`` as 45s, 1m02s or 3h05m: as short as a glance needs."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
