"""The suite's guard rails, a pytest plugin: a process of the run that dies of a fatal signal
prints the Python stack of each of its threads, and a test past its time limit has the same
stacks printed and its process ended. Under xdist, with `--max-worker-restart=0`
(pyproject.toml), either ends the run naming the test.

tests/conftest.py registers these hooks for the suite; tests/test_suite_guards.py loads this
module alone (`-p guardrails`) to check them in a run that imports nothing else.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest

# Each test's limit, setup and teardown included (a test may set its own with
# @pytest.mark.time_limit(seconds)). The slowest test takes about 150 s on 2 cores
# (tests/test_mesh.py's eight devices, compiled at XLA's defaults, which sets its own limit);
# the bounds the tests put on their own subprocesses stay below their limit.
TIME_LIMIT = 300.0

_stderr = None


def pytest_configure(config):
    """faulthandler on in every process of the run (the controller, each xdist worker), for
    every thread, writing to a copy of stderr taken now, while pytest is not capturing it:
    what it writes during a test reaches the terminal (through xdist) instead of the test's
    capture, which a dying worker never reports. pytest's own faulthandler plugin does the
    same; this stays on where that plugin is disabled."""
    global _stderr
    _stderr = os.fdopen(os.dup(sys.__stderr__.fileno()), "w")
    faulthandler.enable(file=_stderr, all_threads=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test past its time limit has the stacks of its process's threads printed and its
    process ended (exit status 1). faulthandler's watchdog is a C thread: it fires even while
    the test holds the GIL inside a compiler or a deadlock."""
    marker = item.get_closest_marker("time_limit")
    limit = float(marker.args[0]) if marker else TIME_LIMIT
    faulthandler.dump_traceback_later(limit, exit=True, file=_stderr)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
