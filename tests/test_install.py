"""What pip is told: the dependency ranges of pyproject.toml, and that pip resolves the package
against this environment without replacing anything (offline: --no-index); docs/install.md's
version table and pip commands agree with it (each command parses, names extras jax has, and
resolves offline where this environment holds what it installs)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
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


# --- docs/install.md ---------------------------------------------------------------------------

INSTALL_MD = os.path.join(ROOT, "docs", "install.md")
REPO_URL = "git+https://github.com/v4kv-jax/v4kv_jax.git"  # the address the commands name


def install_page() -> str:
    with open(INSTALL_MD) as f:
        return f.read()


def pip_commands() -> list[list[str]]:
    """The `pip install` commands of docs/install.md (its bash blocks and inline code), each
    as the words after `pip install`, one per `&&` part."""
    text = install_page()
    parts = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.splitlines()]
    parts += [" ".join(span.split()) for span in re.findall(r"`(pip install[^`]*)`", text)]
    found = []
    for line in parts:
        for part in line.split("&&"):
            words = shlex.split(part)
            if words[:2] == ["pip", "install"] and words[2:]:  # not "`pip install` of ..."
                found.append(words[2:])
    return found


def test_the_version_table_is_the_packages_lower_bounds():
    rows = dict(re.findall(r"^\| ([\w, ]+) \| ([\d.]+) \|", install_page(), re.M))
    deps = requirements(PROJECT["dependencies"])
    assert rows["Python"] == PROJECT["requires-python"].removeprefix(">=")
    for names, lowest in rows.items():
        for name in names.split(", "):
            if name != "Python":
                assert str(deps[name].specifier) == f">={lowest}", name


def test_the_pip_commands_parse_and_name_extras_jax_has():
    jax_extras = set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
    commands = pip_commands()
    seen = set()
    for words in commands:
        for word in words:
            if word.startswith("-") or word.startswith("."):
                continue  # options, and this checkout (".", ".[test]")
            req = Requirement(word)
            seen.add(req.name)
            if req.name == "jax":
                assert req.extras <= jax_extras, (word, sorted(jax_extras))
            else:
                assert (req.name, req.url) == ("v4kv_jax", REPO_URL), word
    assert seen == {"jax", "v4kv_jax"}
    extras = {e for words in commands for w in words if w.startswith("jax[")
              for e in Requirement(w).extras}
    assert extras == {"tpu", "cuda13"}
    mentioned = set(re.findall(r"jax\[(\w+)\]", install_page()))  # prose too
    assert mentioned == {"tpu", "cuda13", "cuda12"} and mentioned <= jax_extras


def test_the_pip_commands_resolve_keeping_the_installed_jax():
    """Each command with this checkout for the git URL, offline: none would replace what is
    installed. The CUDA extras' plugins are not installed here: those commands are checked
    for their words only."""
    runs = set()
    for words in pip_commands():
        reqs = tuple(sorted("." if w.startswith("v4kv_jax @ ") else w for w in words
                            if not w.startswith("-")))
        if not any("cuda" in w for w in reqs):
            runs.add(reqs)
    assert runs == {(".",), ("jax[tpu]",), (".[test]",)}, runs
    for reqs in sorted(runs):
        assert would_install(*reqs) == ([] if reqs == ("jax[tpu]",) else ["v4kv_jax==0.1.0"])
