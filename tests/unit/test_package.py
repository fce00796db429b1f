"""What an installed flightq offers before any of its modules is imported by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import flightq


def test_public_submodules_are_reachable_after_import_flightq():
    code = (
        "import sys, flightq; "
        "print(callable(flightq.aio.connect), callable(flightq.ray.start_shards), "
        "'ray' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    # Reaching flightq.ray does not import Ray itself: that waits for a call.
    assert out.stdout.split() == ["True", "True", "False"], out.stdout + out.stderr


def test_the_package_says_it_is_typed():
    assert (Path(flightq.__file__).parent / "py.typed").is_file()
