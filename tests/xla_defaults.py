"""Tests that run as users compile: XLA's default flags, in a subprocess (a pytest plugin).

The suite compiles with faster XLA:CPU flags (tests/conftest.py), and XLA reads its flags once
per process. A test marked `@pytest.mark.xla_defaults` (or a file with that `pytestmark`)
holds a bit-for-bit promise between two programs, which only the flags users compile with
can keep: it runs in a pytest subprocess whose XLA_FLAGS have neither of the suite's flags,
one subprocess per test file for the marked tests of that file that this run selected (so a
file's module fixtures are built once; the suite hands a file to one worker, `--dist
loadfile`). The subprocess starts at the file's first marked test and runs them in collection
order while this process goes on; each marked test then reports here what the subprocess
reported for it (setup, call, teardown; output, traceback, duration), under its own name. A
marked test the subprocess ended without reporting fails, with the subprocess's exit status
and the end of its output. The subprocess ends when this process does, and each of its tests
has the suite's time limit (tests/guardrails.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from pytest import TestReport

MARK = "xla_defaults"
# Set in the subprocess: the conftest adds no flag of its own, the tests run here.
ENV = "V4KV_XLA_DEFAULTS"
_REPORTS = "V4KV_XLA_DEFAULTS_REPORTS"  # the file the subprocess writes its reports to
_PARENT = "V4KV_XLA_DEFAULTS_PARENT"  # the pid of the process that waits for them
IN_SUBPROCESS = bool(os.environ.get(ENV))
_SUITE_FLAGS = ("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters")


def environment(flags: str = "", **extra: str) -> dict[str, str]:
    """This process's environment for a process that compiles at XLA's defaults: XLA_FLAGS
    without the suite's flags (the others kept), `flags` added."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.split("=")[0] not in _SUITE_FLAGS]
    return dict(os.environ, XLA_FLAGS=" ".join(kept + flags.split()), **{ENV: "1"}, **extra)


_CONFIG: dict = {}


def pytest_configure(config):
    _CONFIG["config"] = config
    config.addinivalue_line(
        "markers", f"{MARK}: runs in a subprocess compiling at XLA's default flags "
                   "(tests/xla_defaults.py)")
    if IN_SUBPROCESS and os.environ.get(_PARENT):
        _end_with_parent(int(os.environ[_PARENT]))


def _end_with_parent(parent: int) -> None:
    """The subprocess ends once the process that started it is gone (a worker ended by its
    time limit leaves no subprocess behind)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="xla-defaults-parent").start()


# --- in the subprocess: every report to the file, one JSON line each --------------------------


def pytest_runtest_logreport(report):
    path = os.environ.get(_REPORTS)
    if not IN_SUBPROCESS or not path:
        return
    config = _CONFIG["config"]
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    with open(path, "a") as f:
        f.write(json.dumps(data) + "\n")


# --- in the suite's process: marked tests report what the subprocess ran -------------------


class _Subprocess:
    """The marked tests of one file, run in one pytest subprocess at XLA's defaults."""

    def __init__(self, config, nodeids: list[str]):
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="v4kv-xla-defaults-")
        self.reports = os.path.join(self.dir, "reports.jsonl")
        self.log = open(os.path.join(self.dir, "output.txt"), "w+")
        open(self.reports, "w").close()
        self.offset = 0
        self.received: dict[str, list[TestReport]] = {}
        # A run without the conftest (tests/test_suite_guards.py's) starts one without it.
        plugins = ["--noconftest", *[a for name in ("guardrails", "xla_defaults")
                                     if config.pluginmanager.has_plugin(name)
                                     for a in ("-p", name)]
                   ] if config.getoption("noconftest") else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
             *plugins, "--basetemp", os.path.join(self.dir, "tmp"), *nodeids],
            cwd=str(config.rootpath), stdout=self.log, stderr=subprocess.STDOUT,
            env=environment(**{_REPORTS: self.reports, _PARENT: str(os.getpid())}))

    def _read(self) -> None:
        with open(self.reports) as f:
            f.seek(self.offset)
            while (line := f.readline()).endswith("\n"):
                self.offset = f.tell()
                data = json.loads(line)
                report = self.config.hook.pytest_report_from_serializable(
                    config=self.config, data=data)
                # JSON gives lists where pytest keeps tuples.
                report.location = tuple(report.location)
                if isinstance(report.longrepr, list):  # a skip: (path, line, reason)
                    report.longrepr = tuple(report.longrepr)
                report.sections = [tuple(s) for s in report.sections]
                self.received.setdefault(report.nodeid, []).append(report)

    def reports_of(self, nodeid: str) -> list[TestReport] | None:
        """The reports of `nodeid` once its teardown is reported; None if the subprocess
        ended without it."""
        while True:
            ended = self.proc.poll() is not None
            self._read()
            got = self.received.get(nodeid, [])
            if any(r.when == "teardown" for r in got):
                return got
            if ended:
                return None
            time.sleep(0.1)

    def output_tail(self, chars: int = 6000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_running: dict[str, _Subprocess] = {}


def _marked(item) -> bool:
    return item.get_closest_marker(MARK) is not None


def _failed(item, message: str) -> list[TestReport]:
    """Reports of a test the subprocess never finished: setup passed, the call failed."""
    def report(when, outcome, longrepr=None):
        return TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords}, outcome,
                          longrepr, when)

    return [report("setup", "passed"), report("call", "failed", message),
            report("teardown", "passed")]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if IN_SUBPROCESS or not _marked(item):
        return None
    path = str(item.path)
    if path not in _running:
        nodeids = [i.nodeid for i in item.session.items if str(i.path) == path and _marked(i)]
        _running[path] = _Subprocess(item.config, nodeids)
    proc = _running[path]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = proc.reports_of(item.nodeid)
    if reports is None:
        reports = _failed(item, (
            f"{item.nodeid}: the subprocess at XLA's defaults (tests/xla_defaults.py) ended "
            f"with exit status {proc.proc.returncode} without reporting this test; the end of "
            f"its output:\n{proc.output_tail()}"))
    for report in reports:
        if report.failed:
            report.sections.append(("xla_defaults", "ran in a subprocess compiling at XLA's "
                                    "defaults (tests/xla_defaults.py)"))
        item.ihook.pytest_runtest_logreport(report=report)
    # This process's fixtures that the next test does not use (none of this test's own: it
    # never set any up here); an error there is reported at this test's teardown.
    call = pytest.CallInfo.from_call(
        lambda: item.session._setupstate.teardown_exact(nextitem), when="teardown")
    if call.excinfo is not None:
        item.ihook.pytest_runtest_logreport(report=TestReport.from_item_and_call(item, call))
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    if nextitem is None or str(nextitem.path) != path:
        _running.pop(path).close()
    return True


def pytest_sessionfinish(session):
    while _running:
        _running.popitem()[1].close()
