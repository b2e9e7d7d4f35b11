"""The shape of the package: no import cycles, every module importable on its own, small modules,
and the pipeline's direction kept (the engine never reaches the transport, the sources or the UI;
the UI never reaches torch or the engine).

The import graph is read from the source files with ``ast``, so an import counts wherever it is
written: at the top, inside a function (a lazy import) or under ``if TYPE_CHECKING:``. The package
``tensordbg`` is installed from three folders (pyproject.toml's ``package-dir``): ``tensordbg/``,
``rules/`` as ``tensordbg.rules`` and ``tui/`` as ``tensordbg.tui``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"tensordbg": ROOT / "tensordbg", "tensordbg.rules": ROOT / "rules",
                "tensordbg.tui": ROOT / "tui"}  # fmt: skip
MAX_LINES = 500
ENGINE = "tensordbg.engine"
BELOW_THE_ENGINE = ("tensordbg.transport", "tensordbg.sources", "tensordbg.tui")
UI = "tensordbg.tui"


@dataclass
class Module:
    name: str
    path: Path
    internal: list[tuple[str, int]] = field(default_factory=list)
    """Modules of the package it imports, with the line of each import."""
    external: list[tuple[str, int]] = field(default_factory=list)
    """Everything else it imports (``torch.nn``, ``os``), with the line of each import."""

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def where(self) -> str:
        return str(self.path.relative_to(ROOT))


def within(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or inside it: ``within("a.b.c", "a.b")``."""
    return name == prefix or name.startswith(prefix + ".")


def package_modules(folders: dict[str, Path] = PACKAGE_DIRS) -> dict[str, Module]:
    """Every module of the packages installed from ``folders`` (package name -> folder), by
    dotted name, with its imports resolved."""
    modules = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            modules[name] = Module(name, path)
    for module in modules.values():
        for target, line in imported_names(module):
            known = longest_known_prefix(target, modules)
            if known is not None:
                module.internal.append((known, line))
            else:
                module.external.append((target, line))
    return modules


def imported_names(module: Module) -> Iterable[tuple[str, int]]:
    """What each import statement of ``module`` imports, as dotted names: ``from pkg import x``
    gives ``pkg.x`` (a module, or a name that pkg re-exports; see longest_known_prefix)."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = absolute(module, node.module, node.level)
            if base == "__future__":
                continue
            for alias in node.names:
                yield (base if alias.name == "*" else f"{base}.{alias.name}"), node.lineno


def absolute(module: Module, name: str | None, level: int) -> str:
    """The module a ``from`` import names, relative imports resolved against ``module``."""
    if level == 0:
        return name or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{name}" if name else package


def longest_known_prefix(target: str, modules: dict[str, Module]) -> str | None:
    """The module of the package that importing ``target`` runs: ``tensordbg.statistics.MIN``
    is the package's ``__init__`` (which re-exports it), ``tensordbg.engine.session`` itself."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return package_modules()


def cycles(modules: dict[str, Module]) -> list[str]:
    """Each import cycle as a chain, ``"a -> b -> a"``: for every module caught in one, the
    shortest cycle through it (so a tangle of many modules reads as a few short loops)."""
    graph = {name: sorted({t for t, _ in m.internal}) for name, m in modules.items()}
    found = set()
    for component in strongly_connected(graph):
        for start in sorted(component):
            path = shortest_path_back(graph, start, component)
            if path is not None:
                at = path.index(min(path[:-1]))  # one spelling per loop: start at its least name
                found.add(" -> ".join([*path[at:-1], *path[:at], path[at]]))
    return sorted(found)


