"""The suite's own guard rails: a test that kills its worker or hangs ends the whole run within
a minute, and the run names it.

The two tests that misbehave run only on demand (`V4KV_MISBEHAVE=segfault` or `=hang`): the
first dies of a real segmentation fault, the second sleeps past its time limit. Each of the
checks below starts a pytest of two xdist workers on one of them, as README's test command
would, and holds that run to what pyproject.toml promises:

* a fatal signal prints the Python stack of every thread of the dying worker (faulthandler);
* the dead worker is not replaced (`--max-worker-restart=0`), so the run ends at once instead
  of waiting on a replacement that never gets work;
* a test past its time limit (tests/guardrails.py) has its stacks printed and its worker
  ended, which the run reports the same way;
* a test marked `xla_defaults` runs in a subprocess compiling at XLA's defaults, and one
  that fails or dies there fails the run under its own name (tests/xla_defaults.py).
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import time

import pytest

import xla_defaults

HERE = os.path.dirname(os.path.abspath(__file__))
MISBEHAVE = os.environ.get("V4KV_MISBEHAVE", "")
BOUND = 60.0  # seconds a run that lost a worker may take to end


@pytest.mark.skipif(MISBEHAVE != "segfault", reason="on demand: V4KV_MISBEHAVE=segfault")
def test_on_demand_segfault():
    faulthandler._sigsegv()


@pytest.mark.skipif(MISBEHAVE != "hang", reason="on demand: V4KV_MISBEHAVE=hang")
@pytest.mark.time_limit(2)
def test_on_demand_hang():
    time.sleep(3600)


def _on_demand_at_xla_defaults(kind: str):
    """Skipped unless V4KV_MISBEHAVE=`kind`, and only then marked `xla_defaults` (a skipped
    test would start a subprocess to be skipped there)."""
    def mark(test):
        test = pytest.mark.skipif(MISBEHAVE != kind,
                                  reason=f"on demand: V4KV_MISBEHAVE={kind}")(test)
        return pytest.mark.xla_defaults(test) if MISBEHAVE == kind else test
    return mark


@_on_demand_at_xla_defaults("fail")
def test_on_demand_failure_at_xla_defaults():
    assert os.environ.get(xla_defaults.ENV) == "1", "not in the subprocess"
    assert 6 * 7 == 41, "the failure this test is for"


@_on_demand_at_xla_defaults("die")
def test_on_demand_death_at_xla_defaults():
    assert os.environ.get(xla_defaults.ENV) == "1", "not in the subprocess"
    faulthandler._sigsegv()


def _bits_of_a_program(compiler_options=None) -> bytes:
    """A program whose float results XLA:CPU rounds differently at the suite's flags than at
    its defaults (vectorised exp, log1p and tanh, then a dot)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32)
    compiled = jax.jit(lambda x: jnp.tanh(jnp.exp(x) * jnp.log1p(jnp.abs(x))) @ x.T).lower(
        x).compile(compiler_options=compiler_options)
    return np.asarray(compiled(x)).tobytes()


DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
SUITE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


@pytest.mark.xla_defaults
def test_a_marked_test_compiles_at_xla_defaults():
    """The process of a marked test: XLA_FLAGS without the suite's flags, and a program
    compiled there has the bits of one compiled with XLA's defaults named per compile."""
    flags = os.environ.get("XLA_FLAGS", "")
    assert "optimization_level" not in flags and "fusion_emitters" not in flags, flags
    assert _bits_of_a_program() == _bits_of_a_program(DEFAULTS)


def test_the_other_tests_compile_with_the_suite_flags():
    flags = os.environ.get("XLA_FLAGS", "")
    assert "--xla_backend_optimization_level=0" in flags, flags
    assert _bits_of_a_program() == _bits_of_a_program(SUITE)


def test_faulthandler_is_on_in_this_worker():
    assert faulthandler.is_enabled()


def _misbehave(kind: str, *plugins: str) -> tuple[subprocess.CompletedProcess, float]:
    """This file's on-demand `kind` test in a pytest of two workers, with the guard rails
    and `plugins` alone (`-p guardrails`, no conftest: nothing else to import)."""
    env = dict(os.environ, V4KV_MISBEHAVE=kind,
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
         "-p", "guardrails", *[a for p in plugins for a in ("-p", p)], "-n", "2",
         os.path.join(HERE, "test_suite_guards.py"), "-k", "on_demand"],
        cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True,
        timeout=3 * BOUND)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("kind, report", [
    ("segfault", "Fatal Python error: Segmentation fault"),  # faulthandler on a fatal signal
    ("hang", "Timeout (0:00:02)!"),  # faulthandler's watchdog at the time limit
])
def test_a_worker_that_dies_ends_the_run_naming_its_test(kind, report):
    proc, seconds = _misbehave(kind)
    out = proc.stdout + proc.stderr
    test = f"tests/test_suite_guards.py::test_on_demand_{kind}"
    assert proc.returncode == 1, out[-4000:]
    assert seconds < BOUND, f"the run took {seconds:.0f} s to end"
    assert f"crashed while running '{test}'" in out, out[-4000:]
    # The report, then the stacks: the dying thread's goes down to the test.
    assert report in out and f"in test_on_demand_{kind}" in out, out[-4000:]
    assert "1 failed" in out, out[-4000:]


@pytest.mark.parametrize("kind, report", [
    ("fail", "the failure this test is for"),  # the subprocess's traceback
    ("die", "Fatal Python error: Segmentation fault"),  # the end of the subprocess's output
])
def test_a_test_that_fails_at_xla_defaults_fails_the_run_naming_it(kind, report):
    """The marked test runs in the subprocess (tests/xla_defaults.py); what happens there is
    reported here under its name, and fails the run."""
    proc, _ = _misbehave(kind, "xla_defaults")
    out = proc.stdout + proc.stderr
    test = f"test_on_demand_{'failure' if kind == 'fail' else 'death'}_at_xla_defaults"
    assert proc.returncode == 1, out[-4000:]
    assert f"FAILED tests/test_suite_guards.py::{test}" in out, out[-4000:]
    assert report in out and "1 failed" in out, out[-4000:]
    if kind == "die":
        assert "without reporting this test" in out, out[-4000:]


def test_the_longest_files_go_out_first():
    """`--dist loadfile` hands whole files to the workers; with xdist's reordering off they go
    in collection order, which tests/conftest.py starts with the longest files (with it on,
    the files with the most tests go first and a one-test file of minutes ends the run alone)."""
    import pathlib

    import tomllib

    from conftest import _LONGEST_FIRST

    root = pathlib.Path(HERE).parent
    opts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"].split()
    assert "loadfile" in opts and "--no-loadscope-reorder" in opts, opts
    files = {p.name for p in pathlib.Path(HERE).rglob("test_*.py")}
    assert set(_LONGEST_FIRST) <= files, set(_LONGEST_FIRST) - files
