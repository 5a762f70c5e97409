"""README.md and the pages of docs/ and benchmarks/ run as written.

Each page's ```python blocks run in order in one namespace (a page is one test); a block that
needs files or objects gets them from the page's setup here, never from code hidden in the
page. A ```text block right after a code block is that block's output: every line of it
must be printed (for a `v4kv memory` command, by that command). The sections whose blocks
need a setup of their own run in the tests named in `RUN_ELSEWHERE`. Every `v4kv` and
`python benchmarks/...` command of a ```bash block must parse, every relative link must
point to a file and heading that exist, and every claim of equal bits outside
docs/guarantees.md must link to it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import json
import pathlib
import re
import shlex
import sys
from unittest import mock

import numpy as np
import pytest

from v4kv_jax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                             for p in (ROOT / "docs").glob("*.md")), "benchmarks/README.md"]

# (page, section heading) -> the test file that runs that section's python blocks with the
# setup they need (a prefilled cache of its own, a decoder whose hits the test knows, libtpu).
RUN_ELSEWHERE = {
    ("docs/prefix.md", "Prefix sharing on the device"): "tests/test_prefix_device.py",
    ("docs/prefix.md", "Prefix sharing in the Engine"): "tests/test_engine.py",
    ("docs/serving.md", "Serving options"): "tests/test_engine.py",
    ("docs/model.md", "One layer on its own"): "tests/test_layer_recipe.py",
    ("docs/own-model.md", "A whole model of your own, served"): "tests/test_own_model.py",
    ("docs/kernels.md", "Compiling for a TPU from any host"): "tests/tpu_compile_checks.py",
}


@dataclasses.dataclass
class Block:
    language: str
    code: str
    section: str  # the heading above it ("" before the first)
    line: int  # where its fence opens (1-based)
    output: str | None = None  # the ```text block right after it


def blocks(page: str) -> list[Block]:
    """The fenced blocks of a page, each with its section and the output block after it."""
    lines = (ROOT / page).read_text().splitlines()
    found, section, i, last_end = [], "", 0, -1
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            block = Block(line[3:].strip(), "\n".join(lines[i + 1:end]), section, i + 1)
            prev = found[-1] if found else None
            if (block.language == "text" and prev is not None and prev.language != "text"
                    and not any(s.strip() for s in lines[last_end + 1:i])):
                prev.output = block.code
            found.append(block)
            last_end, i = end, end + 1
            continue
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            section = heading[1].strip()
        i += 1
    return found


def prose(page: str) -> list[str]:
    """The page's paragraphs (runs of non-blank lines outside code) and code blocks."""
    parts, current, fenced = [], [], False
    for line in (ROOT / page).read_text().splitlines():
        if line.startswith("```"):
            current.append(line)
            fenced = not fenced
            if not fenced:
                parts.append("\n".join(current))
                current = []
            continue
        if not fenced and not line.strip():
            if current:
                parts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    return parts + (["\n".join(current)] if current else [])


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def headings(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}


# --- page setups and checks -------------------------------------------------------------------


def _checkpoint_files(path: pathlib.Path):
    """config.json and path/to/checkpoint/ (official names) of a tiny decoder's attention, as
    the model page reads them; returns the per-layer params written."""
    from flax import nnx

    import v4kv_jax as v4
    from v4kv_jax import interop
    from v4kv_jax.interop import checkpoint
    from v4kv_jax.interop.hf_config import transformers_config_kwargs
    from v4kv_jax.nn import Decoder, ModelConfig

    config = v4.tiny()
    (path / "config.json").write_text(json.dumps(transformers_config_kwargs(config)))
    source = Decoder(ModelConfig(config, vocab_size=32), rngs=nnx.Rngs(7), bias_scale=0.5)
    written = {layer: interop.attention_state(source, layer=layer)
               for layer in range(config.num_layers)}
    (path / "path" / "to" / "checkpoint").mkdir(parents=True)
    checkpoint.write_attention(path / "path/to/checkpoint/model.safetensors", written, config,
                               "official")
    return written


def _check_readme(scope, _):
    first, second = scope["first"], scope["second"]
    assert (len(first.tokens), first.finish_reason) == (8, "length")
    assert (second.cached_tokens, second.restored_by) == (256, "snapshot")


def _check_pools(scope, _):
    import v4kv_jax as v4

    assert scope["out"].shape == (5, 1, 1, 4, 32)
    assert v4.read_slot(scope["cache"], 0).length == 301


