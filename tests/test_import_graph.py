"""plait's import graph is a one-way stack: no cycle, and each layer imports only the layers below it.

``LAYERS`` is the picture in docs/architecture.md, as data: when a module moves or a new one arrives, this
test says where it stands, so the picture cannot go stale. The graph is grimp's, of plait's own modules;
imports under ``TYPE_CHECKING`` and inside functions count like any other (an annotation that needs a module
above is code in the wrong layer). Importing a module also runs the ``__init__.py`` of each package it is in,
so an import of ``plait.a.b`` from outside ``plait.a`` counts as one of ``plait.a`` too, where that
``__init__.py`` imports anything (the root package is excepted: every module's import starts with it).
"""

from __future__ import annotations

from collections import defaultdict, deque

import grimp

ROOT = "plait"

# Bottom to top. A name stands for a module, or for a package with every module in it that no more specific name
# places elsewhere (plait.lora, but plait.lora.export); the root package stands for plait/__init__.py alone.
LAYERS: list[tuple[str, set[str]]] = [
    ("device", {"plait.device", "plait.host_memory"}),
    ("foundation", {"plait.config", "plait.pipeline_schedules", "plait.comm", "plait.patterns", "plait.markers",
                    "plait.meta", "plait.seeds", "plait.training_forward", "plait.faults"}),
    ("parallel primitives", {"plait.mesh", "plait.tp.mappings", "plait.tp.layers", "plait.tp.loss", "plait.tp.rng",
                             "plait.tp.sharding", "plait.cp.sequence", "plait.cp.masks", "plait.cp.ring",
                             "plait.cp.ulysses"}),
    ("adapter declarations", {"plait.tp.styles", "plait.declarations", "plait.hookspecs"}),
    ("mechanisms", {"plait.registry", "plait.tp", "plait.cp", "plait.ep", "plait.pipeline", "plait.lora", "plait.grad_sync",
                    "plait.moe_balance",
                    "plait.activation_checkpoint", "plait.compile", "plait.float8", "plait.fsdp"}),
    ("layout plan", {"plait.layout_plan"}),
    ("apply", {"plait.parallelize"}),
    ("model state", {"plait.optim", "plait.checkpoint", "plait.materialize", "plait.gather", "plait.lora.export"}),
    ("run inputs", {"plait.train_args", "plait.model_config", "plait.data", "plait.trackers"}),
    ("training", {"plait.trainer", "plait.runtime", "plait.metrics", "plait.log_line", "plait.moe_metrics",
                  "plait.heartbeat", "plait.stop"}),
    ("tools on a layout", {"plait.costs", "plait.testing"}),
    ("entry points", {"plait", "plait.__main__", "plait.cli", "plait.plan_command", "plait.auto_layout",
                      "plait.torchrun"}),
]


def build_graph() -> grimp.ImportGraph:
    # cache_dir=None: grimp would otherwise write a .grimp_cache directory into the checkout
    return grimp.build_graph(ROOT, include_external_packages=False, cache_dir=None)


def imports(graph: grimp.ImportGraph) -> dict[tuple[str, str], str]:
    """Every (importer, imported) pair of the graph's modules, with where it is written: the line, or the
    package ``__init__.py`` that an import runs."""
    found: dict[tuple[str, str], str] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            details = graph.get_import_details(importer=importer, imported=imported)
            found[importer, imported] = (f"line {details[0]['line_number']}: {details[0]['line_contents']}"
                                         if details else "a direct import")
            package = imported.rpartition(".")[0]
            while package not in ("", ROOT) and not f"{importer}.".startswith(f"{package}."):
                if graph.find_modules_directly_imported_by(package):
                    found.setdefault((importer, package), f"runs {package}/__init__.py (importing {imported})")
                package = package.rpartition(".")[0]
    return found


def cycles(found: dict[tuple[str, str], str]) -> list[list[str]]:
    """One shortest cycle through each import that closes one, each set of modules once."""
    successors: dict[str, set[str]] = defaultdict(set)
    for importer, imported in found:
        successors[importer].add(imported)
    seen: set[frozenset[str]] = set()
    result = []
    for importer, imported in sorted(found):
        path = _shortest_path(successors, imported, importer)
        if path is not None and frozenset(path) not in seen:
            seen.add(frozenset(path))
            result.append([importer, *path])
    return result


