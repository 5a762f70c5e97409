"""The module map holds: data flows one way, and the rules of `RULES`: ops is the only door to
a kernel and the only reader of a chunk, only the pools rooms reach pool storage (fields and
page state) by name, only programs compiles; each reference op is named like its kernels.
Each rule is shown to catch a violation planted in a copy of the package."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import shutil

import pytest

from v4kv_jax.ops import choice

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "v4kv_jax"

# Lowest first: a module may import only modules before it (and the package's own children).
ORDER = ["checks", "config", "config41", "plan", "rope", "programs", "targets", "pools",
         "vectors", "mesh", "ops", "append", "step", "step41", "prefix", "nn", "serve", "interop",
         "testing", "kernel_check", "costs", "cli"]


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


def _code(path: pathlib.Path) -> str:
    """A file's lines that are code (not comments or docstring lines)."""
    return "\n".join(line for line in path.read_text().splitlines()
                     if not line.strip().startswith(("#", '"', "'")))


# Each rule: (what it states, files it does not apply to (relative to the package), pattern).
RULES = {
    "only ops loads a kernel": (
        {"ops/choice.py"}, re.compile(r"^\s*(from|import) pallas_kernels|import_module\(", re.M)),
    "only the pools rooms reach pool storage (fields, page state) by name": (
        {"pools/tree.py", "pools/slots.py", "pools/transfers.py", "pools/report.py",
         "pools/__init__.py", "pools/storage.py", "pools/cache41.py"},
        re.compile(r"\.classical\b|\.state\.(window|lengths|status|csa|csa_index|hca)\b"
                   r"|\bClassicalPool\b|\bStatePool\b|cache\.pages\b|replace\(pages="
                   r"|\.pages\.(page_table|refcount|num_free|free_stack)\b")),
    "every read of a chunk goes through ops.read (no reference read called elsewhere)": (
        {"ops/__init__.py", "ops/doors.py", "ops/choice.py", "ops/attention.py",
         "ops/indexer.py", "ops/compressor.py"},
        re.compile(r"\b(attention\.(attend|sparse_decode_attention|dense_decode_attention)"
                   r"|indexer\.(index_scores|index_topk|running_topk|key_scores|picks_from_scores)"
                   r"|compressor\.emit_entries(_online)?)\(")),
    "only programs compiles (jax.jit); testing/synthetic.py's data helpers may": (
        {"programs.py", "testing/synthetic.py"},
        re.compile(r"\bjax\.jit\(|@jax\.jit\b|\bnnx\.jit\b|partial\(jax\.jit\b"
                   r"|^\s*from jax import .*\bjit\b", re.M)),
}


def violations(package: pathlib.Path) -> list[str]:
    """'rule: file: match' for every rule a library file breaks."""
    found = []
    for rule, (exempt, pattern) in RULES.items():
        for path in sorted(package.rglob("*.py")):
            rel = path.relative_to(package).as_posix()
            if rel in exempt:
                continue
            hit = pattern.search(_code(path))
            if hit:
                found.append(f"{rule}: {rel}: {hit[0].strip()}")
    return found


def test_the_library_keeps_every_rule():
    assert violations(PACKAGE) == []


@pytest.mark.parametrize("rule, file, line", [
    ("only ops loads a kernel", "step.py", "from pallas_kernels import indexer"),
    ("only the pools rooms", "serve/engine.py", "table = self.cache.pages.page_table"),
    ("only the pools rooms", "append.py", "x = cache.state.window"),
    ("every read of a chunk", "step.py", "out = attention.attend(model, geo, options)"),
    ("every read of a chunk", "nn/attention.py", "picks = indexer.index_topk(model)"),
    ("only programs compiles", "serve/manager.py", "_f = jax.jit(pools.reset_slot)"),
    ("only programs compiles", "serve/generator.py",
     "@functools.partial(jax.jit, donate_argnums=0)"),
])
def test_a_planted_violation_is_found(tmp_path, rule, file, line):
    copy = tmp_path / "v4kv_jax"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / file, "a") as f:
        f.write(f"\n\n{line}\n")
    found = violations(copy)
    assert len(found) == 1 and found[0].startswith(rule) and f": {file}: " in found[0], found


def test_kernels_import_only_their_helpers():
    own = re.compile(r"^\s*(from|import) v4kv_jax", re.M)
    for path in (ROOT / "pallas_kernels").rglob("*.py"):
        assert not own.search(path.read_text()), path


@pytest.mark.parametrize("op", sorted(choice._OPS))
def test_each_reference_op_and_its_kernels_share_a_name(op):
    reference, folder = choice._OPS[op]
    assert reference.__name__ == op
    assert (ROOT / "pallas_kernels" / folder).is_dir()
    for backend in ("tpu", "gpu"):
        module = importlib.import_module(f"pallas_kernels.{folder}.{backend}")
        assert callable(getattr(module, op))
        assert callable(module.supported)  # each backend says which configs it runs


@pytest.mark.parametrize("module, name, new_place", [
    ("ops", "decode_attention", "ops.read"), ("ops", "selected", "ops.choose"),
    ("ops", "gpu_support_problem", "ops.supported"), ("step", "jitted", "programs.program"),
    ("append", "page_rows", "pools.page_rows"),
])
def test_a_removed_name_says_where_its_job_went(module, name, new_place):
    with pytest.raises(AttributeError, match=re.escape(new_place)):
        getattr(importlib.import_module(f"v4kv_jax.{module}"), name)


MODULE_LINES, CLASS_LINES = 600, 400  # one idea per module, one object per class


def test_no_module_is_over_600_lines_and_no_class_over_400():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            long.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                long.append(f"{rel}: class {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def _calls(path: pathlib.Path, name: str) -> int:
    """How many calls of `name` (a bare or dotted name) a file makes."""
    return sum(isinstance(node, ast.Call) and (
        isinstance(node.func, ast.Name) and node.func.id == name
        or isinstance(node.func, ast.Attribute) and node.func.attr == name)
        for node in ast.walk(ast.parse(path.read_text())))


def test_slot_tables_are_made_in_one_module():
    """`manager.slot_tables` makes the tables of every shard, for the SlotCache, the
    Generator and the Engine alike."""
    makers = [p.relative_to(PACKAGE).as_posix() for p in sorted(PACKAGE.rglob("*.py"))
              if _calls(p, "SlotTable")]
    assert makers == ["serve/manager.py"]
    assert _calls(PACKAGE / "serve" / "manager.py", "SlotTable") == 1


def test_every_package_folder_has_an_init_with_a_docstring():
    folders = {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    for folder in sorted(folders):
        init = folder / "__init__.py"
        assert init.exists(), folder
        assert ast.get_docstring(ast.parse(init.read_text())), init
