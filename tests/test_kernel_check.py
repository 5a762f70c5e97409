"""`v4kv check` on CPU (the TPU kernels in interpret mode) at tiny widths: what it prints, the
rows it records in the user's table, and "auto" reading them (v4kv_jax/kernel_check.py,
v4kv_jax/ops/choice.py)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import re

import jax
import pytest

import v4kv_jax as v4
from v4kv_jax import cli, kernel_check, ops

from faults import FaultyDirectory

# Two of the five ops keep the test to seconds (the emissions' interpret-mode programs take
# the longest to compile); every op runs the same path through `check_kernels`.
CHECK = ["check", "--preset", "tiny", "--context", "40", "--batch", "2", "--repeats", "1",
         "--ops", "index_scores", "dense_decode_attention"]
MODEL, GEOMETRY = v4.tiny(), v4.CacheConfig(num_pages=4, max_slots=2, max_pages_per_seq=2)


def test_check_prints_each_op_and_records_the_rows_auto_reads(tmp_path, monkeypatch, capsys,
                                                              caplog):
    table = tmp_path / "user" / "measured.json"
    monkeypatch.setenv("V4KV_MEASURED", str(table))
    assert cli.main(CHECK) == 0
    out = capsys.readouterr().out
    assert "v4kv check on CPU (cpu): the pallas_tpu kernels in interpret mode" in out
    assert "tiny widths (H=4 hd=32 r=8 W=16 m=4 m'=16 indexer 4x16 top-k=8)" in out
    assert "float32 formats, batch 2, context 40" in out
    for op in ("index_scores", "dense_decode_attention"):
        assert re.search(rf"^{op} +yes +\d\.\d\de-\d\d +1e-05 +\d+\.\d{{3}} +\d+\.\d{{3}}$",
                         out, re.M), out
    assert "emit_entries" not in out  # not asked for
    assert "Every kernel checked agrees with the reference." in out
    assert f"Recorded 2 rows for cpu in {table}" in out

    rows = json.loads(table.read_text())["measurements"]
    assert [(r["platform"], r["op"]) for r in rows] == [
        ("cpu", "dense_decode_attention"), ("cpu", "index_scores")]
    for row in rows:
        assert row["agree"] is True and row["interpret"] is True, row
        assert row["implementation"] == "pallas_tpu" and row["device"] == "cpu"
        assert 0 <= row["max_error"] <= row["tolerance"] == 1e-5, row
        assert row["reference_ms"] > 0 and row["kernel_ms"] > 0, row
        assert "context 40 (lengths [40, 19])" in row["shape"], row

    # "auto" reads the user's rows beside the committed ones; on a CPU it still runs the
    # reference, and says what was measured.
    measured = ops.measured()
    assert measured[("cpu", "index_scores")]["table"] == str(table)
    assert measured[("gpu", "index_scores")]["table"] == ops.MEASURED_PATH
    choice = ops.choose("index_scores", MODEL, GEOMETRY, v4.Options(), backend="cpu")
    assert choice.implementation == "reference"
    assert choice.why.startswith("auto on cpu, as measured on cpu (float32 formats, batch 2")

    # A folder that refuses the write (read-only here), or a table it cannot read: nothing
    # recorded, the exit status says so, the table keeps its bytes and no partial file stays.
    kept = table.read_bytes()
    faults = FaultyDirectory(monkeypatch, table.parent)
    faults.read_only()
    assert cli.main(CHECK) == 1
    out = capsys.readouterr().out
    assert "Not recorded: the 2 rows for cpu could not be written (OSError: [Errno 30]" in out
    assert faults.failures["create"] == 1
    faults.disarm()
    faults.arm("replace", errno.ENOSPC)
    assert cli.main(CHECK) == 1 and "could not be written" in capsys.readouterr().out
    assert table.read_bytes() == kept and sorted(table.parent.iterdir()) == [table]
    faults.disarm()
    table.write_text("{not json")
    assert cli.main(CHECK) == 1
    assert (f"could not be written (ValueError: {table}: expected the JSON table of measured "
            "rows") in capsys.readouterr().out and table.read_text() == "{not json"
    table.write_bytes(kept)

    # Rows of a TPU: a kernel that disagreed runs the reference; one that agreed and was
    # faster runs; an op with no row runs its kernel and says so once, as a log line.
    row = next(r for r in rows if r["op"] == "index_scores")
    checked = kernel_check.OpCheck("index_scores", "pallas_tpu", False, row["shape"], True,
                                   row["max_error"], 2e-2, row["reference_ms"],
                                   row["kernel_ms"])
    bad = dataclasses.replace(checked, op="index_scores", agree=False, max_error=0.5)
    good = dataclasses.replace(checked, op="dense_decode_attention", reference_ms=2.0,
                               kernel_ms=1.0)
    # A row of the GPU kernels interpreted on a TPU says nothing of the TPU's own kernel.
    foreign = dataclasses.replace(checked, op="emit_entries", implementation="pallas_gpu",
                                  interpret=True, agree=False)
    kernel_check.choice.record(kernel_check.rows([bad, good, foreign], device="TPU v5 lite",
                                                 platform="tpu"))
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(ops.choice, "_SAID", set())
    with caplog.at_level(logging.WARNING, logger="v4kv_jax.ops.choice"):
        picked = {op: ops.choose(op, MODEL, GEOMETRY, v4.Options(), backend="tpu")
                  for op in ("index_scores", "dense_decode_attention", "emit_entries",
                             "emit_entries")}
    assert picked["index_scores"].implementation == "reference"
    assert picked["index_scores"].why.startswith(
        "auto: the kernel disagreed with the reference on TPU v5 lite (")
    assert f"max error 0.5, tolerance 0.02; {table})" in picked["index_scores"].why
    assert picked["dense_decode_attention"].implementation == "pallas_tpu"
    assert picked["emit_entries"].implementation == "pallas_tpu"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith("auto on tpu runs the pallas_tpu kernel of emit_entries: no "
                              "table holds a measured row for this platform and op")
    assert "`v4kv check`" in said[0] and str(table) in said[0]


def test_check_reports_a_wrong_kernel_and_one_that_fails(tmp_path, monkeypatch, capsys):
    """Planted faults: the dense read's kernel off by 0.01, the indexer's kernel raising (as
    a chip's compiler refusing it would); --no-record leaves the table alone."""
    import pallas_kernels.dense_attention.tpu as dense
    import pallas_kernels.indexer.tpu as indexer

    table = tmp_path / "measured.json"
    monkeypatch.setenv("V4KV_MEASURED", str(table))
    right = dense.dense_decode_attention
    monkeypatch.setattr(dense, "dense_decode_attention",
                        lambda *args, **kwargs: right(*args, **kwargs) + 0.01)

    def refused(*args, **kwargs):
        raise RuntimeError("Mosaic failed to compile the kernel\nsecond line")

    monkeypatch.setattr(indexer, "index_scores", refused)
    assert cli.main([*CHECK, "--no-record"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^index_scores +NO +- +- +\d+\.\d{3} +-  RuntimeError: Mosaic failed "
                     r"to compile the kernel$", out, re.M), out
    # 0.01 everywhere, divided by the largest |output| where that is above 1 (module doc).
    error = re.search(r"^dense_decode_attention +NO +(\S+) +1e-05 ", out, re.M)
    assert error and 1e-3 < float(error[1]) <= 0.01 + 1e-6, out
    assert ("Disagree with the reference: index_scores, dense_decode_attention (\"auto\" runs "
            "the reference for them).") in out
    assert "Not recorded (--no-record)." in out and not table.exists()


def test_auto_ignores_a_user_table_it_cannot_read_and_says_so_once(tmp_path, monkeypatch,
                                                                   caplog):
    table = tmp_path / "measured.json"
    monkeypatch.setenv("V4KV_MEASURED", str(table))
    monkeypatch.setattr(ops.choice, "_SAID", set())
    for text in ("{not json", '{"measurements": [{"op": "index_scores"}]}'):
        table.write_text(text)
        with caplog.at_level(logging.WARNING, logger="v4kv_jax.ops.choice"):
            for _ in range(2):
                assert {row["table"] for row in ops.measured().values()} == {
                    ops.MEASURED_PATH}
                choice = ops.choose("index_scores", MODEL, GEOMETRY, v4.Options(),
                                    backend="gpu")
                assert "measured faster on NVIDIA H200" in choice.why  # the committed row
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # once per version of the file
    assert all(m.startswith(f"auto ignores the user's table {table}, which it cannot read")
               for m in said)
    assert "JSONDecodeError" in said[0] and "a row without its platform or op" in said[1]


@pytest.mark.parametrize("argv, message", [
    (["check", "--set", "head_dim=abc"], "argument --set: expected FIELD=INTEGER with FIELD one "
                                         "of ('num_heads', 'head_dim', "),
    (["check", "--set", "depth=3"], "argument --set: expected FIELD=INTEGER with FIELD one of "
                                    "('num_heads', 'head_dim', 'rope_dim', 'window', "
                                    "'csa_ratio', 'hca_ratio', 'index_heads', "
                                    "'index_head_dim', 'index_topk'); got 'depth=3'"),
    (["check", "--set", "rope_dim=7"], "argument --set: expected widths the flash preset "
                                       "accepts; got {'rope_dim': 7} (rope_dim: expected an "
                                       "even integer"),
    (["check", "--context", "0"], "argument --context: expected an integer >= 1; got '0'"),
    (["check", "--batch", "x"], "argument --batch: expected an integer >= 1; got 'x'"),
    (["check", "--repeats", "0"], "argument --repeats: expected an integer >= 1; got '0'"),
    (["check", "--ops", "attention"], "argument --ops: invalid choice: 'attention'"),
    (["check", "--implementation", "cuda"], "argument --implementation: invalid choice: "
                                            "'cuda'"),
])
def test_check_rejects_bad_arguments_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"v4kv check: error: {message}" in err, err


def test_check_called_directly_checks_its_namespace():
    good = dict(preset="tiny", batch=2, context=40, chunk=8, repeats=1)
    with pytest.raises(ValueError, match=r"--batch: expected an integer in \[1, inf\]; got 0"):
        kernel_check.command(argparse.Namespace(**dict(good, batch=0)))
    with pytest.raises(TypeError, match=r"--repeats: expected an integer; got 1.5"):
        kernel_check.command(argparse.Namespace(**dict(good, repeats=1.5)))
    with pytest.raises(TypeError, match="--chunk: expected a value"):
        kernel_check.command(argparse.Namespace(**{k: v for k, v in good.items()
                                                   if k != "chunk"}))
    with pytest.raises(ValueError, match=r"--preset: expected one of \('flash', 'pro', "
                                         r"'tiny'\); got 'huge'"):
        kernel_check.command(argparse.Namespace(**dict(good, preset="huge")))
    with pytest.raises(ValueError, match=r"--ops: expected one of \('emit_entries', .*; got "
                                         "'attention'"):
        kernel_check.command(argparse.Namespace(**dict(good, ops=["attention"])))
    with pytest.raises(ValueError, match=r"ops_to_check: expected one of .*; got 'scores'"):
        kernel_check.check_kernels(MODEL, ops_to_check=("scores",))
