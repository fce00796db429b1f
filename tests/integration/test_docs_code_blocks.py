"""Every Python block of README.md and docs/ runs as written: a new user copies them first.

A block that cannot run here (it names remote hosts, a GPU, a Ray cluster) is preceded by
``<!-- not run: why -->`` and is reported as skipped with that reason; every other block
runs in a fresh interpreter, from an empty folder, and must exit 0.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!-- not run: (?P<why>.+?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks() -> list[tuple[str, str, str | None]]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            # A block inside a list item is indented with it.
            code = textwrap.dedent(m.group("code"))
            out.append((f"{doc.relative_to(ROOT)}:{line}", code, m.group("why")))
    return out


BLOCKS = _blocks()


def test_the_docs_have_python_blocks_to_run():
    assert sum(why is None for _, _, why in BLOCKS) >= 1


@pytest.mark.parametrize(("where", "code", "why"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_a_python_block_runs_as_written(where, code, why, tmp_path):
    if why is not None:
        pytest.skip(f"{where}: {why}")
    if "import torch" in code:
        pytest.importorskip("torch", reason="torch is not installed")
    if "tensordict" in code:
        pytest.importorskip("tensordict", reason="tensordict is not installed")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"{where} failed:\n{out.stderr[-4000:]}"
