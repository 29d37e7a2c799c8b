"""Files written whole or not at all, and JSON objects read with one-line errors.

Every file gptlab writes goes through `atomic_write_text` (or `atomic_write_dir` for a directory of files):
the content goes to a temporary name in the same directory, is fsynced, then renamed over the target, and the
rename itself is made durable by fsyncing the directory. A crash, a full disk or a kill at any moment leaves
either the old file or the new one, never a truncated one, and the temporary leftovers are hidden (`.name.tmp-*`).
What is written gets the mode `open()` and `mkdir()` would give it under the umask (not mkstemp's 0600).

A directory replaces an older one in a single step (Linux's `renameat2(RENAME_EXCHANGE)` swaps the two, so there
is no moment without one; elsewhere two renames), and only when gptlab wrote the older one too: every directory
written here holds a small marker file (`MARKER`), and a directory without it is refused rather than deleted.

A failed write (a full disk, a read-only folder) is a one-line `GptlabError` naming the target; for a full disk
it says how much space the write needed and how much is free. Reads name the file too: `read_json_object`, and
`safetensors_problem`, which finds a truncated or foreign safetensors file from its header before a loader's
own error (or a torch size-mismatch dump) could.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError

MARKER = ".gptlab"  # in every directory atomic_write_dir writes: "gptlab wrote this, it may replace it"
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def is_gptlab_output(directory: Path) -> bool:
    """Whether gptlab wrote `directory` (it holds the marker file)."""
    return (Path(directory) / MARKER).is_file()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def write_error(target: Path, e: OSError, needed: int | None = None) -> GptlabError:
    """A one-line error for an OSError met while writing `target` (for a full disk: the space needed, the space
    free)."""
    try:
        free_bytes: int | None = shutil.disk_usage(target.parent).free
    except OSError:
        free_bytes = None
    # a buffered writer (gguf's) reports a full disk as a short write, "N requested and M written", with no errno
    short_write_on_full_disk = e.errno is None and free_bytes is not None and free_bytes < 1 << 20
    if e.errno in (errno.ENOSPC, errno.EDQUOT) or short_write_on_full_disk:
        free = f", {human_bytes(free_bytes)} free" if free_bytes is not None else ""
        need = f" needs about {human_bytes(needed)}" if needed else ""
        return GptlabError(f"no space left on the device of {target.parent}: writing {target.name}{need}{free}; "
                           f"nothing was replaced (free some space and run again)")
    return GptlabError(f"cannot write {target}: {e.strerror or e}")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2); False where the system or filesystem can't."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


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


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only set it: setting and
    restoring races with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_file(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Have `write(tmp)` create a file at a temporary path beside `path`, then fsync it and rename it over
    `path`: a crash leaves the old file or the new one, never half of one."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as e:
        raise write_error(path, e) from None
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it 0600: give it the mode open() would
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a UTF-8 text file through a temporary file, fsync and rename."""
    atomic_write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    """`obj` as a JSON file (newline-terminated), atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def atomic_write_dir(
    target: str | Path, write: Callable[[Path], None], *, needed: int | None = None, replace_unmarked: bool = False
) -> Path:
    """Fill a fresh temporary directory with `write(tmp)`, fsync every file, then put it at `target`.

    A crash at any point leaves either the previous `target` or the new one, never a half-written one or none.
    An existing `target` that gptlab did not write (no MARKER) is refused unless `replace_unmarked` (a run's
    own checkpoints). `needed` (bytes, if known) goes into the message of a full disk.
    """
    target = Path(target)
    if target.is_dir() and any(target.iterdir()) and not is_gptlab_output(target) and not replace_unmarked:
        raise GptlabError(f"{target} exists and was not written by gptlab (it has no {MARKER} file): refusing to "
                          "replace it; remove it yourself or choose another path")
    if target.exists() and not target.is_dir():
        raise GptlabError(f"{target} is a file, not a directory: choose another path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700: give it the mode mkdir() would
    except OSError as e:
        raise write_error(target, e, needed) from None
    try:
        write(tmp)
        (tmp / MARKER).write_text('{"written_by": "gptlab"}\n')
        file_mode = 0o666 & ~current_umask()
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, file_mode)  # safetensors (like mkstemp) makes its files 0600 whatever the umask
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if not target.exists():
            os.replace(tmp, target)
        elif _exchange(tmp, target):  # tmp now holds the previous target
            fsync_dir(target.parent)
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # no atomic swap here: move the old one aside, then the new one in (a short window without)
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(target.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_error(target, e, needed) from None
        raise
    return target


def check_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """An output directory that can be made: not empty text, not an existing file, not under a file."""
    text = str(path)
    if not text.strip():
        raise GptlabError(f"{flag} is empty: name the directory to write")
    out = Path(text).expanduser()
    if out.exists() and not out.is_dir():
        raise GptlabError(f"{flag} {out} is a file, not a directory: choose another path")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise GptlabError(f"{flag} {out}: {parent} is a file, not a directory")
            break
    return out


def safetensors_problem(path: Path) -> str | None:
    """What makes `path` an unreadable safetensors file (missing, truncated, not safetensors), read from its
    header alone; None when it looks whole."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is {'empty' if size == 0 else 'truncated'} ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{path} is truncated or not a safetensors file (its header claims {n} bytes, it has {size})"
            header = parse_json(f.read(n))
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as e:
        return f"{path} cannot be read: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError):
        return f"{path} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return f"{path} is not a safetensors file (a garbled header)"
    if 8 + n + end != size:
        return f"{path} is truncated or damaged (its tensors need {8 + n + end} bytes, the file has {size})"
    return None


