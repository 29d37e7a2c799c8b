"""Where the offline test data lives: ``shared/data`` beside the repository (CI clones it there too).

Importing this module also points tiktoken at the cached GPT-2 files, so no test needs the network.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TINY_SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
GPT2_FILES = SHARED_DATA / "gpt2"  # encoder.json + vocab.bpe: OpenAI's original GPT-2 BPE files
TIKTOKEN_CACHE = SHARED_DATA / "tiktoken_cache"

os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