def _shortest_path(successors: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    previous: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = previous[node]
            return path[::-1]
        for following in sorted(successors[node]):
            if following not in previous:
                previous[following] = node
                queue.append(following)
    return None


def layer_of(module: str, layers: list[tuple[str, set[str]]]) -> int | None:
    """The index of the layer whose most specific name covers ``module`` (None: no layer names it)."""
    best: tuple[int, int] | None = None  # (length of the name, layer index)
    for index, (_, names) in enumerate(layers):
        for name in names:
            covers = module == name or (name != ROOT and module.startswith(f"{name}."))
            if covers and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def upward_imports(found: dict[tuple[str, str], str], layers: list[tuple[str, set[str]]]) -> list[str]:
    """One line per import of a module in a higher layer than its importer's, naming both and the line."""
    lines = []
    for (importer, imported), where in sorted(found.items()):
        low, high = layer_of(importer, layers), layer_of(imported, layers)
        if low is not None and high is not None and high > low:
            lines.append(f"{importer} ({layers[low][0]}) imports {imported} ({layers[high][0]}), {where}")
    return lines


def unplaced(graph: grimp.ImportGraph, layers: list[tuple[str, set[str]]]) -> list[str]:
    """Modules no layer names, and names of a layer that are no module."""
    named = {name for _, names in layers for name in names}
    return ([f"{m} is in no layer" for m in sorted(graph.modules) if layer_of(m, layers) is None]
            + [f"{name} is no module of {ROOT}" for name in sorted(named - graph.modules)])


# --------------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------------


def test_plait_has_no_import_cycle():
    found = cycles(imports(build_graph()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_every_module_stands_in_one_layer():
    problems = unplaced(build_graph(), LAYERS)
    assert not problems, "place every module in LAYERS (and docs/architecture.md):\n" + "\n".join(problems)


def test_each_layer_imports_only_the_layers_below():
    lines = upward_imports(imports(build_graph()), LAYERS)
    assert not lines, "imports up the stack (LAYERS, bottom to top):\n" + "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The checks themselves, on made-up graphs: they can fail
# --------------------------------------------------------------------------------------------------


def made_up_graph(*edges: tuple[str, str]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for importer, imported in edges:
        for module in (importer, imported):
            graph.add_module(module)
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
    return graph


def test_a_cycle_is_found_and_named():
    graph = made_up_graph(("plait.config", "plait.mesh"), ("plait.mesh", "plait.comm"), ("plait.comm", "plait.config"),
                          ("plait.trainer", "plait.config"))
    assert cycles(imports(graph)) == [["plait.comm", "plait.config", "plait.mesh", "plait.comm"]]


def test_a_package_init_closes_a_cycle():
    """config imports a module of plait.pipeline, whose __init__.py imports a module built on config."""
    graph = made_up_graph(("plait.config", "plait.pipeline.table"), ("plait.pipeline", "plait.pipeline.layout"),
                          ("plait.pipeline.layout", "plait.config"))
    assert cycles(imports(graph)) == [["plait.config", "plait.pipeline", "plait.pipeline.layout", "plait.config"]]


def test_an_upward_import_is_named_with_both_layers():
    layers = [("low", {"plait.config"}), ("high", {"plait.trainer"})]
    graph = made_up_graph(("plait.config", "plait.trainer"), ("plait.trainer", "plait.config"))
    assert upward_imports(imports(graph), layers) == [
        "plait.config (low) imports plait.trainer (high), line 1: import plait.trainer"]


def test_the_most_specific_name_places_a_module():
    layers = [("low", {"plait.lora"}), ("high", {"plait.lora.export", "plait"})]
    modules = ("plait.lora", "plait.lora.layers", "plait.lora.export", "plait")
    assert [layer_of(module, layers) for module in modules] == [0, 0, 1, 1]
    graph = made_up_graph(("plait", "plait.lora"), ("plait.lora.layers", "plait.lora.export"),
                          ("plait.cli", "plait.lora"))
    assert unplaced(graph, layers) == ["plait.cli is in no layer"]