def strongly_connected(graph: dict[str, list[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` that can hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return components


def shortest_path_back(
    graph: dict[str, list[str]], start: str, component: set[str]
) -> list[str] | None:
    """The shortest path start -> ... -> start through ``component`` (breadth first)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in graph[node]:
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if succ in component and succ not in came_from:
                came_from[succ] = node
                queue.append(succ)
    return None


# --- no cycles ---------------------------------------------------------------------------------


def test_no_module_imports_itself_through_others(modules):
    """A cycle makes the order of imports matter and the layers unreadable; lazy imports and
    TYPE_CHECKING imports only hide it."""
    found = cycles(modules)
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(found)


def test_the_cycle_finder_reads_lazy_type_checking_relative_and_re_exporting_imports(tmp_path):
    """The finder itself, on a planted package: a cycle closed by a lazy import, one by an
    ``if TYPE_CHECKING:`` import through a relative ``from . import module``, and one through a
    package ``__init__`` that merely re-exports."""
    files = {
        "__init__.py": "",
        "a.py": "from pkg.b import B\n",
        "b.py": "B = 1\ndef late():\n    from pkg import a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n",
        "d.py": "from .c import *\n",
        "sub/__init__.py": "from pkg.sub.e import E\n",
        "sub/e.py": "from ..sub import f\nE = 1\n",
        "sub/f.py": "from pkg.sub import E\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    assert cycles(package_modules({"pkg": tmp_path / "pkg"})) == [
        "pkg.a -> pkg.b -> pkg.a",
        "pkg.c -> pkg.d -> pkg.c",
        "pkg.sub -> pkg.sub.e -> pkg.sub.f -> pkg.sub",
    ]


# --- importable alone --------------------------------------------------------------------------

# One interpreter loads the third-party packages the package imports (torch alone takes
# seconds), then imports each module in turn with no module of tensordbg loaded (they are all
# forgotten after each): what is tested is tensordbg's own import order, at the price of one
# torch import. (A fresh forked child per module took 50 s of a loaded 2-core VM, near the
# fixture's limit.)
IMPORT_ALONE = """
import importlib, json, sys, traceback

def ours():
    return sorted(m for m in sys.modules if m.split(".")[0] == "tensordbg")

def alone(name):
    try:
        importlib.import_module(name)
    except BaseException:
        return name, traceback.format_exc(limit=-3), []
    finally:
        loaded = ours()
        for module in loaded:
            del sys.modules[module]
    return name, None, loaded

if __name__ == "__main__":
    modules, preload = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    for name in preload:  # "textual.app.App" is a name in a module: import "textual.app"
        for module in (name, name.rpartition(".")[0]):
            try:
                importlib.import_module(module)
                break
            except Exception:
                pass  # not a module, or an optional dependency: whoever needs it will say so
    assert not ours()
    print(json.dumps([alone(name) for name in modules]))
"""


@pytest.fixture(scope="module")
def imported_alone(modules) -> dict[str, tuple[str | None, list[str]]]:
    """Each module imported alone: its name -> (the error, or None; the tensordbg modules that
    importing it loaded)."""
    preload = sorted({name for m in modules.values() for name, _ in m.external})
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALONE, json.dumps(sorted(modules)), json.dumps(preload)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT.parent,  # not the repository: the installed package, as a user imports it
    )
    assert done.returncode == 0, done.stderr
    return {name: (error, loaded) for name, error, loaded in json.loads(done.stdout)}


def test_each_module_can_be_imported_alone(imported_alone):
    failed = {name: error for name, (error, _) in imported_alone.items() if error}
    assert not failed, "\n".join(f"import {name}:\n{error}" for name, error in failed.items())


# --- small modules ------------------------------------------------------------------------------


def test_no_module_is_longer_than_500_lines(modules):
    lengths = {m.where: len(m.path.read_text().splitlines()) for m in modules.values()}
    long = {where: n for where, n in sorted(lengths.items()) if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{where} ({n})" for where, n in long.items()
    )


# --- the direction of the pipeline ---------------------------------------------------------------


def test_the_engine_never_imports_the_transport_the_sources_or_the_ui(modules, imported_alone):
    engine = [m for name, m in modules.items() if within(name, ENGINE)]
    written = [
        f"{m.where}:{line} imports {target}"
        for m in engine
        for target, line in m.internal
        if any(within(target, below) for below in BELOW_THE_ENGINE)
    ]
    assert not written, "\n".join(written)
    loaded = [
        f"import {m.name} loads {name}"
        for m in engine
        for name in imported_alone[m.name][1]
        if any(within(name, below) for below in BELOW_THE_ENGINE)
    ]
    assert not loaded, "\n".join(loaded)


def test_the_ui_never_imports_torch_or_the_engine(modules):
    ui = [m for name, m in modules.items() if within(name, UI)]
    written = [
        f"{m.where}:{line} imports {target}"
        for m in ui
        for target, line in [*m.internal, *m.external]
        if within(target, "torch") or within(target, ENGINE)
    ]
    assert not written, "\n".join(written)


def test_the_ui_and_a_replay_start_without_loading_torch_the_engine_or_ml_dtypes():
    """ml_dtypes takes 0.6 s to import (on the 2-core VM): it comes at the first bfloat16 or
    float8 array, which then reads as it did."""
    check = (
        "import sys, numpy, tensordbg.tui.app, tensordbg.dump.reader\n"
        "print(sorted(m for m in sys.modules if m in ('torch', 'ml_dtypes')"
        " or m.startswith('tensordbg.engine')))\n"
        "from tensordbg.transport.wire import WireArray\n"
        "words = numpy.array([0x3F80, 0xC000], numpy.uint16)\n"
        "print(WireArray('bfloat16', (2,), words).to_numpy().astype(float).tolist())"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          timeout=60, cwd=ROOT.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "[1.0, -2.0]"]
