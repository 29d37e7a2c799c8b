"""QLoRA's int4 dequantization in C++ (gptlab/kernels/dequantize_int4.cpp), for every build this machine runs:
to the bit against the maths in float64 (q * scale + low is exact there, and its one rounding to fp32, then to
bf16, is what the fp32 multiply-add and cast make), and `FrozenQuantizedLinear.dequantize` through it equal to its
ATen ops on any block of rows and whole groups of columns. Under ATEN_CPU_CAPABILITY=avx2 the ATen side runs
other code: the same numbers are expected."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gptlab import qlora
from gptlab.integer_weights import pack_nibbles
from gptlab.kernels import kernel_builds
from gptlab.qlora import FrozenQuantizedLinear

BUILDS = ["avx2", "avxvnni", "avx512"]


@pytest.fixture(scope="module", params=BUILDS)
def ops(request):  # noqa: ANN001, ANN201
    builds = kernel_builds()
    if request.param not in builds:
        pytest.skip(f"gptlab's {request.param} kernels are not available here")
    return builds[request.param]


def random_int4(rows: int, cols: int, group: int, log_scale: float, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q in [0, 15] (rows, cols), packed bytes, fp16 scale, fp16 low end) drawn at random."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = (torch.rand(rows, cols // group, generator=g) * 10.0**log_scale + 1e-3).half()
    low = (torch.randn(rows, cols // group, generator=g) * 10.0**log_scale).half()
    return q, pack_nibbles(q), scale, low


def from_the_maths(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    exact = q.double() * scale.double().repeat_interleave(group, 1) + low.double().repeat_interleave(group, 1)
    return exact.float().to(dtype)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 4), group=st.sampled_from([32, 64, 128, 256, 6]),
       log_scale=st.floats(-6, 2), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 999))
def test_the_kernel_is_the_maths_rounded_once(ops, rows, groups, group, log_scale, dtype, seed) -> None:  # noqa: ANN001
    """Any group width (multiples of 16 run the vector code, others the scalar loop), any scale's magnitude."""
    q, packed, scale, low = random_int4(rows, groups * group, group, log_scale, seed)
    out = torch.full((rows, groups * group), float("nan"), dtype=dtype)
    ops.dequantize_int4(packed, scale, low, out)
    assert torch.equal(out, from_the_maths(q, scale, low, dtype))


def test_the_kernel_reads_and_writes_strided_rows(ops) -> None:  # noqa: ANN001
    """Views of a block (rows and whole groups of a wider weight) in and a row-strided view out, as qlora passes."""
    q, packed, scale, low = random_int4(24, 256, 32, 0.0, 1)
    out = torch.zeros(24, 200, dtype=torch.bfloat16)
    ops.dequantize_int4(packed[5:20, 32:96], scale[5:20, 2:6], low[5:20, 2:6], out[3:18, 10:138])
    assert torch.equal(out[3:18, 10:138], from_the_maths(q[5:20, 64:192], scale[5:20, 2:6], low[5:20, 2:6],
                                                         torch.bfloat16))
    assert not out[:3].any() and not out[18:].any() and not out[:, :10].any() and not out[:, 138:].any()


def test_the_kernel_refuses_mismatched_shapes_and_dtypes(ops) -> None:  # noqa: ANN001
    _, packed, scale, low = random_int4(4, 64, 32, 0.0, 2)
    for args in [(packed, scale, low, torch.empty(4, 64, dtype=torch.float16)),
                 (packed, scale.float(), low, torch.empty(4, 64)),
                 (packed, scale, low, torch.empty(4, 62)),
                 (packed, scale, low, torch.empty(64, 4).t())]:
        with pytest.raises(RuntimeError, match="dequantize_int4"):
            ops.dequantize_int4(*args)


def int4_layer(rows: int, cols: int, weight_scale: float = 1.0) -> FrozenQuantizedLinear:
    torch.manual_seed(0)
    linear = nn.Linear(cols, rows, bias=False)
    with torch.no_grad():
        linear.weight.mul_(weight_scale)
    return FrozenQuantizedLinear(linear, "int4", 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(slice(None), slice(None)), (slice(7, 50), slice(None)),
                                            (slice(None), slice(64, 160)), (slice(3, 4), slice(32, 64))])
def test_the_layer_dequantizes_through_the_kernel_as_through_aten(dtype, rows, cols, monkeypatch) -> None:  # noqa: ANN001
    if not kernel_builds():
        pytest.skip("no kernel build here")
    layer = int4_layer(64, 192)
    called = []
    native = qlora._native_dequantize_int4
    monkeypatch.setattr(qlora, "_native_dequantize_int4", lambda *a: called.append(1) or native(*a))
    got = layer.dequantize(dtype, rows=rows, cols=cols)
    assert called and native(layer, got) is not None
    monkeypatch.setattr(qlora, "_native_dequantize_int4", lambda *a: None)
    assert torch.equal(got, layer.dequantize(dtype, rows=rows, cols=cols))
    with pytest.raises(ValueError, match="whole groups"):
        layer.dequantize(dtype, cols=slice(16, 64))


def test_fp32_scales_and_other_dtypes_keep_the_aten_ops() -> None:
    """Weights beyond fp16's range keep fp32 scales, whose product with q the kernel does not round as ATen does."""
    wide, plain = int4_layer(16, 64, weight_scale=1e6), int4_layer(16, 64)
    assert wide.scale.dtype == torch.float32 and plain.scale.dtype == torch.float16
    assert qlora._native_dequantize_int4(wide, torch.empty(16, 64)) is None
    assert qlora._native_dequantize_int4(plain, torch.empty(16, 64, dtype=torch.float16)) is None
    assert qlora._native_dequantize_int4(plain, torch.empty(64, 16).t()) is None
