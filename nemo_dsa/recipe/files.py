"""Crash-safe files: atomic writes, durable appends, and the run-directory lock.

A run killed at any instant leaves every file either as it was or as it was meant to be: whole
files are written to a temporary name, fsynced and renamed over the target (``os.replace`` is
atomic on POSIX); logs are only ever appended to.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

TMP_PREFIX = ".tmp-"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` so that a reader (or a crash) sees the old or the new file, never a mix."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_temporaries(directory: Path) -> list[Path]:
    """Delete the temporary files of ``atomic_write`` calls a kill interrupted (call under the run-dir lock)."""
    directory = Path(directory)
    found = sorted(p for p in directory.glob(f"{TMP_PREFIX}*") if p.is_file()) if directory.is_dir() else []
    for path in found:
        path.unlink(missing_ok=True)
    return found


def append_line(path: Path, line: str) -> None:
    """Append one line durably (a crash can at worst leave a torn last line, which readers skip)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


class RunDirLocked(RuntimeError):
    """Another live process holds the run directory."""


class RunDirLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``, held for the whole run.

    The kernel drops the lock when the holder exits, however it exits, so a killed run never
    leaves a stale lock; the file records who holds it, for the message a second run prints.
    """

    FILE = ".lock"

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / self.FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise RunDirLocked(
                f"run_dir {self.path.parent} is in use by pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')} (since {holder.get('started', '?')}): wait for it to finish "
                "or pick another run_dir"
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    @staticmethod
    def _holder(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
