"""What pip is told: the dependency ranges of pyproject.toml, and that pip resolves the package
against this environment without replacing anything (offline: --no-index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import tomllib
from packaging.requirements import Requirement  # pytest's own dependency
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    PROJECT = tomllib.load(_f)["project"]

# The oldest version of each dependency the suite runs on, the release just below it, and
# newer ones that no known break excludes.
LOWEST = {"jax": ("0.10.2", "0.10.1", ("0.10.3", "0.11.0", "0.12.1", "1.0.0")),
          "jaxlib": ("0.10.2", "0.10.1", ("0.11.0", "1.0.0")),
          "flax": ("0.12.8", "0.12.7", ("0.12.9", "0.13.0", "1.0.0")),
          "chex": ("0.1.92", "0.1.91", ("0.1.93", "0.2.0"))}


def requirements(names: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in names]
    return {r.name.lower(): r for r in reqs}


def test_dependencies_are_lower_bounds_at_the_tested_versions():
    deps = requirements(PROJECT["dependencies"])
    for name, (lowest, below, newer) in LOWEST.items():
        spec = deps[name].specifier
        assert str(spec) == f">={lowest}", (name, str(spec))
        assert Version(lowest) in spec and Version(below) not in spec, name
        for version in newer:
            assert Version(version) in spec, (name, version)


def test_the_installed_versions_satisfy_the_ranges():
    from importlib.metadata import version

    deps = requirements(PROJECT["dependencies"])
    for name in LOWEST:
        assert Version(version(name)) in deps[name].specifier, (name, version(name))
    assert Version(".".join(map(str, sys.version_info[:3]))) in (
        Requirement(f"python{PROJECT['requires-python']}").specifier)


def test_the_test_extra_keeps_its_exact_pins():
    extra = requirements(PROJECT["optional-dependencies"]["test"])
    assert str(extra["torch"].specifier) == "==2.13.0"
    assert str(extra["transformers"].specifier) == "==5.23.0"
    assert "tpu" in extra["jax"].extras


def pip_dry_run(*args: str) -> subprocess.CompletedProcess:
    """`pip install --dry-run` against this environment alone: no index, no build isolation
    (this environment's setuptools builds the metadata)."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--quiet", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300)


def would_install(*args: str) -> list[str]:
    """What `pip install --dry-run ARGS` would install (`name==version`)."""
    proc = pip_dry_run("--report", "-", *args)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    return sorted(f"{i['metadata']['name']}=={i['metadata']['version']}"
                  for i in report["install"])


def test_pip_resolves_the_package_and_its_test_extra_with_what_is_installed():
    assert would_install("-e", ".[test]") == ["v4kv_jax==0.1.0"]
