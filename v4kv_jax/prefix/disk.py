"""The disk tier of the prefix cache: a directory of snapshot and page files that no filesystem
fault can turn into a wrong answer or a failed step.

`SnapshotDirectory` stores opaque payloads by key (`<key hex><suffix>`: `.v4snap` for
snapshots, `.v4page` for pages, one instance each over the same directory), an LRU bounded by
a file count and by bytes; `pack` / `unpack` give the checksummed file of named arrays both
kinds use. Every filesystem call it makes (open, write, fsync, close, rename,
remove, utime, stat, listing) is caught where it happens: the file is not stored (or not
removed, or not read), `warnings.warn` names the file and the error, and the caller carries on
as if the tier had no such file. So a full disk, a directory that is briefly not writable, a
failing rename or a file that vanished between two calls costs a cache miss, never a request.

A file is written to a temporary name in the directory (`O_EXCL`), flushed, fsync'd, closed and
then renamed over its final name (`os.replace`), so a reader never sees half a file; a failed
write removes its temporary file when it can, and the temporary file of a process that died
while writing is never read and is deleted by the next engine that opens the directory once
it is an hour old. A directory that cannot be written (a shared,
read-only snapshot directory) is a read-only tier: its files are read and hit, nothing is
written, touched or deleted, and one warning says so when the directory is opened. A path that
cannot be a directory at all (a file, "", a path under a file, a folder that cannot be made) is
a `ValueError` naming the argument.

All I/O goes through the `os` module's functions (never `open()`), which is how the tests
inject faults into exactly these calls.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import secrets
import time
import warnings

import jax.numpy as jnp
import numpy as np

from v4kv_jax import checks

SUFFIX = ".v4snap"
_TMP = ".tmp"
STALE_SECONDS = 3600  # a temporary file older than this is a dead writer's


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _error(e: OSError) -> str:
    """An OSError in a few words: its errno name and text (the path is named separately)."""
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    text = e.strerror or str(e) or type(e).__name__
    return f"{code}: {text}" if code else f"{type(e).__name__}: {text}"


def prepare_directory(name: str, directory) -> tuple[str, str | None]:
    """Checks `directory` (a str or os.PathLike naming a directory, or a path where one can be
    made), makes it if missing, and probes whether files can be created in it. Returns the
    path and None when it is writable, else why not (it is then a read-only tier).

    Raises TypeError / ValueError naming `name` when the path cannot be a directory.
    """
    if not isinstance(directory, (str, os.PathLike)):
        checks.fail(name, "a path (str or os.PathLike) or None", type(directory).__name__,
                    TypeError)
    path = os.fspath(directory)
    if isinstance(path, bytes):
        checks.fail(name, "a path (str or os.PathLike) or None", "a bytes path", TypeError)
    if not path:
        checks.fail(name, "a directory (or a path to create one at)", "'' (an empty path)")
    if os.path.exists(path) and not os.path.isdir(path):
        checks.fail(name, "a directory (or a path to create one at)", f"{path!r}, which is a file")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        checks.fail(name, "a directory (or a path to create one at)",
                    f"{path!r}, where none can be made ({_error(e)})")
    probe = os.path.join(path, f".v4kv-probe-{secrets.token_hex(6)}{_TMP}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as e:
        return path, _error(e)
    try:
        os.remove(probe)
    except OSError as e:  # created but not removable: files could not be evicted either
        return path, f"files cannot be removed ({_error(e)})"
    return path, None


# --- the file format ------------------------------------------------------------------------------


def pack(file_format: bytes, header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """A file of named arrays: `file_format` (a line), sha256 of the payload, payload (header
    length, the JSON `header` with every array's name, dtype, shape and offset, their bytes)."""
    meta, blobs, offset = [], [], 0
    for name, x in arrays.items():
        data = np.ascontiguousarray(x).tobytes()
        meta.append({"name": name, "dtype": str(x.dtype), "shape": list(x.shape),
                     "offset": offset, "nbytes": len(data)})
        blobs.append(data)
        offset += len(data)
    head = json.dumps({**header, "arrays": meta}).encode()
    payload = len(head).to_bytes(8, "little") + head + b"".join(blobs)
    return file_format + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def unpack(file_format: bytes, raw: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of a `pack`ed file; ValueError (or KeyError / TypeError) when it is
    truncated, corrupt or of another format."""
    start = len(file_format) + 65
    if len(raw) < start + 8 or not raw.startswith(file_format):
        raise ValueError(f"not a {file_format.decode().strip()} file or truncated "
                         f"({len(raw)} bytes)")
    digest, payload = raw[len(file_format):start - 1], raw[start:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError("checksum mismatch: truncated or corrupt")
    n = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8:8 + n])
    data = memoryview(payload)[8 + n:]
    arrays = {}
    for m in header.pop("arrays"):
        dtype = np.dtype(jnp.dtype(m["dtype"]))
        chunk = data[m["offset"]:m["offset"] + m["nbytes"]]
        arrays[m["name"]] = np.frombuffer(chunk, dtype).reshape(m["shape"]).copy()
    return header, arrays


# --- the directory --------------------------------------------------------------------------------


class SnapshotDirectory:
    """Payloads by key in one directory, an LRU bounded by `max_files` and `max_bytes`.

    Args:
      directory: see `prepare_directory`; files already there are listed by name (oldest
        modification first) and only checked when read.
      max_files, max_bytes: bounds (None: no bound on that measure). Least recently used files
        are deleted past either bound, other engines' files in the same directory included.
      name: the argument name used in errors.

    Attributes:
      path: the directory.
      read_only: why nothing is written (a string), or None.
      errors: filesystem errors caught so far.
      evicted: files deleted (or forgotten) to keep within the bounds.
    """

    def __init__(self, directory, *, max_files: int | None, max_bytes: int | None,
                 name: str = "directory", suffix: str = SUFFIX, noun: str = "snapshot",
                 fallback: str = "the State is rebuilt another way", announce: bool = True):
        self.suffix, self.noun, self.fallback = suffix, noun, fallback
        self.max_files, self.max_bytes = (
            None if value is None else checks.integer(arg, value, lo=0)
            for arg, value in (("max_files", max_files), ("max_bytes", max_bytes)))
        self.path, self.read_only = prepare_directory(name, directory)
        self.errors = 0
        self.evicted = 0
        self._files: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._bytes = 0
        if self.read_only is not None and announce:
            _warn(f"{noun} directory {self.path} is read-only ({self.read_only}): its "
                  f"{noun} files are read and hit, none is written or deleted")
        found, stale = [], []
        try:
            with os.scandir(self.path) as listing:
                for entry in listing:
                    if entry.name.startswith(".") and entry.name.endswith(_TMP):
                        stale.append(entry)
                        continue
                    key = self._key_of(entry.name)
                    if key is None:
                        continue
                    try:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone since the listing: not a file of this tier
                    found.append((info.st_mtime, key, info.st_size))
        except OSError as e:
            self._fault(f"{noun} directory {self.path} cannot be listed ({_error(e)}); "
                        f"no {noun} file of earlier runs is used")
        for _, key, size in sorted(found):
            self._files[key] = size
            self._bytes += size
        if self.read_only is None:
            self._remove_stale(stale)

    def _remove_stale(self, entries) -> None:
        """Deletes temporary files that a writer left more than `STALE_SECONDS` ago (one
        that died while writing): never listed as snapshots, they would only take space.
        Younger ones may be another process's write in progress and stay."""
        now = time.time()
        for entry in entries:
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
                    os.remove(entry.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._fault(f"temporary file {entry.path} left by an earlier writer not "
                            f"deleted ({_error(e)})")

    def _key_of(self, name: str) -> bytes | None:
        if not name.endswith(self.suffix) or name.startswith("."):
            return None
        try:
            return bytes.fromhex(name[:-len(self.suffix)])
        except ValueError:
            return None

    def _fault(self, message: str) -> None:
        self.errors += 1
        _warn(message)

    # --- queries ----------------------------------------------------------------------------------

    def file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + self.suffix)

    def __contains__(self, key: bytes) -> bool:
        return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    def keys(self) -> list[bytes]:
        """The keys of the files this tier lists, least recently used first."""
        return list(self._files)

    @property
    def nbytes(self) -> int:
        """Bytes of the files this tier lists."""
        return self._bytes

    def describe(self) -> str:
        bound = ", ".join(b for b in (
            f"at most {self.max_files} files" if self.max_files is not None else "",
            f"at most {self.max_bytes:,} B" if self.max_bytes is not None else "") if b)
        state = f"read-only: {self.read_only}" if self.read_only else bound or "unbounded"
        return (f"{self.path}: {len(self)} files, {self.nbytes:,} B ({state}); "
                f"{self.errors} filesystem errors caught")

    # --- reads ------------------------------------------------------------------------------------

    def read(self, key: bytes) -> bytes | None:
        """The file's bytes, marked used; None (warned, forgotten) when it cannot be read."""
        path = self.file(key)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                chunks = []
                while chunk := os.read(fd, 1 << 24):
                    chunks.append(chunk)
            finally:
                os.close(fd)
        except OSError as e:  # not deleted: the fault may be the disk's, not the file's
            self._bytes -= self._files.pop(key, 0)
            self._fault(f"{self.noun} file {path} could not be read ({_error(e)}); this "
                        f"engine no longer uses it; {self.fallback}")
            return None
        self._files.move_to_end(key)
        if self.read_only is None:
            try:
                os.utime(path)
            except OSError as e:  # the LRU order of a later process is a little off
                self._fault(f"{self.noun} file {path}: its use time was not recorded "
                            f"({_error(e)})")
        return b"".join(chunks)

    def discard(self, key: bytes, reason: str) -> None:
        """Forgets a file whose contents are unusable (`reason`), deleting it when the
        directory is writable; warns naming it."""
        kept = self._remove(key)
        action = "deleted" if kept is None else f"not deleted ({kept}); never read again here"
        _warn(f"{self.noun} file {self.file(key)} is unusable ({reason}); {action}; "
              f"{self.fallback}")

    # --- writes -----------------------------------------------------------------------------------

    def write(self, key: bytes, payload: bytes) -> bool:
        """Stores `payload` as the file of `key` (temporary file, fsync, rename), evicting least
        recently used files past the bounds. False (warned) when it is not stored."""
        path = self.file(key)
        if self.read_only is not None:
            return False
        size = len(payload)
        if self.max_bytes is not None and size > self.max_bytes:
            _warn(f"{self.noun} file {path} not written: {size:,} B is more than max_bytes="
                  f"{self.max_bytes:,}")
            return False
        tmp = os.path.join(self.path, f".{key.hex()[:16]}.{secrets.token_hex(4)}{_TMP}")
        fd = None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            closing, fd = fd, None  # close(2) frees the descriptor even when it fails
            os.close(closing)
            os.replace(tmp, path)
        except OSError as e:
            self._fault(f"{self.noun} file {path} not written ({_error(e)}); the {self.noun} "
                        "stays off disk, no request is affected")
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
            except OSError as e2:
                self._fault(f"temporary file {tmp} left behind ({_error(e2)})")
            return False
        self._bytes += size - self._files.pop(key, 0)
        self._files[key] = size
        self._trim()
        return True

    def touch(self, key: bytes) -> None:
        """Marks a listed file used now (in this engine's LRU order)."""
        if key in self._files:
            self._files.move_to_end(key)

    def remove(self, key: bytes) -> None:
        """Deletes a file (warned, and forgotten all the same, when it cannot be)."""
        reason = self._remove(key)
        if reason is not None:
            _warn(f"{self.noun} file {self.file(key)} not deleted ({reason}); this engine no "
                  "longer lists it")

    def clear(self) -> None:
        for key in list(self._files):
            self.remove(key)

    def _remove(self, key: bytes) -> str | None:
        """Forgets `key` and deletes its file if it can; returns why it was not deleted (None:
        deleted or already gone)."""
        self._bytes -= self._files.pop(key, 0)
        if self.read_only is not None:
            return f"the directory is read-only: {self.read_only}"
        try:
            os.remove(self.file(key))
        except FileNotFoundError:
            return None
        except OSError as e:
            self.errors += 1
            return _error(e)
        return None

    def _trim(self) -> None:
        while self._files and (
                (self.max_files is not None and len(self._files) > self.max_files)
                or (self.max_bytes is not None and self._bytes > self.max_bytes)):
            self.remove(next(iter(self._files)))
            self.evicted += 1


__all__ = ["SUFFIX", "SnapshotDirectory", "pack", "prepare_directory", "unpack"]
