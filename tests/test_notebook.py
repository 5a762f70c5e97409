"""notebooks/quickstart.ipynb runs top to bottom on CPU, and is committed without outputs."""

from __future__ import annotations

import os

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
