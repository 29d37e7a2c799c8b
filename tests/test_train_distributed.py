"""The GPU and multi-process logic of training, tested on a CPU: CUDA functions mocked, torch's fake process
group playing rank r of many, and the pure functions that split a batch over processes. Real 2-process gloo runs
(torchrun) are in test_train.py."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from gptlab.errors import GptlabError
from gptlab.train.distributed import shard_model
from gptlab.train.optim import OptimizerSpec, build_optimizers

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs").glob("*.toml"))


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


