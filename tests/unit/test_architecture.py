"""The layers of docs/architecture.md, held to the code by reading every module's imports.

Each rule is checked on the import graph of ``flightq/`` built from the source (no module
is imported): an import inside a function counts for the rules about what a layer may
reach at all, and module-level imports for the direction of the layers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flightq"

#: Every module's layer, bottom up (docs/architecture.md); a prefix names a package.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("dtypes",),
    ("tensor", "codecs", "digest", "ipccheck", "msgcheck"),
    ("schema",),
    ("registry", "layout"),
    ("rows", "draft", "sink", "encode", "chunks", "validation", "objects"),
    ("columns", "batch", "tensordicts", "media", "workloads"),
    ("protocol", "frames"),
    ("shm", "cuda", "auth", "memory", "forks", "exiting"),
    ("server", "client"),
    ("sharding",),
    ("cli", "tools", "demo", "ray", "aio", "compat", "torch", "writer", ""),
]
#: The data model: never a socket, a server or a client, not even lazily.
DATA_MODEL = {m for layer in LAYERS[:7] for m in layer} - {"workloads"}
FLIGHT = ("pyarrow.flight", "flightq.server", "flightq.client", "flightq.sharding", "socket")


@dataclass(frozen=True)
class Import:
    target: str  # a flightq module ("flightq.x.y") or a foreign one ("pyarrow.flight")
    names: tuple[str, ...]  # the names taken (``from m import a, b``)
    top: bool  # at module level, outside ``if TYPE_CHECKING``
    line: int


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


@cache
def _imports(module: str) -> tuple[Import, ...]:
    path = _modules()[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if lazy or (isinstance(child, ast.If) and _type_checking(child)):
                visit(child, False)
            elif isinstance(child, ast.Import):
                for a in child.names:
                    found.append(Import(a.name, (), top, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                names = tuple(a.name for a in child.names)
                # ``from . import shm`` imports the module flightq.shm.
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in _modules()]
                for s in subs:
                    found.append(Import(s, (), top, child.lineno))
                rest = tuple(n for n in names if f"{target}.{n}" not in _modules())
                if rest or not subs:
                    found.append(Import(target, rest, top, child.lineno))
            else:
                visit(child, top)

    visit(tree, True)
    return tuple(found)


def _short(module: str) -> str:
    return module.removeprefix("flightq").removeprefix(".")


def _layer(module: str) -> int:
    short = _short(module)
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if short == prefix or (prefix and short.startswith(prefix + ".")):
                return i
    raise AssertionError(f"{module} has no layer in docs/architecture.md; add it to LAYERS")


def _reached(start: str) -> dict[str, list[str]]:
    """Every module ``start`` may import, lazily or not, with one import path to each."""
    paths: dict[str, list[str]] = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop()
        for imp in _imports(m):
            targets = [imp.target]
            if imp.target in _modules():
                # Importing a package's submodule runs the package's __init__ too.
                parts = imp.target.split(".")
                targets += [".".join(parts[:k]) for k in range(2, len(parts))]
            for t in targets:
                if t not in paths:
                    paths[t] = [*paths[m], t]
                    if t in _modules():
                        todo.append(t)
    return paths


def test_every_module_has_a_layer():
    for m in _modules():
        _layer(m)


@pytest.mark.parametrize("module", sorted(m for m in _modules() if _short(m) in DATA_MODEL))
def test_the_data_model_never_reaches_flight_a_socket_a_server_or_a_client(module):
    for reached, path in _reached(module).items():
        assert not any(reached == f or reached.startswith(f + ".") for f in FLIGHT), (
            f"{module} reaches {reached}: " + " -> ".join(path)
        )


def test_the_server_never_reaches_the_decoding_side():
    decoding = ("flightq.batch", "flightq.columns", "flightq.client", "flightq.sharding")
    for module in (m for m in _modules() if m.startswith("flightq.server")):
        for reached, path in _reached(module).items():
            assert not any(reached == d or reached.startswith(d + ".") for d in decoding), (
                f"{module} reaches {reached}: " + " -> ".join(path)
            )


def test_the_server_and_the_command_line_load_no_torch():
    # torch is imported lazily, by the functions that take torch tensors.
    code = (
        "import sys, flightq.server, flightq.cli, flightq.server.actions; "
        "print(sorted(m for m in ('torch',) if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_module_level_imports_go_down_the_layers():
    upward = []
    for m in _modules():
        for imp in _imports(m):
            if imp.top and imp.target.startswith("flightq"):
                if imp.target.startswith("flightq_bench"):
                    continue
                if _layer(imp.target) > _layer(m):
                    upward.append(f"{m}:{imp.line} imports {imp.target} (a layer above)")
    assert not upward, "\n".join(upward)


def test_the_server_and_the_client_never_import_each_other():
    for m in _modules():
        for imp in _imports(m):
            for a, b in (("server", "client"), ("client", "server")):
                if m.startswith(f"flightq.{a}") and imp.target.startswith(f"flightq.{b}"):
                    raise AssertionError(f"{m}:{imp.line} imports {imp.target}")


def test_no_module_imports_another_modules_private_names():
    found = []
    for m in _modules():
        for imp in _imports(m):
            if imp.target.startswith("flightq") and imp.target != m:
                private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
                if private:
                    found.append(f"{m}:{imp.line} imports {private} from {imp.target}")
    assert not found, "\n".join(found)


def test_no_import_cycles_at_module_level():
    graph = {
        m: {i.target for i in _imports(m) if i.top and i.target in _modules() and i.target != m}
        for m in _modules()
    }
    # A package's __init__ importing its own submodules is how packages re-export.
    for m in graph:
        if _modules()[m].name == "__init__.py":
            graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = [*stack[stack.index(t) :], t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_import_flightq_loads_neither_flight_nor_torch():
    code = (
        "import sys, flightq; "
        "print(sorted(m for m in ('pyarrow.flight', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
