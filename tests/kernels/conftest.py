"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from pallas_kernels.common import reset_tpu_interpreter


@pytest.fixture(autouse=True)
def _fresh_tpu_interpreter():
    """A kernel that failed mid-run leaves TPU interpreter state behind: clear it after each
    test."""
    yield
    reset_tpu_interpreter()
