"""Building a kernel library once per machine, safely: `torch.utils.cpp_extension.load` under a lock that dies with
its holder, and a checksum of the library it made.

`load` guards a build with a lock file of its own (`lock` in the build directory) that a killed build leaves behind:
every later run then waited on it for ever (Ctrl-C during the first `gptlab sample`'s build was enough). Here the
build runs under an advisory lock (`fcntl.flock`) that the kernel releases when its holder dies, so while we hold it
a leftover `lock` file can only be stale, and it is removed. A build cut short can also leave a truncated library,
which crashed the process that loaded it: a build that completes records the library's sha256 beside it, and a
library without a matching record is built again before it is loaded.

Importing `torch.utils.cpp_extension` (setuptools, packaging) takes ~0.15 s, a fifth of a tiny model's training
run once torch is in. So a completed build is also recorded in gptlab's cache directory (the library's path, under
the build's name, which changes with every source, flag and torch version), and later processes open the library
straight from there while its checksum still matches, without importing cpp_extension at all.

The sources compile as a few unity files, each including several of them (`unity_sources`), as many as the machine
has cores: every translation unit parses ATen's and the op registry's headers (~9 s of a core each), and with one
per source those took most of a build (the AVX2 build's 14 sources on a 2-core Zen 3: 91 s, and 22 s as two unity
files). So names at a source's namespace scope (its anonymous namespace included) must differ between sources.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_text
from gptlab.hardware import cache_dir, usable_cores

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


def unity_sources(sources: list[Path], directory: Path, count: int) -> list[Path]:
    """`count` unity files in `directory` (at most one per source), each including some of `sources` by absolute
    path (their own includes still resolve beside them), the sources dealt largest first to the file with the
    fewest bytes so far: about as much to compile in each. Rewritten only where their text changes."""
    groups: list[list[Path]] = [[] for _ in range(max(1, min(count, len(sources))))]
    size = [0] * len(groups)
    bytes_of = {source: source.stat().st_size for source in sources}
    for source in sorted(sources, key=lambda s: (-bytes_of[s], s.name)):
        i = size.index(min(size))
        groups[i].append(source)
        size[i] += bytes_of[source]
    directory.mkdir(parents=True, exist_ok=True)
    made = []
    for i, group in enumerate(groups):
        unity = directory / f"unity_{i}.cpp"
        text = "".join(f'#include "{source.resolve().as_posix()}"\n' for source in sorted(group))
        if not unity.is_file() or unity.read_text() != text:
            unity.write_text(text)
        made.append(unity)
    return made


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record(name: str) -> Path:
    """Where the path of build `name`'s library is kept once it is built."""
    return cache_dir() / "kernels" / f"{name}.library"


def _open(library: Path) -> None:
    import torch

    torch.ops.load_library(str(library))


def _built(library: Path) -> bool:
    """Whether `library` is a completed build: its checksum recorded beside it and matching."""
    checksum = library.parent / CHECKSUM
    return library.is_file() and checksum.is_file() and checksum.read_text().strip() == _digest(library)


def load_library(name: str, sources: list[Path], cflags: list[str], ldflags: list[str]) -> None:
    """Build (or load the cached build of) the library `name` from `sources` and load it into this process: its
    operators then appear under torch.ops. Raises what the build raises."""
    record = _record(name)
    with contextlib.suppress(OSError):
        library = Path(record.read_text().strip())
        if _built(library):
            _open(library)
            return
    from torch.utils.cpp_extension import _get_build_directory, load

    build_dir = Path(_get_build_directory(name, False))
    with held(build_dir.parent / f"{name}.gptlab-lock"):
        (build_dir / "lock").unlink(missing_ok=True)  # torch's own lock: we hold the build's, so it is stale
        library, checksum = build_dir / f"{name}.so", build_dir / CHECKSUM
        if library.exists() and (not checksum.exists() or checksum.read_text().strip() != _digest(library)):
            shutil.rmtree(build_dir)  # a build cut short: make it again rather than load half a library
        if not library.exists():  # a pause of a minute or so deserves a word, once per machine
            print(f"gptlab: building its C++ kernels for this CPU ({name}), once per machine: under a minute",
                  file=sys.stderr, flush=True)
        units = unity_sources(sources, build_dir / "unity", usable_cores())
        load(name=name, sources=[str(s) for s in units], is_python_module=False, verbose=False,
             extra_cflags=cflags, extra_ldflags=ldflags)
        if library.exists() and not checksum.exists():
            checksum.write_text(_digest(library) + "\n")
    if _built(library):
        with contextlib.suppress(GptlabError):  # a read-only cache: later processes import cpp_extension again
            atomic_write_text(record, str(library) + "\n")
