"""Test set-up shared by every test: offline tokenizer files, and fixtures several test files use."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from helpers import TIKTOKEN_CACHE, TINY_SHAKESPEARE

os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))  # no test needs the network
# probes (MFU, which kernel runs a Linear) measure under whatever else the test machine runs: not the user's cache
os.environ.setdefault("GPTLAB_CACHE_DIR", tempfile.mkdtemp(prefix="gptlab-test-cache-"))


@pytest.fixture(scope="module")
def gpt2():  # noqa: ANN201
    """tiktoken's GPT-2 tokenizer (from the offline cache)."""
    from gptlab.tokenizer import GPT2Tokenizer

    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def shakespeare_bpe():  # noqa: ANN201
    """A 600-token byte-level BPE trained on the first 200k characters of tiny Shakespeare."""
    from gptlab.tokenizer import HFTokenizer

    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    return HFTokenizer.train((text[i : i + 10_000] for i in range(0, len(text), 10_000)), vocab_size=600)


@pytest.fixture(scope="module")
def one_thread():  # noqa: ANN201
    """Tiny models run fastest on one thread (no OpenMP hand-offs, and no spinning against other processes on a
    busy machine); the previous setting is restored after. Modules use it with `pytestmark`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
