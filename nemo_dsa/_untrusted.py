"""Reading the files of a folder someone else made: regular files inside it only, bounded, one line.

A checkpoint, a run directory or an HF-format folder may come from someone else, so nothing read
from it is trusted: a name in it may be a symbolic link out of the folder, a FIFO (``open``
blocks), a device (``/dev/zero`` never ends), or a name in one of its files may hold ``..``.
Every read of such a folder goes through here (``recipe.state``'s manifest check,
``recipe.weights``' ``init_from`` and export, the run that generate and evaluate load,
``models.dsa_lm.checkpoint``'s loads behind ``from_pretrained``, the plugins'
``integrations.common.strict_loading``):

- :func:`open_regular` opens with ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat``-checks a regular
  file (a symbolic link is refused unless ``follow_links``, and then it must resolve inside
  ``root``; a FIFO opens without blocking and is refused), with an optional size cap;
- :func:`read_json` reads at most ``max_bytes`` (a deep nesting is refused, not a RecursionError);
- :func:`file_digest` hashes exactly the bytes ``fstat`` counted (a growing file cannot stall it);
- :func:`check_name` refuses a name read from a file (a manifest entry, an index's ``weight_map``)
  that is absolute or holds ``..``;
- :func:`read_safetensors_header` reads the JSON header only (shapes cost nothing to read) and
  checks it against the file's size, so sizes a config claims can be compared with the tensors
  before anything is allocated; :func:`load_safetensors` then loads the same open file.

Every refusal is an :class:`UntrustedFile` (a ValueError) whose one-line message names the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

JSON_LIMIT = 64 * 2**20  # a config.json, manifest.json or index of a checkpoint is far smaller
HEADER_LIMIT = 100 * 2**20  # the safetensors format's own bound on its JSON header
# bytes per element of each safetensors dtype (sub-byte dtypes such as F4 are not size-checked)
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8,
}  # fmt: skip


class UntrustedFile(ValueError):
    """A file of a folder from someone else that is not read: the message names it (one line)."""


def describe_mode(mode: int) -> str:
    """What a file of mode ``mode`` is, for a message: "a FIFO", "a character device" ..."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _inside(path: str, root: str | os.PathLike) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def check_name(name, where: str) -> str:
    """``name`` (read from ``where``, e.g. a manifest): a relative path inside the folder, else UntrustedFile."""
    parts = name.replace("\\", "/").split("/") if isinstance(name, str) else []
    if not parts or name.startswith(("/", "~")) or "\x00" in name or any(p in ("", ".", "..") for p in parts):
        raise UntrustedFile(f"{where} names {name!r}, not a file inside the folder")
    return name


def open_regular(path: str | os.PathLike, *, follow_links: bool = False, root: str | os.PathLike | None = None,
                 max_bytes: int | None = None) -> tuple[int, int]:
    """``(descriptor, size)`` of the regular file ``path``, opened read-only without blocking.

    A symbolic link is refused (``O_NOFOLLOW``) unless ``follow_links``; then, with ``root``, it
    must resolve inside ``root``. A FIFO, device, socket or directory is refused after ``fstat``
    (``O_NONBLOCK``: opening a FIFO never waits for a writer), so is a file over ``max_bytes``.
    FileNotFoundError is raised as it is (callers say "missing" their own way)."""
    path = os.fspath(path)
    if follow_links and root is not None and os.path.lexists(path) and not _inside(path, root):
        raise UntrustedFile(f"{path} is a symbolic link to {os.path.realpath(path)}, outside {root}; "
                            "only files inside the folder are read")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if not follow_links and os.path.islink(path):
            raise UntrustedFile(f"{path} is a symbolic link; only regular files inside the folder are read") from None
        raise UntrustedFile(f"{path} cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFile(f"{path} is {describe_mode(info.st_mode)}, not a regular file; "
                                "only regular files are read")
        if max_bytes is not None and info.st_size > max_bytes:
            raise UntrustedFile(f"{path} is {info.st_size} bytes, more than the {max_bytes} such a file may hold")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_bytes(path: str | os.PathLike, *, max_bytes: int, follow_links: bool = False,
               root: str | os.PathLike | None = None) -> bytes:
    """The content of the regular file ``path``, at most ``max_bytes`` (else UntrustedFile)."""
    fd, _ = open_regular(path, follow_links=follow_links, root=root, max_bytes=max_bytes)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)  # a file that grew since fstat is still bounded
    if len(data) > max_bytes:
        raise UntrustedFile(f"{path} is more than the {max_bytes} bytes such a file may hold")
    return data


