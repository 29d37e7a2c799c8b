"""`gptlab.linear`: the model's Linear, whose products in training on a CPU run in the orientation measured faster.
Both orientations against F.linear (values and every gradient, with and without bias, frozen weights), the choice
kept per machine, and the Linear still what quantization and inference packing take."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import linear


@pytest.mark.parametrize("transposed", [False, True], ids=["as written", "transposed"])
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 70), bias=st.booleans(),
       frozen=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 1000))
def test_oriented_products_are_f_linear(transposed: bool, rows: int, k: int, n: int, bias: bool, frozen: bool,
                                       bf16: bool, seed: int) -> None:
    """In either orientation for every product (whatever this machine would choose), the output and the gradients
    of x, the weight (unless frozen, as under LoRA) and the bias against F.linear's autograd: fp32 within rounding
    of a reordered sum, bf16 within bf16's rounding."""
    with (mock.patch.object(linear, "transposed_is_faster", lambda a, b, role: transposed),
          mock.patch.object(linear, "_MIN_PRODUCT", 0)):
        _against_f_linear(rows, k, n, bias, frozen, bf16, seed)


def _against_f_linear(rows: int, k: int, n: int, bias: bool, frozen: bool, bf16: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(2, rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    up = torch.randn(2, rows, n, generator=g).to(dtype)
    grads = []
    for run in (linear.linear, F.linear):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_(not frozen)
        bs = None if b is None else b.clone().requires_grad_()
        y = run(xs, ws, bs)
        assert ("Oriented" in type(y.grad_fn).__name__) == (run is linear.linear)  # the Function ran
        y.backward(up)
        grads.append([y.detach(), xs.grad, ws.grad, None if bs is None else bs.grad])
    tol = dict(rtol=2e-2, atol=2e-2 * (k**0.5)) if bf16 else dict(rtol=1e-5, atol=1e-5 * k)
    for name, ours, theirs in zip(["y", "x", "weight", "bias"], *grads, strict=True):
        if theirs is None:
            assert ours is None, name
            continue
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and ours.is_contiguous(), name
        torch.testing.assert_close(ours, theirs, **tol, msg=name)


def test_a_choice_is_measured_once_per_machine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Products big enough to matter are timed once; the choice lands in products.json and a later process (a
    fresh memo) reads it instead of timing again. Small products are never timed."""
    import gptlab.hardware

    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gptlab.hardware, "busy", lambda: False)  # a busy machine's probe is used, not kept
    monkeypatch.setattr(linear, "_chosen", {})
    monkeypatch.setattr(linear, "_MIN_PRODUCT", 1 << 12)
    timed = []
    monkeypatch.setattr(linear, "_seconds", lambda run, calls=3: timed.append(1) or (1.0 if len(timed) % 2 else 0.5))
    a, b = torch.randn(32, 16), torch.randn(16, 24)
    assert linear.transposed_is_faster(a, b, "forward")  # as written 1.0 s, transposed 0.5
    assert len(timed) == 2
    stored = json.loads((tmp_path / "products.json").read_text())
    assert list(stored.values()) == [True] and "forward|32x16x24|nn|float32" in next(iter(stored))
    monkeypatch.setattr(linear, "_chosen", {})
    assert linear.transposed_is_faster(a, b, "forward")
    assert len(timed) == 2  # read back, not timed
    assert not linear.transposed_is_faster(torch.randn(4, 4), torch.randn(4, 4), "forward")
    assert len(timed) == 2


def test_inference_and_frozen_inputs_keep_f_linear() -> None:
    layer = linear.Linear(8, 4)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.requires_grad_(False)
    assert layer(x).grad_fn is None or "Oriented" not in type(layer(x).grad_fn).__name__


def test_the_models_linears_are_plain_for_quantization_and_packing() -> None:
    class Adapted(nn.Linear):  # as LoRA's: a forward that does more than the product
        pass

    assert linear.plain_linear(linear.Linear(4, 4)) and linear.plain_linear(nn.Linear(4, 4))
    assert not linear.plain_linear(Adapted(4, 4))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 100), cols=st.integers(1, 100), bf16=st.booleans())
def test_every_builds_transpose_is_torchs(build_name: str, rows: int, cols: int, bf16: bool) -> None:
    """The blocked transpose that lays a transposed product back: x.t().contiguous() exactly, for any shape (whole
    blocks of 32 and the ragged edges)."""
    from gptlab.kernels import kernel_builds

    x = torch.randn(rows, cols).to(torch.bfloat16 if bf16 else torch.float32)
    y = kernel_builds()[build_name].transpose_copy(x)
    assert y.is_contiguous() and torch.equal(y, x.t().contiguous())
