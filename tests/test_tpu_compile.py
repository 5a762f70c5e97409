"""The TPU compile checks (tests/tpu_compile_checks.py: every Pallas TPU kernel by Mosaic over
the sweep, the step, Generator and data-parallel programs by XLA:TPU) in a process of their
own: libtpu and the TPU compiler's memory (about 2.7 GB at its peak) never stay in a worker
of the suite, which runs the CPU programs beside it."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="compiling for a TPU needs libtpu (jax's [tpu] extra)")

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.time_limit(1230)
def test_the_tpu_compile_checks_pass_in_their_own_process():
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         str(HERE / "tpu_compile_checks.py")],
        cwd=HERE.parent, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    out = child.stdout + child.stderr
    assert child.returncode == 0, out[-8000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 12 and "failed" not in out, out[-4000:]