def parse_json(data: bytes | str, where: str):
    """JSON text read from ``where``; invalid UTF-8 / JSON or a nesting deeper than Python reads is UntrustedFile."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text)
    except RecursionError:
        raise UntrustedFile(f"{where} nests JSON deeper than it is read (arrays / objects inside each other)") from None
    except UnicodeDecodeError as e:
        raise UntrustedFile(f"{where} is not UTF-8 text (byte {e.start})") from None
    except ValueError as e:
        raise UntrustedFile(f"{where} is not valid JSON ({e})") from None


def read_json(path: str | os.PathLike, *, max_bytes: int = JSON_LIMIT, follow_links: bool = False,
              root: str | os.PathLike | None = None, expect: type | None = None):
    """The JSON value of the regular file ``path`` (at most ``max_bytes``); ``expect`` (e.g. dict)
    names the type it must have."""
    value = parse_json(read_bytes(path, max_bytes=max_bytes, follow_links=follow_links, root=root), str(path))
    if expect is not None and not isinstance(value, expect):
        want = {dict: "an object", list: "an array"}.get(expect, expect.__name__)
        raise UntrustedFile(f"{path} holds a JSON {type(value).__name__}, not {want}")
    return value


def file_digest(path: str | os.PathLike, expected_size: int | None = None) -> tuple[int, str | None]:
    """``(size, sha256 hex)`` of the regular file ``path`` (no symbolic link); the digest is None
    without reading when ``expected_size`` is given and differs."""
    fd, size = open_regular(path)
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        if expected_size is not None and size != expected_size:
            return size, None
        left = size
        while left:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return size, digest.hexdigest()


@dataclass
class SafetensorsHeader:
    """A safetensors file's header: ``tensors`` ``{key: (dtype name, shape)}``, its string ``metadata``."""

    file: Path
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    metadata: dict[str, str] = field(default_factory=dict)

    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors.values())


def _parse_header(f, file: Path, size: int) -> SafetensorsHeader:
    def bad(detail: str) -> UntrustedFile:
        return UntrustedFile(f"checkpoint file {file} is not a readable safetensors file: {detail}")

    prefix = f.read(8)
    if len(prefix) < 8:
        raise bad("shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(HEADER_LIMIT, size - 8):
        raise bad(f"header length {length} exceeds the file")
    try:
        header = parse_json(f.read(length), "its header")
    except UntrustedFile as e:
        raise bad(str(e)) from None
    if not isinstance(header, dict):
        raise bad("its header is not a table")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("its __metadata__ is not a table of strings")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str) or not all(type(n) is int and n >= 0 for n in shape):
                raise ValueError(f"dtype {dtype!r}, shape {shape!r}")
            shape = tuple(shape)
        except (KeyError, TypeError, ValueError) as err:
            raise UntrustedFile(f"checkpoint file {file}: the header entry of {key} is malformed ({err})") from None
        if type(start) is not int or type(stop) is not int or not 0 <= start <= stop:
            raise UntrustedFile(f"checkpoint file {file}: {key} has data offsets {start}..{stop}")
        if dtype in DTYPE_BYTES and math.prod(shape) * DTYPE_BYTES[dtype] != stop - start:
            nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
            raise UntrustedFile(f"checkpoint file {file}: {key} is {dtype} {list(shape)}, {nbytes} bytes, "
                                f"but its data offsets span {stop - start}")
        tensors[key] = (dtype, shape)
        end = max(end, stop)
    if size != 8 + length + end:
        raise UntrustedFile(f"checkpoint file {file} is {size} bytes where its header describes {8 + length + end} "
                            "(truncated or damaged)")
    return SafetensorsHeader(file, tensors, dict(metadata))


def read_safetensors_header(file: str | os.PathLike, *, follow_links: bool = False,
                            root: str | os.PathLike | None = None) -> SafetensorsHeader:
    """The header of one safetensors file, no tensor data read. The file must be regular, its
    header valid, and its size exactly what the header describes (else UntrustedFile naming it)."""
    file = Path(file)
    fd, size = open_regular(file, follow_links=follow_links, root=root)
    with os.fdopen(fd, "rb") as f:
        return _parse_header(f, file, size)


def load_safetensors(file: str | os.PathLike, *, follow_links: bool = False,
                     root: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``file``, read from the descriptor its header was
    checked on (the file cannot be swapped for a link or a FIFO in between)."""
    from safetensors.torch import load, load_file

    file = Path(file)
    fd, size = open_regular(file, follow_links=follow_links, root=root)
    with os.fdopen(fd, "rb") as f:
        _parse_header(f, file, size)
        try:
            if os.path.isdir("/proc/self/fd"):  # the open descriptor, memory-mapped by safetensors
                return load_file(f"/proc/self/fd/{f.fileno()}")
            f.seek(0)
            return load(f.read())
        except Exception as e:  # noqa: BLE001 - safetensors' own errors name no file
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UntrustedFile(f"checkpoint file {file} could not be read: {detail}") from None