def read_utf8(path: str | Path) -> str:
    """The text of a UTF-8 file; a GptlabError naming the file (and the offset of a bad byte) otherwise."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise GptlabError(f"{path} not found") from None
    except OSError as e:
        raise GptlabError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise GptlabError(f"{path} is not UTF-8 text (bad byte at offset {e.start}, line {line})") from None


def parse_json(text: str | bytes) -> Any:
    """`json.loads`, with JSON nested too deeply for Python's parser (a RecursionError) a ValueError like any
    other bad JSON: every reader of a file catches ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_json_object(path: str | Path, hint: str = "") -> dict[str, Any]:
    """The JSON object in `path`; a GptlabError naming the file (and `hint`, what to do) if it is missing,
    unreadable, not JSON or not an object."""
    path = Path(path)
    suffix = f"; {hint}" if hint else ""
    try:
        data = parse_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GptlabError(f"{path} not found{suffix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise GptlabError(f"cannot read {path}: {e}{suffix}") from None
    if not isinstance(data, dict):
        raise GptlabError(f"{path} should hold a JSON object, not {type(data).__name__}{suffix}")
    return data


def read_toml(path: str | Path, missing: str = "") -> dict[str, Any]:
    """The TOML document in `path`; a GptlabError naming the file (and `missing`, what to do, when it is not there)
    if it is missing, not UTF-8 or not TOML."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    path = Path(path)
    if not path.is_file():
        raise GptlabError(f"{path} not found{f' ({missing})' if missing else ''}")
    try:
        return tomllib.loads(read_utf8(path))
    except tomllib.TOMLDecodeError as e:
        raise GptlabError(f"{path} is not valid TOML: {e}") from None
    except RecursionError:  # arrays nested thousands deep
        raise GptlabError(f"{path} is not valid TOML: nested too deeply") from None


def json_digest(value: Any) -> str:
    """16 hex digits of the sha256 of `value` as sorted JSON (values JSON cannot hold as their str): a short key
    for what a cached result or a run depends on."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_json_or_empty(path: str | Path) -> dict[str, Any]:
    """A JSON object whose loss costs nothing (caches of measurements gptlab takes again: hardware.json,
    kernels.json; a model card's recipe); {} for a file missing, unreadable or damaged in any way."""
    try:
        data = parse_json(Path(path).read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
