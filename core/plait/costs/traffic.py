"""Memory traffic of a step's operations other than matmuls, counted on the meta device.

Beyond its matmul FLOPs a step's time goes mostly to elementwise work: norms, activation functions, residual adds,
dropout, attention's softmax and masking, the loss's log-softmax. Each such operation reads its inputs and writes
its output whole, so its cost is bytes over the memory bandwidth. A GPT-2 spends much more of it than a Llama of the
same matmul FLOPs (tanh GELU in eight operations, three dropouts a layer; on this CPU 0.26 s a step besides the
matmuls against the Llama's 0.12 s), which a count of saved activations does not see.

``TrafficCounter`` runs with the activation trace's forward (``trace_activations``) and adds, per pipeline unit,
the bytes of every operation's tensor inputs and outputs (views and matmuls aside; parameters aside: an embedding
reads rows of its table, a norm's weight is small), sorted by how tensor parallelism divides them as ``Saved``
tensors are: hidden-sized (whole on every tp rank outside the sequence-parallel region), attention's s x s scores
(split with the heads; never materialised by a fused kernel) and the rest (split by tp in a decoder layer).
Each operation's bytes take the time its measured speed gives (``Device.bandwidth``): a CPU computes random numbers
and transcendental functions far below its memory bandwidth (GPT-2's dropouts and tanh GELU), a GPU runs them at its
bandwidth. The backward's elementwise traffic, in plain arithmetic (tanh's backward is multiplies), is ``BACKWARD``
times the forward's: 1.35, 1.50 and 1.66 counted the same way on meta for bench/plan_check.py's GPT-2, Llama and
Qwen3. It is not traced per plan: that would run every architecture's backward on the meta device as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

BACKWARD = 1.5
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm"})
DROPOUTS = frozenset({"bernoulli", "bernoulli_", "native_dropout"})
# Operations a CPU runs far below its memory bandwidth (random numbers, transcendental functions), each timed on a
# tensor by ``machine.measure_machine`` (and ``measure_accelerator``): ``Device.op_bandwidth``. On this VM's CPU,
# one thread, bytes read and written per second: a copy 23 GB/s, tanh 2.4, softmax 6.2, bernoulli 1.1. Names that
# run one kernel share its function (``_safe_softmax``, the softmax of a fully masked row as 0, is softmax's), which
# is timed once.
_softmax = lambda x: torch.softmax(x, -1)  # noqa: E731
TIMED_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bernoulli_": lambda x: x.bernoulli_(0.9),
    "tanh": torch.tanh,
    "exp": torch.exp,
    "rsqrt": torch.rsqrt,
    "silu": F.silu,
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
    "_softmax": _softmax,
    "_safe_softmax": _softmax,
    "_log_softmax": lambda x: torch.log_softmax(x, -1),
    "native_layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
}
PLAIN = ""  # every other operation: at the memory bandwidth


@dataclass
class Traffic:
    """Forward bytes of one sequence's non-matmul operations in one unit, by operation (``TIMED_OPS``, or
    ``PLAIN``) and by how tp divides them (``"hidden"``, ``"square"``, ``"other"``)."""

    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, op: str, kind: str, nbytes: int) -> None:
        self.bytes[op, kind] = self.bytes.get((op, kind), 0) + nbytes

    def per_rank(self, tp: int, sp: bool, split_others: bool, cp: int = 1, squares: bool = True,
                 forwards: float = 1.0) -> dict[str, float]:
        """Bytes by operation on one rank for ``forwards`` forwards (2 when recomputed) and one backward, which
        moves ``BACKWARD`` times the forward's bytes in plain operations (``sp``, ``split_others``: as
        ``activations.unit_bytes``; ``squares``: attention's scores are materialised, by eager attention or
        torch's math path)."""
        out: dict[str, float] = {}
        for (op, kind), nbytes in self.bytes.items():
            if kind == "square" and not squares:
                continue
            divisor = (tp if sp else 1) if kind == "hidden" else (tp if split_others else 1)
            forward = nbytes / divisor / cp
            out[op] = out.get(op, 0.0) + forward * forwards
            out[PLAIN] = out.get(PLAIN, 0.0) + forward * BACKWARD
        return out


def add_bytes(total: dict[str, float], more: dict[str, float]) -> None:
    """Add ``more`` (bytes by operation) to ``total``, in place."""
    for op, nbytes in more.items():
        total[op] = total.get(op, 0.0) + nbytes


class TrafficCounter(TorchDispatchMode):
    """Adds each operation's bytes to the ``Traffic`` of the unit ``where["unit"]`` names (``units``); notes
    whether dropout ran on s x s scores (``square_dropout``: attention dropout, which torch's fused CPU kernel
    does not take)."""

    def __init__(self, units: dict, where: dict, seq: int, hidden: int, params: set[int]) -> None:
        super().__init__()
        self.units, self.where, self.seq, self.hidden, self.params = units, where, seq, hidden, params
        self.square_dropout = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.is_view or name in MATMULS or name in ("detach", "lift_fresh", "_unsafe_view"):
            return out
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        inputs = [t for t in (*args, *(kwargs or {}).values())
                  if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.params]
        if not outputs:
            return out
        tensors = outputs + inputs
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        op = name if name in TIMED_OPS else PLAIN
        traffic = self.units[self.where["unit"]].traffic
        if any(is_square(t, self.seq) for t in tensors):
            traffic.add(op, "square", nbytes)
            self.square_dropout |= name in DROPOUTS
        elif outputs[0].dim() > 0 and outputs[0].shape[-1] == self.hidden:
            traffic.add(op, "hidden", nbytes)
        else:
            traffic.add(op, "other", nbytes)
        return out


def is_square(tensor: torch.Tensor, seq: int) -> bool:
    """Attention's scores of the traced sequence (batch 1): [1, heads, s, s], or [heads, s, s] where sdpa's math
    path folds batch and heads for its bmm (a GPT-2's dropped-out probabilities: 12 GiB of a 0.76B model's step
    at 8 x 1024 tokens, counted as kept until this was seen on an H200). Not [1, s, h] hidden states where h = s."""
    return tuple(tensor.shape[-2:]) == (seq, seq) and (tensor.dim() == 4 or (tensor.dim() == 3 and tensor.shape[0] > 1))

