"""The module map holds: data flows one way, ops is the only door to a kernel, only pools
reaches pool storage by field name, and each reference op is named like its kernels."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

from v4kv_jax import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "v4kv_jax"

# Lowest first: a module may import only modules before it (and the package's own children).
ORDER = ["checks", "config", "layout", "storage", "vectors", "rope", "paging", "pools",
         "compressor", "indexer", "attention", "ops", "append", "step", "prefix_disk", "prefix",
         "prefix_cache", "manager", "nn", "engine", "interop", "testing", "cli"]


def _unit(path: pathlib.Path) -> str:
    """The ORDER entry a file belongs to (a package counts as one unit)."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def _imports(path: pathlib.Path) -> set[str]:
    """v4kv_jax units a file imports, anywhere in it (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "v4kv_jax":
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "v4kv_jax" and len(parts) > 1:
                    found.add(parts[1])
    return found


def _library_files():
    return [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE]


def test_every_module_is_placed_in_the_order():
    units = {_unit(p) for p in _library_files()}
    assert units <= set(ORDER), sorted(units - set(ORDER))


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_one_above_it(path):
    unit = _unit(path)
    rank = ORDER.index(unit)
    above = sorted(u for u in _imports(path) - {unit} if ORDER.index(u) > rank)
    assert not above, f"{path.relative_to(ROOT)} ({unit}) imports {above}, which sit above it"


def test_ops_is_the_only_door_to_the_kernels():
    loads = re.compile(r"^\s*(from|import) pallas_kernels|import_module\(", re.M)
    for path in _library_files():
        if path != PACKAGE / "ops.py":
            assert not loads.search(path.read_text()), path
    own = re.compile(r"^\s*(from|import) v4kv_jax", re.M)
    for path in (ROOT / "pallas_kernels").rglob("*.py"):
        assert not own.search(path.read_text()), path  # kernels import only their helpers


def test_only_pools_reaches_pool_storage_by_field_name():
    fields = re.compile(r"\.classical\b|\.state\.(window|lengths|status|csa|csa_index|hca)\b"
                        r"|\bClassicalPool\b|\bStatePool\b")
    for path in _library_files():
        if path.parent == PACKAGE / "pools" or path.name == "storage.py":
            continue
        code = "\n".join(line for line in path.read_text().splitlines()
                         if not line.strip().startswith(("#", '"', "'")))
        assert not fields.search(code), f"{path.relative_to(ROOT)}: {fields.search(code)[0]}"


@pytest.mark.parametrize("op", sorted(ops._OPS))
def test_each_reference_op_and_its_kernels_share_a_name(op):
    reference, folder, name = ops._OPS[op]
    assert reference.__name__ == name == op
    assert (ROOT / "pallas_kernels" / folder).is_dir()
    for backend in ("tpu", "gpu"):
        module = importlib.import_module(f"pallas_kernels.{folder}.{backend}")
        assert callable(getattr(module, name))
