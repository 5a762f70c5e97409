"""A filesystem that fails on demand under one directory, for the disk tier's fault tests.

`FaultyDirectory` wraps the `os` functions the disk tier calls (`v4kv_jax.prefix.disk` makes
every filesystem call through them) with pytest's monkeypatch. Calls on paths under its root,
and on file descriptors opened there, fail as armed; every other call (pytest's, JAX's, the
rest of the test) goes to the real function untouched.

    faults = FaultyDirectory(monkeypatch, tmp_path)
    faults.arm("fsync", errno.EIO)            # every fsync there fails
    faults.arm("create", errno.EACCES, 1)     # the next file created there fails, once
    faults.disk_full(free_bytes=5000)         # writes succeed until 5000 bytes, then ENOSPC
    faults.read_only()                        # EROFS for create, rename, remove, utime, mkdir
"""

from __future__ import annotations

import collections
import errno
import os

# Operation name -> the os function it wraps. "create" is os.open with a write flag, "open"
# os.open for reading.
OPERATIONS = ("create", "open", "read", "write", "fsync", "close", "replace", "remove", "utime",
              "scandir", "mkdir")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


class FaultyDirectory:
    def __init__(self, monkeypatch, root):
        self.root = os.path.realpath(os.fspath(root))
        self._armed: dict[str, list] = {}  # op -> [errno, calls left (None: every call)]
        self.calls: collections.Counter = collections.Counter()
        self.failures: collections.Counter = collections.Counter()
        self.free_bytes: int | None = None
        self._fds: set[int] = set()
        real = {name: getattr(os, name) for name in (
            "open", "read", "write", "fsync", "close", "replace", "remove", "unlink", "utime",
            "scandir", "mkdir")}
        self._real = real

        def opener(path, flags, mode=0o777, *, dir_fd=None):
            op = "create" if flags & _WRITE_FLAGS else "open"
            if self._mine(path):
                self._maybe_fail(op, path)
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if self._mine(path):
                self._fds.add(fd)
            return fd

        def write(fd, data):
            if fd not in self._fds:
                return real["write"](fd, data)
            self._maybe_fail("write", fd)
            if self.free_bytes is not None:
                n = min(len(data), self.free_bytes)
                if n == 0:
                    self.failures["write"] += 1
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.free_bytes -= n
                return real["write"](fd, memoryview(data)[:n])
            return real["write"](fd, data)

        def fd_call(op):
            def call(fd, *args):
                if fd in self._fds:
                    self._maybe_fail(op, fd)
                return real[op](fd, *args)
            return call

        def closer(fd):
            if fd in self._fds:
                self._fds.discard(fd)
                try:
                    self._maybe_fail("close", fd)
                except OSError:
                    real["close"](fd)  # a failing close(2) still frees the descriptor
                    raise
            return real["close"](fd)

        def path_call(op, name=None):
            def call(path, *args, **kwargs):
                if self._mine(path):
                    self._maybe_fail(op, path)
                return real[name or op](path, *args, **kwargs)
            return call

        def replace(src, dst, **kwargs):
            if self._mine(src) or self._mine(dst):
                self._maybe_fail("replace", dst)
            return real["replace"](src, dst, **kwargs)

        def scandir(path="."):
            if self._mine(path):
                self._maybe_fail("scandir", path)
            return real["scandir"](path)

        for name, fn in (("open", opener), ("write", write), ("read", fd_call("read")),
                         ("fsync", fd_call("fsync")), ("close", closer), ("replace", replace),
                         ("remove", path_call("remove")), ("unlink", path_call("remove", "unlink")),
                         ("utime", path_call("utime")), ("scandir", scandir),
                         ("mkdir", path_call("mkdir"))):
            monkeypatch.setattr(os, name, fn)

    def _mine(self, path) -> bool:
        if isinstance(path, int):
            return False
        full = os.path.realpath(os.fspath(path))
        return full == self.root or full.startswith(self.root + os.sep)

    def _maybe_fail(self, op: str, target) -> None:
        self.calls[op] += 1
        armed = self._armed.get(op)
        if armed is None:
            return
        code, left = armed
        if left is not None:
            if left <= 0:
                return
            armed[1] -= 1
        self.failures[op] += 1
        name = target if isinstance(target, str) else None
        raise OSError(code, os.strerror(code), name)

    def arm(self, op: str, code: int, times: int | None = None) -> None:
        """Makes the next `times` calls of `op` under the root fail with `code` (None: all)."""
        assert op in OPERATIONS, op
        self._armed[op] = [code, times]

    def disarm(self) -> None:
        self._armed.clear()
        self.free_bytes = None

    def disk_full(self, free_bytes: int = 0) -> None:
        """Writes under the root succeed up to `free_bytes` more bytes, then ENOSPC (a write
        that crosses the limit writes part of its data, as write(2) does)."""
        self.free_bytes = free_bytes

    def read_only(self) -> None:
        """A read-only filesystem at the root: reads work, every change fails with EROFS."""
        for op in ("create", "replace", "remove", "utime", "mkdir"):
            self.arm(op, errno.EROFS)
