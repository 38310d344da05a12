"""The versions the suite is proven with are the ones the set-up installs, and pyproject.toml's ranges are the
ones tested: constraints/tested.txt pins every package inside its range, constraints/oldest.txt holds exactly
the lower bounds (what `bash scripts/test.sh --oldest` installs), and this environment has the pins."""

from __future__ import annotations

import functools
import os
import sys
from importlib.metadata import distribution, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in [*project["dependencies"], *extras]]


def pins(name: str) -> dict[str, Version]:
    found = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            package, _, pinned = line.partition("==")
            assert pinned, f"constraints/{name}: {line!r} is not an exact pin (name==version)"
            found[canonicalize_name(package)] = Version(pinned)
    return found


def lower_bound(requirement: Requirement) -> Version:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    assert len(bounds) == 1, f"pyproject.toml: {requirement} needs one lower bound (>=) the tests cover"
    assert any(s.operator == "<" for s in requirement.specifier), f"pyproject.toml: {requirement} has no upper bound"
    return bounds[0]


def test_every_requirement_is_pinned_inside_its_range():
    tested = pins("tested.txt")
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in tested, f"constraints/tested.txt does not pin {requirement.name}"
        assert requirement.specifier.contains(tested[name]), \
            f"constraints/tested.txt pins {name}=={tested[name]}, outside pyproject.toml's {requirement}"


def test_the_newer_torch_sets_are_the_pins_with_another_torch():
    """constraints/tested-torchX.txt (scripts/test.sh --torch X): the pins of tested.txt with torch X and what that
    build brings (its CUDA libraries, triton) added, nothing else moved, and X inside pyproject.toml's range."""
    tested = pins("tested.txt")
    torch_range = next(r for r in requirements() if canonicalize_name(r.name) == "torch").specifier
    sets = sorted((ROOT / "constraints").glob("tested-torch*.txt"))
    assert sets, "no constraints/tested-torch*.txt: the newest torch the range admits is unproven"
    for path in sets:
        other = pins(path.name)
        moved = {name: f"{tested[name]} -> {other.get(name)}" for name in tested
                 if name != "torch" and other.get(name) != tested[name]}
        assert not moved, f"constraints/{path.name} moves pins other than torch: {moved}"
        assert path.stem == f"tested-torch{other['torch'].major}.{other['torch'].minor}", path.name
        assert torch_range.contains(other["torch"]), f"{path.name}: torch {other['torch']} outside {torch_range}"
        added = sorted(set(other) - set(tested))
        assert all(n.startswith(("nvidia-", "cuda-", "triton")) for n in added), f"{path.name} adds {added}"


def test_the_oldest_constraints_are_the_lower_bounds():
    oldest = pins("oldest.txt")
    expected = {canonicalize_name(r.name): lower_bound(r) for r in requirements()}
    assert oldest == expected, f"constraints/oldest.txt {oldest} != pyproject.toml's lower bounds {expected}"


def test_the_oldest_set_meets_its_packages_own_requirements():
    """``scripts/test.sh --oldest`` must resolve: where oldest.txt pins a package at the version installed here (its
    metadata then is the one that run installs), each of that package's own requirements admits what oldest.txt pins
    for the package it names. trl 1.16 (the test extra) asks datasets>=4.7.0, which the lower bound datasets==4.0.0 left
    unresolvable since trl joined the extra; that only datasets >= 5.2 admits the fsspec the object-store extras need is
    beyond this check, which sees no uninstalled version's metadata: the --oldest run itself shows it."""
    oldest = pins("oldest.txt")
    unmet = []
    for name, installed in installed_closure().items():
        if oldest.get(name) != installed:
            continue
        for line in distribution(name).requires or []:
            requirement = Requirement(line)
            wanted = canonicalize_name(requirement.name)
            if wanted in oldest and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})) \
                    and not requirement.specifier.contains(oldest[wanted], prereleases=True):
                unmet.append(f"{name}=={installed} needs {requirement}, oldest.txt pins {wanted}=={oldest[wanted]}")
    assert not unmet, f"constraints/oldest.txt cannot be installed: {unmet}; raise the lower bounds in pyproject.toml"


# What scripts/test.sh installs: plait with these extras and every adapter package under adapters/.
INSTALLED = [("plait", ("test", "plot"))] + [(tomllib.loads(p.read_text())["project"]["name"], ())
                                             for p in sorted((ROOT / "adapters").glob("*/pyproject.toml"))]


@functools.cache
def installed_closure() -> dict[str, Version]:
    """Every distribution the set-up's install needs in this environment, plait's own left out: the requirements of
    plait (with the extras INSTALLED asks for) and its adapters, then theirs, with the extras each one names, markers
    evaluated here. Their installed versions."""
    found: dict[str, set[str]] = {}
    todo = list(INSTALLED)
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in found and set(extras) <= found[key]:
            continue
        found[key] = found.get(key, set()) | set(extras)
        for line in distribution(name).requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((requirement.name, tuple(requirement.extras)))
    return {name: Version(Version(version(name)).public) for name in found if not name.startswith("plait")}


def test_this_environment_has_the_tested_versions():
    """What scripts/setup.sh installed (CI runs it first), every package the install pulled in and not only plait's
    own requirements: an unpinned one takes whatever is newest on the day of a fresh clone (decorator, through gcsfs,
    and setuptools, through torch and tensorboard, did), one at another version means the set-up no longer installs
    what the suite was proven with. Under ``scripts/test.sh --torch X`` the set is constraints/tested-torchX.txt;
    skipped in the --latest / --oldest environments and where a torch other than the pinned one was kept (a CUDA
    build: its own libraries come with it)."""
    deps = os.environ.get("PLAIT_DEPS", "tested")
    if deps in ("latest", "oldest"):
        pytest.skip("a --latest / --oldest run (scripts/test.sh) tests other versions on purpose")
    torch = Version(deps.removeprefix("torch")) if deps.startswith("torch") else None  # --torch X: PLAIT_DEPS=torchX
    name = f"tested-torch{torch.major}.{torch.minor}.txt" if torch else "tested.txt"
    assert (ROOT / "constraints" / name).exists(), (f"no constraints/{name} for torch {torch}: once the suite passes, "
                                                    f"record the set of .venv-{deps}/tested.txt there (README)")
    tested = pins(name)
    installed = installed_closure()
    if deps == "tested" and installed["torch"] != tested["torch"]:
        pytest.skip(f"torch {installed['torch']} was kept (scripts/setup.sh); its own requirements are not pinned")
    unpinned = sorted(set(installed) - set(tested))
    assert not unpinned, f"constraints/{name} does not pin {unpinned}, which the set-up installs: pin them"
    wrong = {n: f"{v} (tested {tested[n]})" for n, v in installed.items() if v != tested[n]}
    assert not wrong, f"installed versions differ from constraints/{name}: {wrong}; run bash scripts/setup.sh"
