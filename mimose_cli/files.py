"""Files as a run writes and reads them: replaced atomically, read strictly.

A leaf: no other module of the package is imported here, so the library (a planner writing its
estimator), the recipe and the run directory all write and read through the same few functions.
"""

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import TypeAdapter, ValidationError


def write_json(path, data) -> None:
    """Write ``data`` as JSON atomically: a temporary file in the same directory, then
    ``os.replace``, so a kill or a full disk leaves the old file or the new one, never half."""
    write_text(path, json.dumps(data, indent=2, default=str))


_WRITER_FAILURES = ("inline_container.cc", "PytorchStreamWriter", "I/O error", "os error")
"""What torch's serializer and safetensors say when a write failed underneath them: they raise
their own errors (RuntimeError, SafetensorError), not the OSError the file system gave."""


@contextlib.contextmanager
def disk_errors(path):
    """Inside, a serializer's failed write to ``path`` (a real full disk: torch's
    "unexpected pos 2534656 vs 2534548", safetensors' "No space left on device (os error 28)")
    is raised as the OSError every writer's caller handles: ENOSPC when the disk is full, else EIO."""
    try:
        yield
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 - only the serializers' write failures are turned
        message = str(error)
        if not any(mark in message for mark in _WRITER_FAILURES):
            raise
        full = "No space left" in message or _free_bytes(Path(path).parent) < 1 << 16
        code = errno.ENOSPC if full else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from error


def _free_bytes(directory: Path) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 1 << 62


def file_mode() -> int:
    """The mode a plainly created file gets under the process's umask (``mkstemp`` makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def dangling_link(path) -> Path | None:
    """The first of ``path`` and its parents that is a symbolic link to nothing, else None:
    ``mkdir`` says only "File exists" of one, which sends the user looking for a file."""
    for part in (Path(path), *Path(path).parents):
        if part.is_symlink() and not part.exists():
            return part
    return None


def refuse_dangling_link(path, given: str) -> None:
    """ValueError when ``path`` (``given``, as the user named it) is, or lies under, a dangling link."""
    link = dangling_link(path)
    if link is not None:
        where = "" if link == Path(path) else f" lies under {str(link)!r}, which"
        raise ValueError(f"{given}{where} is a symbolic link to {os.readlink(link)!r}, which does not exist; "
                         "create that directory, or remove the link")


def write_text(path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically (see ``write_json``), readable as any file the user
    writes (others on a shared machine read the summary as they read the metrics)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_text(path: Path) -> str | None:
    """A run file's text, None when absent; ValueError naming it when it is a directory or not
    UTF-8 (random bytes, a binary file where a JSON one belongs)."""
    if not path.exists():
        return None
    if not path.is_file():
        raise ValueError(f"{path} is not a file; a run directory holds it as a file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: byte {err.start} is not UTF-8 text; the file is corrupt") from None


def read_jsonl(path: Path) -> list:
    """The objects of a JSON-lines file, [] when absent. A torn last line (a run killed mid-write)
    is skipped; any other line that is not a JSON object raises ValueError naming file and line."""
    text = read_text(path)
    if text is None:
        return []
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: the write was cut short
                continue
            raise ValueError(f"{path} line {number}: not JSON ({err.msg}); the file is corrupt") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} line {number}: expected a JSON object, got {type(data).__name__}")
        records.append(data)
    return records


def read_json(path: Path, schema: TypeAdapter | None = None) -> dict | None:
    """A JSON object file's content, None when absent; ValueError naming the file when it is not
    valid JSON (torn, garbage), not an object, or (given a ``schema``) lacks a key or holds a
    value of the wrong type."""
    text = read_text(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}); the file is corrupt") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        if schema is not None:
            schema.validate_python(data, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        if first["type"] == "missing":
            raise ValueError(f"{path}: key {key} is missing; the file is corrupt") from None
        expected = first["msg"].removeprefix("Input should be ")
        raise ValueError(f"{path}: {key}={first['input']!r} is invalid; expected {expected}") from None
    return data
