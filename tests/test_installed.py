"""simcluster installed from a wheel, not in editable mode.

A wheel puts the repository's ``hooks/`` folder *inside* the package
(``site-packages/simcluster/hooks``). Those hooks are code under test: a report must point
at their lines exactly as it does for an editable install, where they sit beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import simcluster
from simcluster.engine.frames import is_internal, is_simcluster_code

REPO = Path(__file__).resolve().parent.parent

# Runs the CLI from the installed copy: the editable install's import hook is dropped so
# that ``import simcluster`` finds the copy first on sys.path.
_RUN_INSTALLED = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
sys.path.insert(0, sys.argv[1])
import simcluster
assert simcluster.__file__.startswith(sys.argv[1]), simcluster.__file__
from simcluster.cli import main
sys.argv = ["simcluster", *sys.argv[2:]]
sys.exit(main())
"""


def test_the_shipped_hooks_are_user_code_wherever_they_are_installed() -> None:
    inside = os.path.join(os.path.dirname(simcluster.__file__), "hooks", "buggy.py")  # where a wheel puts them
    engine = os.path.join(os.path.dirname(simcluster.__file__), "engine", "inline.py")
    assert not is_internal(inside) and not is_simcluster_code(inside)
    assert is_internal(engine) and is_simcluster_code(engine)


def test_a_wheel_install_reports_the_shipped_hooks_lines(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")  # pip builds the wheel with the venv's own setuptools (offline)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(REPO)], check=True, capture_output=True, cwd=tmp_path)
    assert (target / "simcluster" / "hooks" / "buggy.py").is_file()
    done = subprocess.run(
        [sys.executable, "-c", _RUN_INSTALLED, str(target), "check", "simcluster.hooks.buggy:scaled_fp16_blocking",
         "--world-sizes", "2", "--backend", "gloo", "--no-database"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 1, done.stderr
    # the deadlock is at the hook's blocking wait() inside its callback, in the installed copy
    assert "site/simcluster/hooks/buggy.py:" in done.stdout and "in phase_two: " in done.stdout, done.stdout
