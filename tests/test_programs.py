"""`v4kv_jax.programs`: a call that compiles says so on the "v4kv_jax" logger."""

from __future__ import annotations

import logging
import re

import jax.numpy as jnp

from v4kv_jax import programs


def test_a_compiling_call_logs_its_start_and_duration(caplog):
    inner = programs.program("test.inner", lambda x: x + 1, register=False)
    outer = programs.program("test.outer", lambda x: inner(x) * 2, register=False)
    caplog.set_level(logging.INFO, logger="v4kv_jax")
    outer(jnp.ones(3))
    lines = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0] == ("v4kv_jax", logging.INFO,
                        "compiling test.outer (its first call with these shapes and statics)")
    assert lines[1][:2] == ("v4kv_jax", logging.INFO)
    assert re.fullmatch(r"compiled test\.outer in \d+\.\d\d s", lines[1][2])
    assert len(lines) == 2  # the inner program compiles as part of the outer one
    caplog.clear()
    outer(jnp.zeros(3))  # the same signature: compiled already
    assert caplog.records == []
    outer(jnp.zeros(4))  # a new shape compiles again
    assert [r.getMessage().split()[0] for r in caplog.records] == ["compiling", "compiled"]
