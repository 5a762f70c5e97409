"""notebooks/quickstart.ipynb runs top to bottom on CPU, and is committed without outputs."""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
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
    # "auto" picks per platform the program is compiled for; interpret mode stays off.
    assert "options: Options(implementation='auto', interpret=False," in text
    # The kernel check ran (one op in interpret mode on CPU) and said what auto runs.
    assert "kernel check on cpu (cpu), pallas_tpu in interpret mode:" in text
    assert re.search(r"dense_decode_attention +agrees \(max error \d\.\de-\d\d\); reference "
                     r"\d+\.\d\d ms, kernel \d+\.\d\d ms", text), text
    for op in ("emit_entries", "emit_entries_online", "index_scores",
               "sparse_decode_attention", "dense_decode_attention"):
        assert f"auto runs {op}: reference (auto on cpu)" in text
    assert "recorded in" not in text
    assert "programs compiled: 1" in text
    assert "Classical bytes/token" in text and "State bytes/request" in text
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert len(images) == 1  # the pools plot


# The install cell (cell 1), without running the notebook: what it installs on Colab, and its
# jax version check, exec'd (IPython magics, if any, removed) with a stand-in `jax` module.

JAX_DISTS = {"jax", "jaxlib", "libtpu", "libtpu-nightly", "jax-cuda12-plugin", "jax-cuda12-pjrt"}


def install_cell_source() -> str:
    nb = nbformat.read(QUICKSTART, as_version=4)
    cell = nb.cells[1]
    assert cell.cell_type == "code" and "V4KV_SOURCE" in cell.source, cell.source[:60]
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


def test_install_cell_installs_what_the_user_names_and_never_jax():
    source = install_cell_source()
    code = [line for line in source.splitlines()
            if line.strip() and not line.startswith(("#", "import ", "from "))]
    assert code[0].startswith('V4KV_SOURCE = ""  # '), code[0]  # first after the imports
    assert "github" not in source.lower()  # no address the project does not publish
    assert 'if "google.colab" in sys.modules' in source
    assert not magic_lines(source)  # pip runs as a process whose exit status is checked
    namespace = run_install_cell(source)
    command = namespace["install_command"]("SOURCE", "keep.txt")
    assert command[:4] == [sys.executable, "-m", "pip", "install"]
    assert "-U" not in command and "--upgrade" not in command and "--no-deps" not in command
    assert command[-3:] == ["-c", "keep.txt", "SOURCE"]  # held to the installed jax
    names = {re.split(r"[\[<>=!~;@ ]", word, maxsplit=1)[0].lower().replace("_", "-")
             for word in command[4:] if not word.startswith("-")}
    assert not names & JAX_DISTS, command
    # Outside Colab the cell installs nothing, and the current jax passes its check.
    assert "google.colab" not in sys.modules
    assert namespace["V4KV_SOURCE"] == ""
    assert namespace["MIN_JAX"] == (0, 10, 2)
    assert "constraints" not in namespace


def test_the_minimum_jax_is_the_packages_lower_bound():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(os.path.dirname(NOTEBOOKS), "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    minimum = ".".join(map(str, run_install_cell(install_cell_source())["MIN_JAX"]))
    assert f"jax>={minimum}" in deps and f"jaxlib>={minimum}" in deps


def test_the_install_cell_installs_the_dependencies_and_keeps_the_installed_jax(tmp_path):
    """The cell's pip command, run with --dry-run against this environment (no index; this
    checkout as V4KV_SOURCE): it would install v4kv_jax alone, the installed jax, jaxlib,
    flax and chex satisfying its dependencies, and the constraints file holds the installed
    jax and jaxlib."""
    from importlib.metadata import version

    namespace = run_install_cell(install_cell_source())
    keep = namespace["keep_jax"](str(tmp_path / "keep.txt"))
    with open(keep) as f:
        assert f.read().split() == [f"jax=={version('jax')}", f"jaxlib=={version('jaxlib')}"]
    command = namespace["install_command"](os.path.dirname(NOTEBOOKS), keep)
    words = [w for w in command[4:] if w != "-q"]  # after "python -m pip install"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--quiet", "--report", "-",
         *words], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [i["metadata"]["name"] for i in report["install"]] == ["v4kv_jax"]


def _run_on_colab(source: str, monkeypatch, v4kv_source: str | None) -> dict:
    """The cell as on a fresh Colab runtime: `google.colab` imported, v4kv_jax not installed
    (find_spec says so), V4KV_SOURCE from the environment."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "v4kv_jax"
                        else real_find_spec(name, *a))
    if v4kv_source is None:
        monkeypatch.delenv("V4KV_SOURCE", raising=False)
    else:
        monkeypatch.setenv("V4KV_SOURCE", v4kv_source)
    return run_install_cell(source)


def test_install_cell_on_colab_stops_until_the_source_is_set(monkeypatch, capsys):
    with pytest.raises(RuntimeError) as raised:
        _run_on_colab(install_cell_source(), monkeypatch, None)
    message = str(raised.value)
    assert message.startswith("V4KV_SOURCE is not set, so there is nothing to install")
    assert "Set V4KV_SOURCE at the top of this cell" in message
    assert "git address" in message and "wheel" in message and "checkout" in message
    assert capsys.readouterr().out == ""


def test_install_cell_on_colab_stops_when_pip_fails_and_never_says_installed(
        monkeypatch, capsys, tmp_path):
    """pip really runs, on a source that does not exist: the cell raises with pip's exit
    status and message, and prints only that it is installing (no success line, no jax line)."""
    missing = str(tmp_path / "no-such-checkout")
    with pytest.raises(RuntimeError) as raised:
        _run_on_colab(install_cell_source(), monkeypatch, missing)
    message = str(raised.value)
    assert message.startswith(f"pip could not install {missing!r} (exit status ")
    assert "set it at the top of this cell to a git address you can clone" in message
    assert "pip said:" in message and "no-such-checkout" in message.split("pip said:")[1]
    # What it was doing, and nothing after: no success line, no jax line.
    assert capsys.readouterr().out == (f"installing v4kv_jax from {missing} (pip, a minute or "
                                       "so) ...\n")


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
