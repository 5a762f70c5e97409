"""notebooks/quickstart.ipynb runs top to bottom on CPU, and is committed without outputs."""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import shlex
import subprocess
import sys
import types

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "notebooks")
QUICKSTART = os.path.join(NOTEBOOKS, "quickstart.ipynb")


def test_quickstart_is_committed_without_outputs():
    nb = nbformat.read(QUICKSTART, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, cell.source[:60]


def test_quickstart_runs_on_cpu():
    nb = nbformat.read(QUICKSTART, as_version=4)
    env_backend = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the kernel inherits it
    try:
        client = nbclient.NotebookClient(nb, timeout=200, kernel_name="python3",
                                         resources={"metadata": {"path": NOTEBOOKS}})
        client.execute()
    finally:
        if env_backend is None:
            os.environ.pop("JAX_PLATFORMS", None)
        else:
            os.environ["JAX_PLATFORMS"] = env_backend
    text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                     for out in cell.outputs if out.output_type == "stream")
    assert "backend: cpu" in text
    assert "programs compiled: 1" in text
    assert "Classical bytes/token" in text and "State bytes/request" in text
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert len(images) == 1  # the pools plot


# The install cell (cell 1), without running the notebook: what it installs on Colab, and its
# jax version check, exec'd with the %pip lines removed and a stand-in `jax` module.

V4KV_REPO_URL = "git+https://github.com/v4kv-jax/v4kv_jax.git"
JAX_DISTS = {"jax", "jaxlib", "libtpu", "libtpu-nightly", "jax-cuda12-plugin", "jax-cuda12-pjrt"}


def install_cell_source() -> str:
    nb = nbformat.read(QUICKSTART, as_version=4)
    cell = nb.cells[1]
    assert cell.cell_type == "code" and "V4KV_REPO" in cell.source, cell.source[:60]
    return cell.source


def magic_lines(source: str) -> list[str]:
    """The cell's IPython %-magic and !-shell lines (pip runs through them)."""
    return [line.strip() for line in source.splitlines() if line.lstrip()[:1] in ("%", "!")]


def run_install_cell(source: str, jax_version: str | None = None) -> dict:
    """Exec the cell's Python (the magics become `pass`) in a fresh namespace; with
    `jax_version`, `import jax` in the cell gets a stand-in module of that version."""
    python = "\n".join(line[:len(line) - len(line.lstrip())] + "pass"
                       if line.lstrip()[:1] in ("%", "!") else line
                       for line in source.splitlines())
    namespace = {"__name__": "__quickstart_install_cell__"}
    if jax_version is None:
        exec(compile(python, QUICKSTART + ":cell 1", "exec"), namespace)
        return namespace
    fake = types.ModuleType("jax")
    fake.__version__ = jax_version
    fake.__spec__ = importlib.machinery.ModuleSpec("jax", None)
    missing = object()
    real = sys.modules.get("jax", missing)
    sys.modules["jax"] = fake
    try:
        exec(compile(python, QUICKSTART + ":cell 1", "exec"), namespace)
    finally:
        if real is missing:
            sys.modules.pop("jax", None)
        else:
            sys.modules["jax"] = real
    return namespace


def test_install_cell_installs_the_repo_and_never_jax():
    source = install_cell_source()
    assert f'V4KV_REPO = "{V4KV_REPO_URL}"' in source.splitlines()
    assert 'os.environ.get("V4KV_SOURCE")' in source
    assert 'if "google.colab" in sys.modules' in source
    pips = [line for line in magic_lines(source) if "pip" in line]
    assert pips, "the install cell has no %pip line"
    for line in pips:
        assert line.startswith("%pip install "), line  # %pip: into the kernel's environment
        words = shlex.split(line.split(" #", 1)[0])
        assert "-U" not in words and "--upgrade" not in words, line
        names = {re.split(r"[\[<>=!~;@ ]", word, maxsplit=1)[0].lower().replace("_", "-")
                 for word in words[2:] if not word.startswith(("-", "$", "{"))}
        assert not names & JAX_DISTS, f"installs jax: {line}"
    v4kv = [line for line in pips if "$V4KV_SOURCE" in line]
    # With its dependencies, every pip line held to the installed jax and jaxlib.
    assert len(v4kv) == 1 and "--no-deps" not in v4kv[0], pips
    assert all('-c "$KEEP_JAX"' in line for line in pips), pips
    # Outside Colab the cell installs nothing, and the current jax passes its check.
    assert "google.colab" not in sys.modules
    namespace = run_install_cell(source)
    assert namespace["V4KV_REPO"] == V4KV_REPO_URL
    assert namespace["MIN_JAX"] == (0, 10, 2)
    assert "V4KV_SOURCE" not in namespace and "KEEP_JAX" not in namespace


def test_the_minimum_jax_is_the_packages_lower_bound():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(os.path.dirname(NOTEBOOKS), "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    minimum = ".".join(map(str, run_install_cell(install_cell_source())["MIN_JAX"]))
    assert f"jax>={minimum}" in deps and f"jaxlib>={minimum}" in deps


def test_the_install_cell_installs_the_dependencies_and_keeps_the_installed_jax(tmp_path):
    """The cell's %pip line, run by pip with --dry-run against this environment (no index;
    this checkout for $V4KV_SOURCE): it would install v4kv_jax alone, the installed jax,
    jaxlib, flax and chex satisfying its dependencies, and the constraints file holds the
    installed jax and jaxlib."""
    from importlib.metadata import version

    namespace = run_install_cell(install_cell_source())
    keep = namespace["keep_jax"](str(tmp_path / "keep.txt"))
    with open(keep) as f:
        assert f.read().split() == [f"jax=={version('jax')}", f"jaxlib=={version('jaxlib')}"]
    (line,) = [line for line in magic_lines(install_cell_source()) if "$V4KV_SOURCE" in line]
    words = shlex.split(line)[2:]  # after "%pip install"
    words = [{"$KEEP_JAX": keep, "$V4KV_SOURCE": os.path.dirname(NOTEBOOKS)}.get(w, w)
             for w in words if w != "-q"]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--quiet", "--report", "-",
         *words], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [i["metadata"]["name"] for i in report["install"]] == ["v4kv_jax"]


@pytest.mark.parametrize("version", ["0.10.2", "0.10.2.dev20260101", "0.10.3", "0.11.2",
                                     "1.0.0rc1"])
def test_install_cell_accepts_jax_at_or_above_the_minimum(version):
    run_install_cell(install_cell_source(), jax_version=version)


@pytest.mark.parametrize("version", ["0.4.38", "0.10.1", "0.9.9.dev20250101", "0.10"])
def test_install_cell_rejects_old_jax_naming_both_versions_and_the_fix(version):
    with pytest.raises(RuntimeError) as raised:
        run_install_cell(install_cell_source(), jax_version=version)
    message = str(raised.value)
    assert f"jax {version}" in message and ">= 0.10.2" in message
    assert "Runtime > Change runtime type" in message
    assert 'pip install -U "jax[tpu]"' in message and '"jax[cuda13]"' in message
    assert '"jax[cuda12]"' in message
