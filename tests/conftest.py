"""Test set-up shared by every test: offline tokenizer files, and fixtures several test files use."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from helpers import GPT2_SKIP_REASON, corpus_text, tiktoken_has_gpt2

# One scratch folder for the session, removed when it ends (a test run leaves nothing in /tmp but pytest's own
# tmp_path folders, which pytest rotates).
_SCRATCH = tempfile.mkdtemp(prefix="gptlab-tests-")
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)
# probes (MFU, which kernel runs a Linear) measure under whatever else the test machine runs: not the user's cache
os.environ.setdefault("GPTLAB_CACHE_DIR", os.path.join(_SCRATCH, "cache"))
# torchrun's --log-dir (it reads PET_* variables): without one, every torchrun makes a torchelastic_* folder in /tmp
# and never removes it
os.environ.setdefault("PET_LOG_DIR", os.path.join(_SCRATCH, "torchrun"))
# helpers points TIKTOKEN_CACHE_DIR at shared/data/tiktoken_cache where that exists. No test uses the network:
# where tiktoken's gpt2 files are not cached, the tests that need them skip, and a load that slips through fails
# at once instead of downloading.
_OFFLINE_GPT2 = tiktoken_has_gpt2()


@pytest.fixture(autouse=True, scope="session")
def _no_tiktoken_downloads():  # noqa: ANN202
    if _OFFLINE_GPT2:
        yield
        return
    import tiktoken.load

    def refuse(url: str) -> bytes:
        raise ConnectionError(f"the tests make no network request (tiktoken asked for {url}): {GPT2_SKIP_REASON}")

    before = tiktoken.load.read_file
    tiktoken.load.read_file = refuse
    yield
    tiktoken.load.read_file = before


@pytest.fixture(scope="module")
def gpt2():  # noqa: ANN201
    """tiktoken's GPT-2 tokenizer (from the offline cache; the test skips where that lacks it)."""
    from gptlab.tokenizer import GPT2Tokenizer

    if not _OFFLINE_GPT2:
        pytest.skip(GPT2_SKIP_REASON)

    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def corpus_bpe():  # noqa: ANN201
    """A 600-token byte-level BPE trained on 200k characters of the test corpus."""
    from gptlab.tokenizer import HFTokenizer

    text = corpus_text(200_000)
    return HFTokenizer.train((text[i : i + 10_000] for i in range(0, len(text), 10_000)), vocab_size=600)


@pytest.fixture(scope="module")
def one_thread():  # noqa: ANN201
    """Tiny models run fastest on one thread (no OpenMP hand-offs, and no spinning against other processes on a
    busy machine); the previous setting is restored after. Modules use it with `pytestmark`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["avx2", "avxvnni", "avx512", "amx"])
def build_name(request: pytest.FixtureRequest) -> str:
    """Each of gptlab's kernel builds this machine runs (built once per machine, cached); a skip saying why where
    a build is not there. Under GPTLAB_KERNEL_EMULATE=1 the builds the CPU lacks run emulated (slower), so an AVX2
    machine tests every build's code."""
    from gptlab.kernels import kernel_builds

    if request.param not in kernel_builds():
        pytest.skip(f"gptlab's {request.param} kernels do not run here (the CPU lacks them, no C++ compiler, or "
                    "the build failed: see the warning; GPTLAB_KERNEL_EMULATE=1 emulates them)")
    return request.param


@pytest.fixture
def on_kernel(build_name: str, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """That build made the dispatch's choice for the test, whichever one it would pick here."""
    from gptlab.kernels import kernel_builds

    monkeypatch.setenv("GPTLAB_KERNEL", build_name)
    return kernel_builds()[build_name]
