"""The GPU and multi-process logic of training, tested on a CPU: CUDA functions mocked, torch's fake process
group playing rank r of many, and the pure functions that split a batch over processes. Real 2-process gloo runs
(torchrun) are in test_train.py."""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path

import pytest
import torch

from gptlab.errors import GptlabError
from gptlab.train.distributed import shard_model
from gptlab.train.optim import OptimizerSpec, build_optimizers
from gptlab.train.setup import check_dtype, resolve_dtype

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs").glob("*.toml"))


# --- B6: bf16 only where the GPU has bf16 units -----------------------------------------------------------------
@pytest.fixture
def gpu(monkeypatch):
    """A fake CUDA GPU whose compute capability the test sets; is_bf16_supported() says yes, as torch's default
    (including_emulation=True) does on sm70/75."""
    state = {"capability": (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", None)
    return state


@pytest.mark.parametrize(("capability", "auto"), [((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((7, 5), "float16"),
                                                  ((7, 0), "float16"), ((6, 1), "float32")])
def test_auto_dtype_on_gpus(gpu, capability: tuple[int, int], auto: str) -> None:
    gpu["capability"] = capability
    assert resolve_dtype("auto", "cuda") == auto
    assert resolve_dtype("auto", "cuda:1") == auto
    if auto == "bfloat16":
        check_dtype("bfloat16", "cuda")
    else:  # V100/T4 only emulate bf16: refused, with what to use instead
        with pytest.raises(GptlabError, match=r"^dtype bfloat16: this GPU \(sm\d+\) has no bfloat16 units.*float16"):
            check_dtype("bfloat16", "cuda")
    check_dtype("float16", "cuda")


def test_float16_on_a_gpu_trains_with_a_grad_scaler() -> None:
    """What auto picks on sm70/75: Precision adds loss scaling to fp16 autocast."""
    from gptlab.config import GPTConfig
    from gptlab.model import GPT
    from gptlab.train.precision import Precision

    model = GPT(GPTConfig.preset("tiny", n_embd=16, n_head=2, n_kv_head=2, block_size=8, vocab_size=32))
    with pytest.warns(UserWarning) if not torch.cuda.is_available() else contextlib.nullcontext():
        precision = Precision(model, "float16", "cuda", attention_fp32=True, distributed=False)
    assert precision.mode == "autocast" and precision.scaler is not None


# --- B11: torch too old for what the recipe asks ----------------------------------------------------------------
def test_torch_floor_and_one_line_errors_below_it(monkeypatch) -> None:
    assert '"torch>=2.9"' in (REPO / "pyproject.toml").read_text()  # torch.optim.Muon is 2.9's
    from gptlab.config import GPTConfig
    from gptlab.model import GPT

    model = GPT(GPTConfig.preset("tiny", n_embd=16, n_head=2, n_kv_head=2, block_size=8, vocab_size=32))
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(GptlabError, match=r"^optimizer_impl \"torch\" with optimizer muon needs torch >= 2\.9"):
        build_optimizers(model, OptimizerSpec(kind="muon", impl="torch"))
    build_optimizers(model, OptimizerSpec(kind="muon", impl="gptlab"))  # BatchedMuon needs no torch.optim.Muon
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", types.ModuleType("torch.distributed.fsdp"))
    with pytest.raises(GptlabError, match=r"^distributed = \"fsdp\" needs torch >= 2\.6"):
        shard_model(model)


