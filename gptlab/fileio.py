"""Files written whole or not at all, and JSON objects read with one-line errors.

Every file gptlab writes goes through `atomic_write_text` (or `atomic_write_dir` for a directory of files):
the content goes to a temporary name in the same directory, is fsynced, then renamed over the target, and the
rename itself is made durable by fsyncing the directory. A crash, a full disk or a kill at any moment leaves
either the old file or the new one, never a truncated one, and the temporary leftovers are hidden (`.name.tmp-*`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (no-op where directories can't be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_file(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Have `write(tmp)` create a file at a temporary path beside `path`, then fsync it and rename it over
    `path`: a crash leaves the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a UTF-8 text file through a temporary file, fsync and rename."""
    atomic_write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    """`obj` as a JSON file (newline-terminated), atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def atomic_write_dir(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Fill a fresh temporary directory with `write(tmp)`, fsync every file, then rename it to `target`.

    A crash at any point leaves either the previous `target` or the new one, never a half-written one.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if target.exists():  # replace: move the old one aside first so the rename itself is atomic
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read_json_object(path: str | Path, hint: str = "") -> dict[str, Any]:
    """The JSON object in `path`; a GptlabError naming the file (and `hint`, what to do) if it is missing,
    unreadable, not JSON or not an object."""
    path = Path(path)
    suffix = f"; {hint}" if hint else ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GptlabError(f"{path} not found{suffix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise GptlabError(f"cannot read {path}: {e}{suffix}") from None
    if not isinstance(data, dict):
        raise GptlabError(f"{path} should hold a JSON object, not {type(data).__name__}{suffix}")
    return data
