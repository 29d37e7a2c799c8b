"""Public corpora gptlab fetches by name: tiny Shakespeare, downloaded once into a cache and sha256-checked.

`gptlab prepare shakespeare` reads it from the cache (GPTLAB_DATA_DIR, else ~/.cache/gptlab/data) and downloads
it only when it is missing or wrong; offline, a one-line error says where to put the file, or to pass a local one.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import urllib.request
from pathlib import Path

from gptlab.errors import GptlabError

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_BYTES = 1_115_394
SHAKESPEARE_FILE = "tinyshakespeare.txt"
DATA_DIR_ENV = "GPTLAB_DATA_DIR"
BLOCK_BYTES = 1 << 20  # read and download size


def data_cache_dir() -> Path:
    """Where downloaded corpora live: $GPTLAB_DATA_DIR, else ~/.cache/gptlab/data."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gptlab" / "data"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            h.update(block)
    return h.hexdigest()


def _download(url: str, dest: Path) -> None:
    """Stream `url` into `dest` (tests replace this to simulate being offline)."""
    with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
        while block := r.read(BLOCK_BYTES):
            f.write(block)


def fetch_shakespeare(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of tiny Shakespeare in the cache, downloading it (atomically, hash-checked) only if missing."""
    cache = Path(cache_dir) if cache_dir is not None else data_cache_dir()
    path = cache / SHAKESPEARE_FILE
    if path.is_file() and path.stat().st_size == SHAKESPEARE_BYTES:  # the size first: hashing costs more
        if _sha256_file(path) == SHAKESPEARE_SHA256:
            return path
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{SHAKESPEARE_FILE}.{os.getpid()}.part"
    print(f"downloading tiny Shakespeare to {path}", file=sys.stderr)
    try:
        try:
            _download(SHAKESPEARE_URL, tmp)
        except (OSError, http.client.HTTPException, ValueError) as e:  # URLError is an OSError
            reason = getattr(e, "reason", None) or e
            raise GptlabError(
                f"could not download tiny Shakespeare ({reason}); offline? put {SHAKESPEARE_FILE} in {cache} "
                f"({DATA_DIR_ENV} names another folder), or pass a local text file instead, "
                "e.g. `gptlab prepare path/to/input.txt --tokenizer char --out data/shakespeare`"
            ) from e
        digest = _sha256_file(tmp)
        if digest != SHAKESPEARE_SHA256:
            raise GptlabError(
                f"downloaded tiny Shakespeare has sha256 {digest}, expected {SHAKESPEARE_SHA256}; "
                "try again or pass a local copy of the file"
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
