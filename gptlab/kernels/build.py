"""Building a kernel library once per machine, safely: `torch.utils.cpp_extension.load` under a lock that dies with
its holder, and a checksum of the library it made.

`load` guards a build with a lock file of its own (`lock` in the build directory) that a killed build leaves behind:
every later run then waited on it for ever (Ctrl-C during the first `gptlab sample`'s build was enough). Here the
build runs under an advisory lock (`fcntl.flock`) that the kernel releases when its holder dies, so while we hold it
a leftover `lock` file can only be stale, and it is removed. A build cut short can also leave a truncated library,
which crashed the process that loaded it: a build that completes records the library's sha256 beside it, and a
library without a matching record is built again before it is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; torch's own lock file stays the only guard
    fcntl = None

CHECKSUM = "gptlab-library.sha256"


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (made if missing) for the block; released by the OS if the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_library(name: str, sources: list[Path], cflags: list[str], ldflags: list[str]) -> None:
    """Build (or load the cached build of) the library `name` from `sources` and load it into this process: its
    operators then appear under torch.ops. Raises what the build raises."""
    from torch.utils.cpp_extension import _get_build_directory, load

    build_dir = Path(_get_build_directory(name, False))
    with held(build_dir.parent / f"{name}.gptlab-lock"):
        (build_dir / "lock").unlink(missing_ok=True)  # torch's own lock: we hold the build's, so it is stale
        library, checksum = build_dir / f"{name}.so", build_dir / CHECKSUM
        if library.exists() and (not checksum.exists() or checksum.read_text().strip() != _digest(library)):
            shutil.rmtree(build_dir)  # a build cut short: make it again rather than load half a library
        load(name=name, sources=[str(s) for s in sources], is_python_module=False, verbose=False,
             extra_cflags=cflags, extra_ldflags=ldflags)
        if library.exists() and not checksum.exists():
            checksum.write_text(_digest(library) + "\n")
