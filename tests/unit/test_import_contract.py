"""No module of flightq reaches into another module's private members.

Read from the source (AST), no imports: an attribute ``x._name`` (``x`` not ``self`` or
``cls``, dunders aside) is a reach into another module unless this module defines
``_name`` itself (assigns ``self._name``, or defines it in a class body): a module may use
the private members of its own classes. The client's modules, once reaching into
``Client`` two dozen times, now pass what they need explicitly.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "flightq"

#: (module, attribute) reaches that stay, with why.
ALLOWED: dict[tuple[str, str], str] = {
    ("cuda/put.py", "_C"): "torch's own private module (torch._C._nn.pad): no public twin",
    ("cuda/put.py", "_nn"): "torch._C._nn.pad, as above",
    ("cuda/get.py", "_base"): "rebasing a decoded column onto device memory: columns.py has "
    "no public rebase yet (columns.py is outside the client's files)",
    ("cuda/get.py", "_elem"): "as _base",
    ("digest.py", "_version"): "torch's in-place version counter (a digest cache's check that "
    "a tensor is unchanged): no public twin",
    ("cuda/get.py", "_columns"): "a device batch swaps the host part's columns: batch.py has "
    "no public setter yet (outside the client's files)",
    ("tensordicts.py", "_flat_ntd"): "tensordict's direct builder of a NonTensorStack member "
    "(what NonTensorStack.from_list takes for strings): no public twin for a row's tags or "
    "media; checked once per process against NonTensorData, whose constructor stands in "
    "where it differs or is gone",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.AST) -> set[str]:
    """Private names the module defines: ``self._x = ...`` and class-body members."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                out.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    out.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return out


def reaches(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """``(line, attribute, expression)`` of each reach into another module's privates."""
    tree = ast.parse(path.read_text(), str(path))
    own = _defined(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr in own:
            continue
        out.append((node.lineno, node.attr, ast.unparse(node)))
    return out


def test_no_module_reaches_into_another_modules_private_members() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, attr, expr in reaches(path):
            if (rel, attr) not in ALLOWED:
                found.append(f"flightq/{rel}:{line}: {expr}")
    assert not found, "private reaches:\n" + "\n".join(found)


def test_every_allowed_reach_still_exists() -> None:
    seen = {
        (path.relative_to(ROOT).as_posix(), attr)
        for path in ROOT.rglob("*.py")
        for _, attr, _ in reaches(path)
    }
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"allowed but gone (drop them from ALLOWED): {stale}"


def test_the_check_finds_a_reach(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "class A:\n    def __init__(self):\n        self._mine = 1\n"
        "def f(a, client):\n    return a._mine, client._flight, a.__class__\n"
    )
    assert [attr for _, attr, _ in reaches(src)] == ["_flight"]


def test_the_client_and_its_streams_import_no_cycle() -> None:
    # streams.py, reads.py and transport.py never import client.py (TYPE_CHECKING too).
    for name in ("streams.py", "reads.py", "transport.py", "interface.py"):
        tree = ast.parse((ROOT / "client" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("client", "flightq.client.client"), name
