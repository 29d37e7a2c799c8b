"""This machine: which device `--device auto` picks."""

from __future__ import annotations

import pytest
import torch

from gptlab import hardware


@pytest.mark.parametrize(("cuda", "mps", "mps_runs", "want"), [
    (True, True, True, "cuda"),
    (False, True, True, "mps"),
    (False, True, False, "cpu"),  # listed but unusable (a VM without Metal): the CPU
    (False, False, False, "cpu"),
])
def test_auto_picks_cuda_then_a_working_mps_then_the_cpu(cuda: bool, mps: bool, mps_runs: bool, want: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    real_ones = torch.ones

    def ones(*args, device=None, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202 - torch.ones, with "mps" faked
        if device == "mps":
            if not mps_runs:
                raise RuntimeError("MPS backend out of order")
            device = "cpu"
        return real_ones(*args, device=device, **kw)

    monkeypatch.setattr(torch, "ones", ones)
    assert hardware.resolve_device("auto") == want
