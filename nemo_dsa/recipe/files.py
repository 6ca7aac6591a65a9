"""Crash-safe files: atomic writes, durable appends, and the run-directory lock.

A run killed at any instant leaves every file either as it was or as it was meant to be: whole
files are written to a temporary name, fsynced and renamed over the target (``os.replace`` is
atomic on POSIX); logs are only ever appended to.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
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


class RunDirUnusable(ValueError):
    """``run_dir`` (or a path under it) cannot hold the run: named in the message."""


def check_run_dir(run_dir) -> Path:
    """``run_dir`` as a path, refusing the empty one (it would scatter the run into the current directory)."""
    if not isinstance(run_dir, str | os.PathLike) or not str(run_dir).strip():
        raise RunDirUnusable(f"run_dir must name a directory for the run, got {run_dir!r}")
    return Path(run_dir)


def path_under(run_dir: Path, relative, key: str) -> Path:
    """``run_dir / relative``, refusing an absolute ``relative`` or one that leaves ``run_dir`` (``key`` names it)."""
    text = str(relative) if isinstance(relative, str | os.PathLike) else ""
    parts = Path(text).parts
    if not text.strip() or Path(text).is_absolute() or ".." in parts or text.startswith("~"):
        raise RunDirUnusable(f"{key} must be a relative path inside run_dir (e.g. tensorboard), got {relative!r}")
    return Path(run_dir) / text


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

        run_dir = self.path.parent
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW: a symlink named .lock is refused, never followed to the file it names
            # (which the holder's record below would overwrite).
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunDirUnusable(f"run_dir {run_dir}: {self.path} is a symbolic link; remove it "
                                     "(the run's lock file is a plain file it creates)") from None
            if e.errno == errno.EISDIR:
                raise RunDirUnusable(f"run_dir {run_dir}: {self.path} is not a regular file; remove it") from None
            raise RunDirUnusable(f"run_dir {run_dir} cannot be written ({e.strerror}: {e.filename}): "
                                 "pick a writable run_dir") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunDirUnusable(f"run_dir {run_dir}: {self.path} is not a regular file; remove it")
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
