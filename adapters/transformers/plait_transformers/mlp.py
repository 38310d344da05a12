"""What the tensor-parallel rules read of an MLP: a gated one (``down(act(gate(x)) * up(x))``, with or without an
RMSNorm over the product before ``down``), one written on the decoder layer itself (``x = fc2(act(fc1(x)))``), a
fused gate | up projection split in matching halves, and activation functions with scalar parameters. Each says
which projections are column- and which row-parallel, or which replicated parameters see split activations and
still get an exact gradient summed over tp.
"""

from __future__ import annotations

import inspect
import re

from torch import nn
from transformers.activations import ACT2CLS

from plait.tp.sharding import linear_shape
from plait.tp.styles import FusedColumn, TPRule

from plait_transformers.common import GATHERED, is_linear, out_features, own_params, refuse


def direct_mlp(layer: nn.Module) -> tuple[str, str] | None:
    """(first, second) of an MLP written on the decoder layer itself (XGLM, TrOCR, BioGPT: ``fc1`` and ``fc2``), where
    the layer's forward runs ``x = second(act(first(x)))`` on its hidden states, with only parameter-free
    activations and dropout between: the first column-, the second row-parallel, as a block of its own would be. The
    hidden states may be flattened to [tokens, hidden] first (OPT: ``reshape(-1, hidden_states.size(-1))``): the
    sequence all-gather and reduce-scatter work on the second-to-last dimension, the tokens, and every op between
    them is token by token. A forward that reshapes anything else before them, or does anything else between them,
    gets None."""
    lines = [line.strip() for line in inspect.getsource(type(layer).forward).splitlines()]
    linears = {n: m for n, m in layer.named_children() if isinstance(m, nn.Linear)}
    free = {n for n, m in layer.named_children() if not any(True for _ in m.parameters())}
    for first, up in linears.items():
        for second, down in linears.items():
            if up.out_features != down.in_features or up.in_features != down.out_features or first == second:
                continue
            start = next((i for i, line in enumerate(lines) if f"self.{first}(" in line), None)
            end = next((i for i, line in enumerate(lines) if f"self.{second}(" in line), None)
            if start is None or end is None or end < start:
                continue
            between = lines[start:end + 1]
            if _reshapes_tokens_only(lines[:start]) and all(_elementwise(line, first, second, free) for line in between):
                return first, second
    return None


def _reshapes_tokens_only(lines: list[str]) -> bool:
    """Whether every reshape in ``lines`` (a layer's forward up to its MLP) keeps the last dimension and flattens the
    rest into tokens (``x = x.reshape(-1, x.size(-1))``) or no reshape is there."""
    token = r"\w+ = (\w+)\.(?:reshape|view)\(-1, \1\.(?:size\(-1\)|shape\[-1\])\)"
    return all(re.fullmatch(token, line) for line in lines if re.search(r"\.(reshape|view|flatten)\(", line))


def _elementwise(line: str, first: str, second: str, free: set[str]) -> bool:
    """Whether a line between the two linears of a direct MLP is ``x = op(x)``: one of them, a parameter-free child
    (the activation) or dropout, or the activation of the first (``x = self.act(self.fc1(x))``); blank or comment."""
    if not line or line.startswith("#"):
        return True
    ops = rf"(?:self\.(?:{'|'.join(map(re.escape, {first, second} | free))})|nn\.functional\.dropout|F\.dropout)"
    return re.fullmatch(rf"(\w+) = {ops}\((?:{ops}\()?\1(?:, [^()]*)?\)?\)", line) is not None


def gated_mlp(block: nn.Module) -> tuple[str, str, str] | None:
    """(gate, up, down) of a gated MLP whose forward is ``down(act(gate(x)) * up(x))`` over three Linear children
    and nothing else with parameters (AFMoE's dense layers; LFM2-MoE's ``w2(F.silu(w1(x)) * w3(x))``), or with an
    RMSNorm over the product before ``down`` (BitNet's ``ffn_sub_norm``, ``mlp_sub_norm`` names it), else None."""
    found = re.search(r"self\.(\w+)\(\s*(?:self\.\w+\(\s*)?"  # down, and a norm around the product if any
                      r"[\w.]+\(self\.(\w+)\((\w+)\)\)\s*\*\s*self\.(\w+)\(\3\)\s*\)",
                      inspect.getsource(type(block).forward))
    if found is None:
        return None
    down, gate, _, up = found.groups()
    names = (gate, up, down)
    with_params = {n for n, m in block.named_modules() if own_params(m)}
    norm = (mlp_sub_norm(block) or (None,))[0]
    if with_params - {norm} != set(names) or not all(isinstance(block._modules.get(n), nn.Linear) for n in names):
        return None
    return names