def _check_own_model(scope, _):
    import v4kv_jax as v4

    assert scope["outputs"][-1].shape == (1, 8, 4, 32)
    assert np.isfinite(np.asarray(scope["outputs"][-1][:, 0])).all()
    assert v4.read_slot(scope["cache"], 0).length == 41


def _check_model(scope, written):
    from v4kv_jax import interop

    for layer, params in written.items():  # the checkpoint's weights, read back
        loaded = interop.attention_state(scope["model"], layer=layer)
        assert set(loaded) == set(params), layer
        for name, value in params.items():
            np.testing.assert_array_equal(loaded[name], value, err_msg=f"{layer} {name}")


def _check_serving(scope, _):
    assert [len(t) for t in scope["out"].as_lists()] == [24, 24]
    assert sorted((len(o.tokens), o.finish_reason) for o in scope["finished"]) == [
        (4, "length"), (6, "length")]


def _check_hisparse(scope, _):
    assert scope["report"].host_bytes["classical"] > 0
    assert scope["geometry"].c4_tier == "host"


def _check_formats(scope, _):
    import v4kv_jax as v4

    assert scope["geometry"].entry_dtype == "fp8_latent"
    assert v4.read_slot(scope["cache"], 0).length == 130


def _check_mesh(scope, _):
    import v4kv_jax as v4

    assert [len(t) for t in scope["out"].as_lists()] == [8, 8]
    shards = scope["meshes"].split(scope["cache"], scope["mesh"])
    assert [int(v4.read_slot(c, 0).length) for c in shards.values()] == [40] * len(shards)


def _check_kernels(scope, _):
    assert scope["tiled"].implementation == "pallas_tpu"


# page -> (setup(tmp_path) -> a value handed to the check, check(scope, value))
PAGE_SETUP = {
    "README.md": (None, _check_readme),
    "docs/pools.md": (None, _check_pools),
    "docs/own-model.md": (None, _check_own_model),
    "docs/model.md": (_checkpoint_files, _check_model),
    "docs/serving.md": (None, _check_serving),
    "docs/hisparse.md": (None, _check_hisparse),
    "docs/formats.md": (None, _check_formats),
    "docs/mesh.md": (None, _check_mesh),
    "docs/kernels.md": (None, _check_kernels),
}


def _expect_lines(output: str, printed: str, where: str) -> None:
    lines = {line.rstrip() for line in printed.splitlines()}
    for line in output.splitlines():
        assert line.rstrip() in lines, f"{where}: {line!r} not printed; printed:\n{printed}"


@pytest.mark.parametrize("page", PAGES)
def test_the_python_blocks_of_a_page_run_in_order(page, tmp_path, monkeypatch):
    runnable = [b for b in blocks(page)
                if b.language == "python" and (page, b.section) not in RUN_ELSEWHERE]
    if not runnable:
        assert page not in PAGE_SETUP, f"{page} has no python block to check"
        return
    setup, check = PAGE_SETUP.get(page, (None, None))
    monkeypatch.chdir(tmp_path)
    value = setup(tmp_path) if setup else None
    scope: dict = {"__name__": "docs"}
    for block in runnable:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block.code, f"{page}:{block.line}", "exec"), scope)  # noqa: S102
        if block.output is not None:
            _expect_lines(block.output, printed.getvalue(), f"{page}:{block.line}")
    if check:
        check(scope, value)


def test_blocks_run_elsewhere_are_run_there():
    for (page, section), test_file in RUN_ELSEWHERE.items():
        found = [b for b in blocks(page) if b.section == section and b.language == "python"]
        assert found, f"{page} has no python block under '{section}'"
        source = (ROOT / test_file).read_text()
        assert page in source and f"## {section}\\n" in source, (test_file, page, section)


# --- commands ----------------------------------------------------------------------------------


class _Parsed(Exception):
    pass


def _benchmark(script: str):
    """A benchmark script imported as a module (its own folder on sys.path, as when run)."""
    path = ROOT / script
    assert path.is_file(), script
    name = f"_docs_{path.stem}"
    if name not in sys.modules:
        sys.path.insert(0, str(path.parent))
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[name])
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            sys.path.remove(str(path.parent))
    return sys.modules[name]


def _parse_benchmark(script: str, argv: list[str]) -> argparse.Namespace:
    """The arguments `python <script> <argv>` parses to, without running the benchmark."""
    module = _benchmark(script)
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse):
        with pytest.raises(_Parsed) as parsed:
            module.main(argv)
    return parsed.value.args[0]


def commands(page: str):
    """(block, argv) of every command of the page's bash blocks (one per `&&` part)."""
    for block in blocks(page):
        if block.language != "bash":
            continue
        for line in block.code.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                    argv = argv[1:]  # environment assignments
                if argv:
                    yield block, argv


