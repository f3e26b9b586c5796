"""A run's files written whole or not at all, and a failure to write one said in one line.

`write_atomic` writes to a temporary name beside the file, fsyncs and renames (the temporary file is removed when the
write fails), so a reader never sees half a file and a full disk leaves the old file or none, never an empty or torn
one. `JsonLines` is an append-only record file (metrics.jsonl) that holds whole lines only: a record the disk cannot
take is cut off again, and a file that never held one is removed. A failure raises `RunFileError`: an OSError whose
message names the file, the system's reason and what to do (a full disk, a read-only file system, no permission).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

_WHAT_TO_DO = {
    errno.ENOSPC: "free space on that disk or choose another folder (hydra.run.dir=...)",
    errno.EDQUOT: "free space within your quota or choose another folder (hydra.run.dir=...)",
    errno.EROFS: "choose a folder on a writable disk (hydra.run.dir=...)",
    errno.EACCES: "you may not write there: choose a folder you can write (hydra.run.dir=...)",
    errno.EPERM: "you may not write there: choose a folder you can write (hydra.run.dir=...)",
}


class RunFileError(OSError):
    """A run's file could not be written (or its folder made); the message is the one line for the user."""

    def __init__(self, path: Path | str, cause: OSError, doing: str = "write"):
        super().__init__(cause.errno, cause.strerror)
        self.path = str(path)
        self.line = describe(cause, path, doing)

    def __str__(self) -> str:
        return self.line


def describe(exc: OSError, path: Path | str | None = None, doing: str = "write") -> str:
    """'cannot write PATH: No space left on device (errno 28); free space ...': one line for an OSError (`doing`:
    what could not be done to PATH)."""
    if isinstance(exc, RunFileError):
        return exc.line
    where = path if path is not None else exc.filename
    reason = exc.strerror or str(exc) or type(exc).__name__
    code = f" (errno {exc.errno})" if exc.errno else ""
    fix = _WHAT_TO_DO.get(exc.errno or 0, "check the folder and the disk, then run again")
    return f"cannot {doing} {where}: {reason}{code}; {fix}" if where else f"{reason}{code}; {fix}"


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)  # the rename itself survives a crash of the machine
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, data: bytes) -> None:
    """`data` as the file `path`, whole or not at all (see the module); RunFileError when it cannot be written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only folder: no temporary file was made there either
        raise RunFileError(path, exc) from exc


def write_json_atomic(path: Path | str, obj) -> None:
    """A JSON file written whole or not at all: a reader never sees half of it."""
    write_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())


def make_folder(path: Path | str) -> None:
    """The folder `path` (and its parents) made; RunFileError when it cannot be."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunFileError(path, exc, "make the folder") from exc


class JsonLines:
    """An append-only file of one JSON record a line that holds whole lines only (see the module). `kept`: the lines
    it starts with, written whole first (a resumed run's records up to its checkpoint); without them the file is made
    at the first record."""

    def __init__(self, path: Path | str, kept: list[str] | None = None):
        self.path = Path(path)
        self._fd: int | None = None
        self._size = 0  # bytes of whole lines in the file
        if kept:
            write_atomic(self.path, "".join(line + "\n" for line in kept).encode())
            self._open()
        else:  # a new run's records start here, not after an old run's
            try:
                self.path.unlink(missing_ok=True)
            except OSError as exc:
                raise RunFileError(self.path, exc) from exc

    def _open(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise RunFileError(self.path, exc) from exc

    def write(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        if self._fd is None:
            self._open()
        assert self._fd is not None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._cut()
            raise RunFileError(self.path, exc) from exc
        self._size += len(data)

    def _cut(self) -> None:
        """Back to the last whole line (the file removed if it holds none): a full disk still lets a file shrink."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._size)
            if self._size == 0:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # the file is left as the system left it; the error that brought us here is what the user sees

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