def mlp_sub_norm(block: nn.Module) -> tuple[str, str] | None:
    """(norm, down) of a gated MLP normalising ``act(gate(x)) * up(x)`` right before its down projection
    (``down(norm(act(gate(x)) * up(x)))``) where the norm is a split RMSNorm (``split_sub_norm``), else None."""
    found = re.search(r"self\.(\w+)\(\s*self\.(\w+)\(\s*[\w.]+\(self\.\w+\(\w+\)\)\s*\*",
                      inspect.getsource(type(block).forward))
    return (found.group(2), found.group(1)) if found and split_sub_norm(block, found.group(2), found.group(1)) else None


def split_sub_norm(block: nn.Module, child: str, consumer: str) -> bool:
    """Whether ``child`` is an RMSNorm (``weight * x * rsqrt(mean(x^2) + eps)``, one weight as wide as the
    features) whose output goes straight into the row-parallel ``consumer`` (BitNet's ``attn_sub_norm`` before
    ``o_proj``, ``ffn_sub_norm`` before ``down_proj``): its features are split over tp, so it is split with them
    and its sum of squares all-reduced (SplitNorm), which is exact."""
    module, target = block._modules.get(child), block._modules.get(consumer)
    if module is None or not is_linear(target) or "RMSNorm" not in type(module).__name__:
        return False
    params = dict(module.named_parameters())
    if set(params) != {"weight"} or tuple(params["weight"].shape) != (linear_shape(target)[0],):
        return False
    norm = inspect.getsource(type(module).forward)
    if "rsqrt(" not in norm or "return self.weight * " not in norm:
        return False
    source = inspect.getsource(type(block).forward)
    chained = rf"self\.{consumer}\(\s*self\.{child}\("
    stepwise = rf"(\w+) = self\.{child}\(\1\)[^\n]*\n\s*\w+ = self\.{consumer}\(\1\)"
    return re.search(chained, source) is not None or re.search(stepwise, source) is not None


def is_scalar_activation(block: nn.Module, child: str, columns: list[str]) -> bool:
    """Whether ``child`` is one of transformers' activation functions (elementwise) whose parameters are single
    numbers (Apertus' xIELU ``alpha_p``, ``alpha_n``: shape [1], broadcast over every feature), applied by the
    block's forward directly to a column-parallel projection's output. Each rank then computes their gradient over
    its own slice of the features only, and the sum over tp is exact (ReplicatedGradSum). A per-feature
    parameter, or one applied elsewhere (to the block's unsplit input), is not this case."""
    module = block.get_submodule(child)
    activations = {c[0] if isinstance(c, tuple) else c for c in ACT2CLS.values()}
    if "." in child or type(module) not in activations or any(p.numel() != 1 for p in module.parameters()):
        return False
    source = inspect.getsource(type(block).forward)
    return any(re.search(rf"self\.{child}\(\s*self\.{column}\(", source) for column in columns)


def fused_column(arch: str, name: str, block: nn.Module, child: str, styles: dict[str, str]) -> TPRule:
    """A column-parallel projection transformers gathers because its output is two projections side by side
    (``gate_up_proj``: gate | up, chunked in two and multiplied): each rank keeps matching halves (FusedColumn).
    Anything else gathered is refused: plait cannot tell which full-width op follows it."""
    rows = [c for c, style in styles.items() if GATHERED.get(style, style) == "rowwise"]
    fan_in = linear_shape(block.get_submodule(rows[0]))[0] if len(rows) == 1 else None
    source = inspect.getsource(type(block).forward)
    halves = "gate_up" in child and ".chunk(2" in source or viewed_in_halves(source, child)
    if halves and out_features(block.get_submodule(child)) == 2 * (fan_in or -1):
        return FusedColumn(name, chunks=2)
    raise refuse(arch, name, "transformers gathers this projection's output (colwise_gather_output) for an op over "
                             "the full width that plait does not know; it has no real split for it")


def viewed_in_halves(source: str, child: str) -> bool:
    """Whether a forward views ``child``'s output as two halves, gate and up, and multiplies them (Moshi's gating
    MLP: ``x = self.fc1(x)``, ``x.view(batch_size, sequence_length, 2, -1)``,
    ``self.activation_fn(x[..., 0, :]) * x[..., 1, :]``): a FusedColumn's matching slices of each half."""
    read = re.search(rf"(\w+) = self\.{child}\(\w+\)", source)
    if read is None:
        return False
    x = read.group(1)
    return f"{x} = {x}.view(batch_size, sequence_length, 2, -1)" in source and \
        re.search(rf"{x} = self\.\w+\({x}\[\.\.\., 0, :\]\) \* {x}\[\.\.\., 1, :\]", source) is not None