def _is_command(argv: list[str]) -> bool:
    return argv[0] in ("v4kv", "bash") or (argv[0] == "python" and len(argv) > 1
                                           and argv[1].startswith("benchmarks/"))


@pytest.mark.parametrize("page", [p for p in PAGES
                                  if any(_is_command(argv) for _, argv in commands(p))])
def test_the_commands_of_a_page_parse(page, capsys):
    for block, argv in commands(page):
        if argv[0] == "v4kv":
            args = cli._parser().parse_args(argv[1:])
            assert args.problem(args) is None, argv
            if args.command == "memory" and block.output is not None:
                assert cli.main(argv[1:]) == 0
                _expect_lines(block.output, capsys.readouterr().out, f"{page}:{block.line}")
        elif argv[0] == "python" and argv[1].startswith("benchmarks/"):
            _parse_benchmark(argv[1], argv[2:])
        elif argv[0] == "bash":
            assert (ROOT / argv[1]).is_file(), argv
    if page == "benchmarks/README.md":
        run = {argv[1] for _, argv in commands(page) if _is_command(argv) and argv[0] != "v4kv"}
        scripts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").iterdir()
                   if p.suffix in (".py", ".sh") and p.name != "measure.py"}
        assert run == scripts, "every benchmark's command is given"


# --- structure, links, claims ----------------------------------------------------------------


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert re.fullmatch(r"# \S.*", lines[0]) and not lines[1].strip(), lines[:2]
    end = next(i for i in range(2, len(lines)) if not lines[i].strip())
    paragraph = lines[2:end]
    assert paragraph and not any(line.startswith(("#", "```", "|", "*")) for line in paragraph)
    fenced = blocks("README.md")
    assert [b.language for b in fenced[:2]] == ["bash", "bash"]
    assert "v4kv demo" in fenced[0].code and "pytest" in fenced[1].code
    assert (fenced[0].line, fenced[1].line) == (end + 2, end + 5), "the commands follow"
    quickstart = [b for b in fenced if b.section == "Quickstart"]
    assert len(quickstart) == 1 and quickstart[0].language == "python"
    assert len(quickstart[0].code.splitlines()) <= 30


@pytest.mark.parametrize("page", PAGES)
def test_links_point_to_pages_and_headings_that_exist(page):
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (ROOT / page).parent / file if file else ROOT / page
        assert path.exists(), f"{page}: {target}"
        if anchor:
            assert anchor in headings(path), f"{page}: {target}"


CLAIM = re.compile(r"bit for bit|bit-for-bit|bit-identical|\bexact(ly)?\b|the bits of|same bits",
                   re.I)


@pytest.mark.parametrize("page", [p for p in PAGES if p != "docs/guarantees.md"])
def test_claims_of_equal_bits_link_to_the_guarantees(page):
    for part in prose(page):
        if CLAIM.search(part):
            assert "guarantees.md" in part, f"{page}: {part[:200]}"


def test_layout_names_every_module_and_the_import_order():
    from test_structure import ORDER

    layout = (ROOT / "docs" / "layout.md").read_text()
    assert re.sub(r"\s+", " ", ", ".join(ORDER)) in re.sub(r"\s+", " ", layout)
    for path in sorted((ROOT / "v4kv_jax").rglob("*.py")):
        rel = path.relative_to(ROOT / "v4kv_jax")
        if rel.as_posix() == "__init__.py":
            continue
        if rel.name == "__init__.py":
            assert f"v4kv_jax/{rel.parent.as_posix()}/" in layout, rel
        elif len(rel.parts) == 1:
            assert f"v4kv_jax/{rel.as_posix()}" in layout, rel
        else:
            assert re.search(rf"^ +{re.escape(rel.name)} ", layout, re.M), rel


def test_the_moved_names_are_where_layout_says():
    import v4kv_jax
    import v4kv_jax.nn
    import v4kv_jax.serve
    from v4kv_jax.serve import engine, generator

    assert v4kv_jax.Generator is v4kv_jax.serve.Generator is generator.Generator
    assert v4kv_jax.serve.forward is generator.forward
    assert v4kv_jax.serve.GenerationResult is generator.GenerationResult
    assert v4kv_jax.Engine is engine.Engine
    for name in ("Generator", "forward", "GenerationResult"):
        assert not hasattr(v4kv_jax.nn, name), name
    for old in ("v4kv_jax.engine", "v4kv_jax.manager", "v4kv_jax.nn.generate"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
