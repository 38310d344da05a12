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
from pathlib import Path

import grimp

ROOT = "plait"

# Bottom to top. A name stands for a module, or for a package with every module in it that no more specific name
# places elsewhere (plait.base, but plait.base.device); the root package stands for plait/__init__.py alone.
LAYERS: list[tuple[str, set[str]]] = [
    ("device", {"plait.base.device", "plait.base.host_memory"}),
    ("foundation", {"plait.base"}),
    ("parallel primitives", {"plait.base.mesh", "plait.tp.mappings", "plait.tp.layers", "plait.tp.loss",
                             "plait.tp.rng", "plait.tp.sharding", "plait.cp.sequence", "plait.cp.masks",
                             "plait.cp.ring", "plait.cp.ulysses"}),
    ("adapter declarations", {"plait.tp.styles", "plait.tp.plans", "plait.plugin"}),
    ("mechanisms", {"plait.plugin.registry", "plait.parallel", "plait.tp", "plait.cp", "plait.ep", "plait.pipeline",
                    "plait.lora", "plait.generation"}),
    ("layout plan", {"plait.layout_plan"}),
    ("apply", {"plait.parallel_model", "plait.parallelize"}),
    ("model state", {"plait.optim", "plait.checkpoint"}),
    ("data", {"plait.data"}),
    ("run", {"plait.run"}),
    ("tools on a layout", {"plait.costs", "plait.testing"}),
    ("entry points", {"plait", "plait.__main__", "plait.cli", "plait.plan_command", "plait.generate_command",
                      "plait.auto_layout", "plait.run.torchrun"}),
]
# The root of core/plait: the package's face (what ``import plait`` gives, the front door ``parallelize`` and the
# plan it applies) and the entry points; every other module lives in the folder of its layer.
ROOT_MODULES = {"plait", "plait.__main__", "plait.cli", "plait.plan_command", "plait.generate_command",
                "plait.auto_layout", "plait.layout_plan", "plait.parallel_model", "plait.parallelize"}
MAX_ROOT_MODULES = 20
MAX_LINES = 500


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


def room_of(module: str) -> str:
    """The folder a module lies in (``plait.tp`` for ``plait.tp.styles.linear``), or the module itself at the root."""
    return ".".join(module.split(".")[:2])


def folder_cycles(found: dict[tuple[str, str], str]) -> list[str]:
    """Imports between folders (and root modules) that close a loop, as lines naming the loop and one import of
    each step: a folder that imports a folder which imports it back runs back up the stack, whatever the layers
    of its modules. The root package is left out: it is the face, importing from every folder."""
    rooms: dict[tuple[str, str], str] = {}
    for (importer, imported), where in found.items():
        a, b = room_of(importer), room_of(imported)
        if a != b and ROOT not in (a, b):
            rooms.setdefault((a, b), f"{importer} -> {imported}, {where}")
    return [" -> ".join(cycle) + "\n    " + "\n    ".join(rooms[step] for step in zip(cycle, cycle[1:]))
            for cycle in cycles(rooms)]


def root_modules(graph: grimp.ImportGraph) -> set[str]:
    """The modules at the root of the package (no package of their own)."""
    packages = {m.rpartition(".")[0] for m in graph.modules}
    return {m for m in graph.modules if m == ROOT or (m.count(".") == 1 and m not in packages)}


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


def test_no_folder_imports_back_up():
    found = folder_cycles(imports(build_graph()))
    assert not found, ("folders that import each other (move the shared piece down):\n" + "\n".join(found))


def test_the_root_holds_the_face_and_entry_points_only():
    root = root_modules(build_graph())
    assert root <= ROOT_MODULES and len(root) <= MAX_ROOT_MODULES, (
        f"modules at the root of core/plait outside its face and entry points: {sorted(root - ROOT_MODULES)}; "
        "put each in the folder of its layer (docs/architecture.md)")


def test_no_source_file_over_500_lines():
    repo = Path(__file__).resolve().parent.parent
    long = [f"{path.relative_to(repo)}: {n} lines" for folder in ("core", "adapters") for path in
            sorted((repo / folder).rglob("*.py")) if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"split by what the code does (no file over {MAX_LINES} lines):\n" + "\n".join(long)


# --------------------------------------------------------------------------------------------------
# The checks themselves, on made-up graphs: they can fail
# --------------------------------------------------------------------------------------------------


def made_up_graph(*edges: tuple[str, str]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for importer, imported in edges:
        for module in (importer, imported):
            while module.count("."):
                graph.add_module(module)
                module = module.rpartition(".")[0]
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
    return graph


def test_a_cycle_is_found_and_named():
    graph = made_up_graph(("plait.base.config", "plait.base.mesh"), ("plait.base.mesh", "plait.base.comm"),
                          ("plait.base.comm", "plait.base.config"), ("plait.run.trainer", "plait.base.config"))
    assert cycles(imports(graph)) == [["plait.base.comm", "plait.base.config", "plait.base.mesh", "plait.base.comm"]]


def test_a_package_init_closes_a_cycle():
    """config imports a module of plait.pipeline, whose __init__.py imports a module built on config."""
    graph = made_up_graph(("plait.base.config", "plait.pipeline.table"), ("plait.pipeline", "plait.pipeline.layout"),
                          ("plait.pipeline.layout", "plait.base.config"))
    assert cycles(imports(graph)) == [["plait.base.config", "plait.pipeline", "plait.pipeline.layout", "plait.base.config"]]


def test_an_upward_import_is_named_with_both_layers():
    layers = [("low", {"plait.base.config"}), ("high", {"plait.run.trainer"})]
    graph = made_up_graph(("plait.base.config", "plait.run.trainer"), ("plait.run.trainer", "plait.base.config"))
    assert upward_imports(imports(graph), layers) == [
        "plait.base.config (low) imports plait.run.trainer (high), line 1: import plait.run.trainer"]


def test_the_most_specific_name_places_a_module():
    layers = [("low", {"plait.lora"}), ("high", {"plait.checkpoint.lora_export", "plait"})]
    modules = ("plait.lora", "plait.lora.layers", "plait.checkpoint.lora_export", "plait")
    assert [layer_of(module, layers) for module in modules] == [0, 0, 1, 1]
    graph = made_up_graph(("plait", "plait.lora"), ("plait.lora.layers", "plait.checkpoint.lora_export"),
                          ("plait.cli", "plait.lora"))
    assert unplaced(graph, layers) == ["plait.checkpoint is in no layer", "plait.cli is in no layer"]


def test_folders_that_import_each_other_are_named():
    """Each import keeps to the layers (mesh below apply), but the folders import each other back."""
    graph = made_up_graph(("plait.tp.apply", "plait.base.mesh"), ("plait.base.mesh", "plait.tp.layers"),
                          ("plait", "plait.tp.apply"))
    assert folder_cycles(imports(graph)) == [
        "plait.base -> plait.tp -> plait.base\n"
        "    plait.base.mesh -> plait.tp.layers, line 1: import plait.tp.layers\n"
        "    plait.tp.apply -> plait.base.mesh, line 1: import plait.base.mesh"]


def test_the_root_modules_are_those_in_no_folder():
    graph = made_up_graph(("plait.cli", "plait.tp.apply"), ("plait.trainer", "plait.base.config"))
    assert root_modules(graph) == {"plait.cli", "plait.trainer"}
