"""gptlab's C++ Linear kernels, for every build this machine can execute (`gptlab.kernels.kernel_builds()`: AVX2,
AVX2 + AVX-VNNI, AVX-512, AMX; a build that is absent here is skipped): each against float64 matmuls (int4: against
llama.cpp's q8_0 rounding of the activations computed here from the maths), and the builds against each other on
the same packed weights (one layout: int8/int4 to the bit, bf16/fp32 within fp32 rounding). The AMX build's tiles
(products of TILE_ROWS rows or more) multiply x in bf16 by bf16 and int4 weights widened to bf16: they are checked
against that product; int8 weights on its byte products keep the other builds' 16-bit fixed-point x, their integer
sums exact to the end: checked against that from the maths, and against the other builds to the bit where those
sum in one block.

Tolerances: the kernel accumulates in fp32 and rounds once, so fp32 outputs are within ~1e-5 of float64 (relative
to the largest output) and bf16 ones within one bf16 rounding (2**-8 relative)."""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.integer_weights import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from gptlab.kernels import avx512_ops, cpu_has_avx512, emulated_builds, kernel_builds

pytestmark = pytest.mark.usefixtures("one_thread")
BUILDS = ["avx2", "avxvnni", "avx512", "amx"]
# the AMX build's tiles take products of this many rows of x or more, by the weight's kind (amx_tiles.h)
TILE_ROWS = {"bfloat16": 8, "int8": 6, "int4": 24}


def on_tiles(ops, x: torch.Tensor, mode: str) -> bool:  # noqa: ANN001
    """Whether `ops` runs the product of x with a `mode` weight on AMX tiles: the AMX build, enough rows of x (in
    bf16, or in fp32 for integer weights), whole tile steps of 32 inputs."""
    x = x.reshape(-1, x.shape[-1])
    return (ops is kernel_builds().get("amx") and (x.dtype == torch.bfloat16 or mode != "bfloat16")
            and x.shape[0] >= TILE_ROWS[mode] and x.shape[1] % 32 == 0)


def tiles(ops, x: torch.Tensor, mode: str) -> bool:  # noqa: ANN001
    """Whether the product runs on the tiles' bf16 dot products: the weight widened to bf16 and x rounded to bf16
    (bf16 and int4 weights; int8 ones keep the fixed-point numbers of the other kernels: amx_tiles.h)."""
    return mode != "int8" and on_tiles(ops, x, mode)


@pytest.fixture(scope="module")
def builds() -> dict:
    return kernel_builds()


@pytest.fixture(scope="module", params=BUILDS)
def ops(request, builds):  # noqa: ANN001, ANN201
    """One build of the kernels, or a skip saying it is not available here."""
    if request.param not in builds:
        pytest.skip(f"gptlab's {request.param} kernels are not available here (CPU, compiler, or the build failed: "
                    "see the warning)")
    return builds[request.param]


@pytest.fixture(scope="module")
def two(builds):  # noqa: ANN001, ANN201
    if len(builds) < 2:
        pytest.skip(f"only {list(builds)} built here: nothing to compare")
    return list(builds.values())


def test_the_emulated_builds_are_those_the_cpu_lacks_and_need_simde(monkeypatch) -> None:  # noqa: ANN001
    import gptlab.kernels as kernels

    monkeypatch.delenv(kernels.EMULATE_ENV, raising=False)
    assert kernels.emulated_builds() == frozenset()  # none unless asked for
    monkeypatch.setenv(kernels.EMULATE_ENV, "1")
    monkeypatch.setattr(kernels, "avxvnni_ops", lambda: "the native build")
    monkeypatch.setattr(kernels, "avx512_ops", lambda: None)
    monkeypatch.setattr(kernels, "amx_ops", lambda: None)
    assert kernels.emulated_builds() == {"avx512", "amx"}
    monkeypatch.setattr(kernels, "simde_found", lambda: False)
    monkeypatch.setattr(kernels, "cpu_has_avx2", lambda: True)
    kernels.emulated_ops.cache_clear()
    with pytest.warns(UserWarning, match="libsimde-dev"):
        assert kernels.emulated_ops("avx512") is None
    kernels.emulated_ops.cache_clear()


def test_builds_are_named_and_share_one_layout(builds) -> None:  # noqa: ANN001
    assert set(builds) <= set(BUILDS)
    if "avx512" in builds and "avx512" not in emulated_builds():
        assert cpu_has_avx512() and avx512_ops() is builds["avx512"]
    W = torch.randn(37, 31)
    q, scale, zero = quantize_int4(torch.randn(37, 64), 32)
    for a, b in itertools.combinations(builds.values(), 2):
        assert all(torch.equal(a.pack(W.to(dt)), b.pack(W.to(dt))) for dt in (torch.float32, torch.bfloat16))
        assert torch.equal(a.pack_int8(quantize_int8(W[:, :30])[0]), b.pack_int8(quantize_int8(W[:, :30])[0]))
        pa, pb = a.pack_int4(q, scale, zero), b.pack_int4(q, scale, zero)
        assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    for ops in builds.values():
        assert hasattr(ops, "decode_step")


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 20), N=st.integers(1, 70), K=st.integers(1, 70), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), x_fp32=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_matches_a_float64_matmul(ops, M: int, N: int, K: int, bias: bool,  # noqa: ANN001
                                         dtype: torch.dtype, x_fp32: bool, seed: int) -> None:
    """Any shape (panels padded, row tiles of 1-6, an odd K's last column, the k tails) gives x @ W.T + b to one
    rounding of x's dtype; bf16 weights also take fp32 inputs."""
    g = torch.Generator().manual_seed(seed)
    W, x = torch.randn(N, K, generator=g).to(dtype), torch.randn(M, K, generator=g).to(dtype)
    x = x.float() if x_fp32 else x
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    y = ops.linear(x, ops.pack(W), None, b, N)
    ref = x.double() @ W.double().T + (b.double() if bias else 0)
    assert y.dtype == x.dtype and y.shape == (M, N)
    tol = 2**-8 if x.dtype == torch.bfloat16 else 1e-5
    assert (y.double() - ref).abs().max() <= tol * max(ref.abs().max().item(), 1.0)


def test_kernel_keeps_leading_dims_and_reads_fp32_bias_under_bf16(ops) -> None:  # noqa: ANN001
    W = torch.randn(40, 24).bfloat16()
    x = torch.randn(2, 3, 24).bfloat16()
    b = torch.randn(40)
    y = ops.linear(x, ops.pack(W), None, b, 40)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    ref = x.double() @ W.double().T + b.double()
    assert (y.double() - ref).abs().max() <= 2**-8 * ref.abs().max()


def quantized(mode: str, W: torch.Tensor, group: int, ops) -> tuple:  # noqa: ANN001
    """(packed, qparams, the dequantized weight) of W in `mode`, packed by `ops`"""
    if mode == "int8":
        q, scale = quantize_int8(W)
        return ops.pack_int8(q), scale, dequantize_int8(q, scale)
    q, scale, zero = quantize_int4(W, group)
    return *ops.pack_int4(q, scale, zero), dequantize_int4(q, scale, zero)


def int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) rounded as the int4 kernel rounds its activations (llama.cpp's q8_0 way), from the maths: per block of
    32 inputs d = max|x| / 127 and xq = round(x * (127 / max|x|)) in fp32 (ties to even), |xq| <= 127. Returns (xq
    (M, K / 32, 32) int64, d (M, K / 32) float64)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1)
    # a tensor divided by a tensor: `127.0 / top` multiplies by top's reciprocal, another rounding than C++'s 127 / top
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    xq = (blocks * inv[..., None]).round().clamp(-127, 127)
    return xq.long(), (top / 127).double()


def int4_q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """y = x @ W.T for int4 W = q * s + (zero - 8 s) per group, x in int8 blocks: each block's integer dot products
    exact (int64), then the scales in float64."""
    xq, d = int8_blocks(x)
    n, k = q.shape
    qb = q.long().reshape(n, k // 32, 32)
    dots = torch.einsum("mbk,nbk->mnb", xq, qb).double() * d[:, None, :]  # (M, N, blocks), each d_b * sum q xq
    sums = xq.sum(-1).double() * d  # (M, blocks): d_b * sum xq
    per_group = k // scale.shape[1] // 32
    s, low = scale.double(), (zero - 8 * scale).double()
    qx = dots.reshape(*dots.shape[:2], -1, per_group).sum(-1)  # (M, N, G)
    mx = sums.reshape(sums.shape[0], -1, per_group).sum(-1)  # (M, G)
    return (qx * s[None] + mx[:, None, :] * low[None]).sum(-1)


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 20), N=st.integers(1, 70), blocks=st.integers(1, 24), group=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), spread=st.floats(0.0, 6.0), seed=st.integers(0, 2**16))
def test_int4_kernel_equals_q8_activations_from_the_maths(ops, M: int, N: int, blocks: int, group: int,  # noqa: ANN001
                                                          dtype: torch.dtype, spread: float, seed: int) -> None:
    """int4 weights against x rounded to int8 per block of 32 (int8_blocks): the kernel's integer sums are exact
    and only its fp32 scaling rounds, so it is within a few fp32 roundings of the float64 reference on the same
    integers (then one rounding to x's dtype). Row tiles of 1-8, padded panels, groups of 1-4 blocks; `spread`
    gives blocks of very different magnitudes (a block of zeros among them)."""
    g = torch.Generator().manual_seed(seed)
    K = group * max(1, blocks * 32 // group)
    W = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g) * torch.exp(spread * torch.randn(M, K // 32, 1, generator=g)).repeat_interleave(
        32, 1).reshape(M, K)
    if blocks % 3 == 0:
        x[:, :32] = 0
    x = x.to(dtype)
    b = torch.randn(N, generator=g)
    q, scale, zero = quantize_int4(W, group)
    y = ops.linear(x, *ops.pack_int4(q, scale, zero), b, N)
    assert y.dtype == dtype and y.shape == (M, N)
    if tiles(ops, x, "int4"):  # the tiles' product: checked in test_amx_tiles_multiply_the_weight_widened_to_bf16
        assert_tiles_product(y, x, dequantize_int4(q, scale, zero), b)
        return
    ref = int4_q8_reference(x, q, scale, zero) + b.double()
    xq, d = int8_blocks(x)
    # what fp32 rounding scales with: the sum of |terms| (each block's scaled dot, each group's offset term)
    magnitude = (xq.abs().double() * d[..., None]).reshape(M, K) @ dequantize_int4(q, scale, zero).abs().double().T
    bound = 1e-5 * magnitude + b.double().abs() * 2**-23 + (2**-8 * ref.abs() if dtype == torch.bfloat16 else 0)
    assert bool(((y.double() - ref).abs() <= bound + 1e-30).all())


def test_int4_kernel_rounds_each_block_apart_and_keeps_nan() -> None:
    """A block's scale is its own (a huge block beside a tiny one loses nothing of the tiny one), and a NaN in a
    block makes the outputs NaN, as a float product's would be."""
    for ops in kernel_builds().values():
        q, scale, zero = quantize_int4(torch.randn(16, 64), 32)
        packed, qparams = ops.pack_int4(q, scale, zero)
        x = torch.cat([torch.full((1, 32), 1e4), torch.linspace(-1e-4, 1e-4, 32)[None]], 1)
        ref = int4_q8_reference(x, q, scale, zero)
        assert torch.allclose(ops.linear(x, packed, qparams, None, 16).double(), ref, rtol=1e-5)
        x[0, 40] = float("nan")
        assert bool(ops.linear(x, packed, qparams, None, 16).isnan().all())


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 14), N=st.integers(1, 70), K=st.integers(1, 72), group=st.sampled_from([32, 64]),
       mode=st.sampled_from(["int8", "int4"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_integer_kernels_equal_the_dequantized_weight_in_float64(ops, M: int, N: int, K: int, group: int,  # noqa: ANN001
                                                                  mode: str, dtype: torch.dtype, seed: int) -> None:
    """int8 (row scales) and int4 (nibbles, a scale and zero per group of 32 or 64 columns) through the kernel:
    the dequantized weight (the quantize module's own formula) times x in 16-bit fixed point (int8) or int8 blocks
    of 32 (int4), within that rounding's bound, rounded once to x's dtype. Row tiles, padded panels, int8's blocks
    of 256 column pairs (K up to 720) and the pair loops' tails are all reached."""
    g = torch.Generator().manual_seed(seed)
    K = (K % 12 + 1) * group if mode == "int4" else K * 10  # int4: whole groups; int8: even widths
    W, x, b = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g).to(dtype), torch.randn(N, generator=g)
    packed, qparams, dense = quantized(mode, W, group, ops)
    y = ops.linear(x, packed, qparams, b, N)
    assert y.dtype == dtype and y.shape == (M, N)
    if tiles(ops, x, mode):
        assert_tiles_product(y, x, dense, b)
        return
    ref = x.double() @ dense.double().T + b.double()
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    bound = tol * max(ref.abs().max().item(), 1.0)
    if mode == "int8":  # x rounded to 16-bit fixed point: each x[m, k] within max|x[m]| / 65534
        bound = bound + (x.double().abs().amax(dim=1, keepdim=True) / 65534) @ dense.double().abs().sum(1)[None]
    else:  # x rounded to int8 per block of 32: each x[m, k] within its block's max / 254 (and fp32's rounding)
        step = x.double().abs().reshape(M, -1, 32).amax(-1).repeat_interleave(32, 1) / 254 * (1 + 2**-20)
        bound = bound + step @ dense.double().abs().T
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_kernel_refuses_a_mismatched_input(ops) -> None:  # noqa: ANN001
    packed = ops.pack(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="input has 9 features, the weight 8"):
        ops.linear(torch.randn(1, 9), packed, None, None, 16)
    q, scale = quantize_int8(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="int8 and int4 weights take qparams"):
        ops.linear(torch.randn(1, 8), ops.pack_int8(q), None, None, 16)


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 13), N=st.integers(1, 70).map(lambda n: n | 1), K=st.integers(1, 72),
       group=st.sampled_from([32, 64, 128]), mode=st.sampled_from(["int8", "int4"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_builds_give_identical_integer_outputs(two, M: int, N: int, K: int, group: int, mode: str,  # noqa: ANN001
                                               dtype: torch.dtype, seed: int) -> None:
    """The same int8/int4 weight, packed once, through every build: the same int32 sums and the same fp32
    operations on them, so equal to the bit (odd N, int4 groups of 1-4 blocks, K past int8's 256-pair blocks)."""
    g = torch.Generator().manual_seed(seed)
    K = (K % 12 + 1) * group if mode == "int4" else K * 10
    W, x, b = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g).to(dtype), torch.randn(N, generator=g)
    packed, qparams, _ = quantized(mode, W, group, two[0])
    ys = [ops.linear(x, packed, qparams, b, N) for ops in two if not on_tiles(ops, x, mode)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    for ops in two:  # the AMX build's int8 tiles: one rounding of the exact sum, the others' one per 512 inputs
        if mode == "int8" and on_tiles(ops, x, mode):
            y = ops.linear(x, packed, qparams, b, N)
            if K <= 512:
                assert torch.equal(y, ys[0])
            else:
                assert torch.allclose(y.float(), ys[0].float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-5,
                                      atol=1e-5 * ys[0].float().abs().max().item())


def assert_tiles_product(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, b: torch.Tensor | None) -> None:
    """y is x (bf16) times the weight widened to bf16 (`dense` rounded once; an int4 weight's q * s + m may round
    to the neighbouring bf16 value where float32's fused and unfused forms differ), summed in fp32, plus the bias,
    rounded once to x's dtype."""
    wide, x = dense.bfloat16().double(), x.bfloat16().double()
    ref = x @ wide.T + (b.double() if b is not None else 0)
    magnitude = x.abs() @ wide.abs().T
    bound = x.shape[-1] * 2**-24 * magnitude + 2**-8 * ref.abs() + 2**-8 * (x.abs() @ dense.double().abs().T
                                                                           * (dense.dtype != torch.bfloat16))
    assert bool(((y.double() - ref).abs() <= bound + 1e-30).all())


@settings(max_examples=40, deadline=None)
@given(M=st.integers(0, 62), N=st.integers(1, 70), steps=st.integers(1, 8), group=st.sampled_from([32, 64]),
       mode=st.sampled_from(["bfloat16", "int4"]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_amx_tiles_multiply_the_weight_widened_to_bf16(builds, M: int, N: int, steps: int, group: int,  # noqa: ANN001
                                                       mode: str, bias: bool, seed: int) -> None:
    """The AMX build's tiles (TILE_ROWS rows of bf16 x or more; one or two A tiles, a partial last one
    zero-padded; odd panel counts; int4 groups of one or two tile steps): x times the weight widened to bf16 (bf16
    as packed, int4 q * s + m rounded once), summed in fp32, rounded once to bf16."""
    if "amx" not in builds:
        pytest.skip("no AMX build here (a CPU or OS without AMX tiles)")
    ops = builds["amx"]
    g = torch.Generator().manual_seed(seed)
    M += TILE_ROWS[mode]
    K = steps * group if mode == "int4" else steps * 32
    W, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g) if bias else None
    if mode == "bfloat16":
        packed, qparams, dense = ops.pack(W.bfloat16()), None, W.bfloat16()
    else:
        packed, qparams, dense = quantized(mode, W, group, ops)
    y = ops.linear(x, packed, qparams, b, N)
    assert tiles(ops, x, mode) and y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert_tiles_product(y, x, dense, b)


def int8_fixed_point_reference(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x @ q.T as the int8 kernels compute it, from the maths, before the weight's row scales: each row of x in
    16-bit fixed point (s = max|x| / 32767, xq = round(x * (32767 / max|x|)) in fp32, ties to even), the integer
    dot products with q exact (int64), rounded once to fp32, times s in fp32."""
    xf = x.float()
    top = xf.abs().amax(1, keepdim=True)
    full = torch.full_like(top, 32767.0)  # tensor by tensor: a true fp32 division, as C++'s
    inv = torch.where(top > 0, full / top, torch.zeros_like(top))
    s = torch.where(top > 0, top / full, torch.ones_like(top))
    xq = (xf * inv).round().clamp(-32767, 32767).long()
    return (xq @ q.long().T).float() * s


@settings(max_examples=40, deadline=None)
@given(M=st.integers(0, 40), N=st.integers(1, 70), steps=st.integers(1, 40), bias=st.booleans(),
       spread=st.floats(0.0, 8.0), seed=st.integers(0, 2**16))
def test_amx_int8_tiles_sum_the_fixed_point_products_exactly(builds, M: int, N: int, steps: int,  # noqa: ANN001
                                                             bias: bool, spread: float, seed: int) -> None:
    """The AMX build's int8 product (TILE_ROWS rows or more; partial row tiles, an odd panel count, K of whole and
    half tile steps up to 1280, past one int32 block): x in 16-bit fixed point split into a signed high and an
    unsigned low byte, each multiplied on the tiles, joined exactly: the integer sum of the maths rounded once,
    then the row scales and bias in fp32 (two roundings). Rows of very different magnitudes (`spread`)."""
    if "amx" not in builds:
        pytest.skip("no AMX build here (a CPU or OS without AMX tiles)")
    ops = builds["amx"]
    g = torch.Generator().manual_seed(seed)
    M, K = M + TILE_ROWS["int8"], steps * 32
    W = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g) * torch.exp(spread * torch.randn(M, 1, generator=g))
    b = torch.randn(N, generator=g) if bias else torch.zeros(N)
    q, scale = quantize_int8(W)
    y = ops.linear(x, ops.pack_int8(q), scale, b if bias else None, N)
    assert on_tiles(ops, x, "int8") and y.dtype == torch.float32 and y.shape == (M, N)
    t = int8_fixed_point_reference(x, q).double() * scale.double()
    ref = t + b.double()
    assert bool(((y.double() - ref).abs() <= 2**-23 * (t.abs() + b.double().abs()) + 1e-30).all())


def test_amx_int8_tiles_keep_nan_rows_and_zero_rows_apart(builds) -> None:  # noqa: ANN001
    """On the AMX build's int8 tiles (40 rows, two threads) a row with an inf gives no finite output, a row of zeros
    gives the bias, and every other row the bits the AVX-512 loops give it alone (K = 512: one block of exact sums
    for both)."""
    if "amx" not in builds:
        pytest.skip("no AMX build here (a CPU or OS without AMX tiles)")
    ops = builds["amx"]
    g = torch.Generator().manual_seed(3)
    W, x, b = torch.randn(33, 512, generator=g), torch.randn(40, 512, generator=g), torch.randn(33, generator=g)
    x[5, 100], x[7] = float("inf"), 0.0
    packed, qparams, _ = quantized("int8", W, 32, ops)
    torch.set_num_threads(2)  # the one_thread fixture restores the count after
    together = ops.linear(x, packed, qparams, b, 33)
    assert on_tiles(ops, x, "int8") and not on_tiles(ops, x[:1], "int8")
    assert not bool(together[5].isfinite().any()) and torch.equal(together[7], b)
    alone = torch.cat([ops.linear(x[m:m + 1], packed, qparams, b, 33) for m in range(40)])
    others = [m for m in range(40) if m != 5]
    assert torch.equal(together[others], alone[others])


@pytest.mark.parametrize("mode", ["bfloat16", "int8", "int4"])
def test_amx_tile_rows_do_not_depend_on_the_rows_beside_them_or_the_threads(builds, mode: str) -> None:  # noqa: ANN001
    """A row's tile sums are its own: 40 rows on two threads (each taking some of 7 panels, one of them paired with
    itself) give the bits of one thread, rows 8-31 alone (a block of 24: a whole A tile and a part of one, copied
    with zero padding) the bits they have among the 40, and rows 8-39 alone (32: bf16 x read in place) too."""
    if "amx" not in builds:
        pytest.skip("no AMX build here (a CPU or OS without AMX tiles)")
    ops = builds["amx"]
    g = torch.Generator().manual_seed(2)
    W, x = torch.randn(100, 256, generator=g), torch.randn(40, 256, generator=g).bfloat16()
    packed, qparams = (ops.pack(W.bfloat16()), None) if mode == "bfloat16" else quantized(mode, W, 32, ops)[:2]
    one = ops.linear(x, packed, qparams, None, 100)
    block, whole = ops.linear(x[8:32], packed, qparams, None, 100), ops.linear(x[8:40], packed, qparams, None, 100)
    torch.set_num_threads(2)  # the one_thread fixture restores the count after
    assert torch.equal(ops.linear(x, packed, qparams, None, 100), one) and torch.equal(block, one[8:32])
    assert torch.equal(whole, one[8:40])


def test_bf16_outputs_do_not_depend_on_how_the_threads_split_the_panels(ops) -> None:  # noqa: ANN001
    """AVX-512 takes bf16 panels two at a time; a thread's odd last panel must sum in the same order as a paired
    one: 5 panels split 3 + 2 over two threads give the bits that one thread gives (and each row's bits alone)."""
    g = torch.Generator().manual_seed(1)
    W, x = torch.randn(80, 2049, generator=g).bfloat16(), torch.randn(20, 2049, generator=g).bfloat16()
    packed = ops.pack(W)
    one = ops.linear(x, packed, None, None, 80)
    alone = torch.cat([ops.linear(x[m:m + 2], packed, None, None, 80)[:1] for m in range(19)])
    torch.set_num_threads(2)  # the one_thread fixture restores the count after
    assert torch.equal(ops.linear(x, packed, None, None, 80), one) and torch.equal(alone, one[:19])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_integer_kernels_round_each_row_alone_whatever_the_threads(ops, mode: str) -> None:  # noqa: ANN001
    """Each row of x is rounded to integers on its own, rows split over the threads when there are many: a row's
    output is the same to the bit in a 48-row call on two threads as alone on one; a row with an inf gives no
    finite output and leaves the others as they were; a row of zeros gives the bias (int8: K = 1030 reaches the
    8-wide tail)."""
    g = torch.Generator().manual_seed(0)
    K = 1024 if mode == "int4" else 1030
    W, x, b = torch.randn(40, K, generator=g), torch.randn(48, K, generator=g), torch.randn(40, generator=g)
    x[5, 100], x[7] = float("inf"), 0.0
    packed, qparams, _ = quantized(mode, W, 32, ops)
    # alone: one row a call, or on the AMX build's tiles as few rows as they take (a block of 24 or 12)
    step = TILE_ROWS[mode] if tiles(ops, x, mode) else 1
    alone = torch.cat([ops.linear(x[m:m + step], packed, qparams, b, 40) for m in range(0, 48, step)])
    torch.set_num_threads(2)  # the one_thread fixture restores the count after
    together = ops.linear(x, packed, qparams, b, 40)
    # an inf makes the integer kernels' row scale NaN, and the tiles' float sums +-inf: never a finite value
    assert not bool(together[5].isfinite().any()) and torch.equal(together[7], b)
    others = [m for m in range(48) if m != 5]
    assert torch.equal(together[others], alone[others])


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 13), N=st.integers(1, 70).map(lambda n: n | 1), K=st.integers(1, 300),
       w_dtype=st.sampled_from([torch.float32, torch.bfloat16]), x_dtype=st.sampled_from([torch.float32,
                                                                                           torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_builds_agree_on_float_weights_within_fp32_rounding(two, M: int, N: int, K: int,  # noqa: ANN001
                                                            w_dtype: torch.dtype, x_dtype: torch.dtype,
                                                            seed: int) -> None:
    """The same bf16/fp32 weight, packed once, through every build: the sums run in other orders (and bf16 x
    against bf16 weights through AVX-512 BF16 dot products), so fp32 outputs agree within fp32 rounding of the
    sums and bf16 outputs within one bf16 step of each other."""
    g = torch.Generator().manual_seed(seed)
    W, x = torch.randn(N, K, generator=g).to(w_dtype), torch.randn(M, K, generator=g).to(x_dtype)
    packed = two[0].pack(W)
    ys = [ops.linear(x, packed, None, None, N).double() for ops in two]
    scale = (x.double().abs() @ W.double().abs().T)  # the sum of |products|: what rounding errors scale with
    for y in ys[1:]:
        if x_dtype == torch.float32:
            assert bool(((y - ys[0]).abs() <= 2 * K * 2**-24 * scale + 1e-30).all())
        else:
            # one bf16 step apart at most: a step is up to 2**-7 of the value (its 8-bit significand)
            assert bool(((y - ys[0]).abs() <= 2**-7 * ys[0].abs() + 2 * K * 2**-24 * scale + 1e-30).all())


# ---------------------------------------------------------------------------------------------------------------
# The dispatch: which path runs each kind of weight, by measurement
# ---------------------------------------------------------------------------------------------------------------
def test_dispatch_picks_the_fastest_candidate_and_caches_it(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from gptlab.kernels import dispatch

    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPTLAB_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "kernel_builds", lambda: {"avx2": "A", "avx512": "B"})
    monkeypatch.setattr(dispatch, "emulated_builds", frozenset)
    monkeypatch.setattr(dispatch, "busy", lambda: False)
    calls = []
    times = {"torch": 2.0, "avx2": 3.0, "avx512": 1.0}
    monkeypatch.setattr(dispatch, "probe", lambda kind, names, rows: calls.append((kind, rows)) or dict(times))
    dispatch._measured.cache_clear()
    assert dispatch.choice("int8") == "avx512" and dispatch.chosen_ops("int8") == "B"
    dispatch._measured.cache_clear()  # a new process: read from kernels.json, not measured again
    assert dispatch.choice("int8") == "avx512" and calls == [("int8", 1)]
    assert dispatch.choice("int8", rows=20) == "avx512" and calls[-1] == ("int8", 32)  # large batches apart
    times.update(torch=0.95, avx512=1.0)  # a build within the margin keeps the one-call decode step
    assert dispatch.choice("float32") == "avx512"
    times.update(torch=0.5)
    assert dispatch.choice("bfloat16") == "torch" and dispatch.chosen_ops("bfloat16") is None
    monkeypatch.setenv("GPTLAB_KERNEL", "avx2")  # the override, for comparisons and tests
    assert dispatch.choice("bfloat16") == "avx2"
    monkeypatch.setenv("GPTLAB_KERNEL", "torch")
    assert dispatch.choice("int8") == "torch"
    monkeypatch.setattr(dispatch, "kernel_builds", dict)  # nothing built (no compiler, ARM, GPTLAB_NO_KERNELS)
    monkeypatch.setenv("GPTLAB_KERNEL", "avx2")
    assert dispatch.choice("int8") == "torch"
    dispatch._measured.cache_clear()


def test_the_dispatch_chooses_an_emulated_build_only_when_told_to(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Under GPTLAB_KERNEL_EMULATE=1 the builds the CPU lacks are there emulated, for the tests that force them;
    the probe never times one, and with nothing else built PyTorch's path runs."""
    from gptlab.kernels import dispatch

    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPTLAB_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "kernel_builds", lambda: {"avx2": "A", "avx512": "B"})
    monkeypatch.setattr(dispatch, "emulated_builds", lambda: frozenset({"avx512"}))
    monkeypatch.setattr(dispatch, "busy", lambda: False)
    probed = []
    monkeypatch.setattr(dispatch, "probe", lambda kind, names, rows: probed.append(names) or
                        {"torch": 2.0, "avx2": 1.0, "avx512": 0.1})
    dispatch._measured.cache_clear()
    assert dispatch.choice("int8") == "avx2" and probed == [("avx2",)]
    monkeypatch.setenv("GPTLAB_KERNEL", "avx512")
    assert dispatch.choice("int8") == "avx512" and dispatch.chosen_ops("int8") == "B"
    monkeypatch.delenv("GPTLAB_KERNEL")
    monkeypatch.setattr(dispatch, "emulated_builds", lambda: frozenset({"avx2", "avx512"}))
    assert dispatch.choice("int8") == "torch"
    dispatch._measured.cache_clear()


def test_a_probe_on_a_busy_machine_is_kept_until_a_run_finds_it_quiet(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Other work on the cores makes a probe measure the contention: its choice is kept as provisional, serves the
    runs that follow while the machine stays busy (none probes again), and the first run on a quiet machine probes
    again and keeps that for good."""
    import json

    from gptlab.hardware import PROVISIONAL
    from gptlab.kernels import dispatch

    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPTLAB_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "kernel_builds", lambda: {"avx2": "A"})
    monkeypatch.setattr(dispatch, "emulated_builds", frozenset)
    calls = []
    monkeypatch.setattr(dispatch, "probe", lambda kind, names, rows: calls.append(kind) or {"torch": 2.0, "avx2": 1.0})
    for load, probes, provisional in ((64.0, 1, True), (64.0, 1, True), (0.1, 2, False), (0.1, 2, False),
                                      (64.0, 2, False)):
        monkeypatch.setattr(dispatch.os, "getloadavg", lambda load=load: (load, load, load))
        dispatch._measured.cache_clear()  # a new process
        assert dispatch.choice("int8") == "avx2"
        cached = json.loads((tmp_path / dispatch.CACHE_FILE).read_text())
        assert len(calls) == probes
        assert any(key.startswith(PROVISIONAL) for key in cached) == provisional
    dispatch._measured.cache_clear()


def test_a_cpu_of_the_same_name_with_other_flags_is_measured_again(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A cloud VM names a Zen 4 and a Zen 5 alike ("AMD EPYC"), and a home directory outlives the machine: the
    cached choice is one of this CPU's flags too."""
    from gptlab import hardware
    from gptlab.kernels import dispatch

    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPTLAB_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "kernel_builds", lambda: {"avx2": "A"})
    monkeypatch.setattr(dispatch, "emulated_builds", frozenset)
    monkeypatch.setattr(dispatch, "busy", lambda: False)
    monkeypatch.setattr(hardware, "cpu_name", lambda: "AMD EPYC")
    calls = []
    monkeypatch.setattr(dispatch, "probe", lambda kind, names, rows: calls.append(kind) or {"torch": 2.0, "avx2": 1.0})
    for flags in ({"avx2", "fma"}, {"avx2", "fma"}, {"avx2", "fma", "avx512f"}):
        monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: frozenset(flags))
        dispatch._measured.cache_clear()  # a new process on this machine
        assert dispatch.choice("int8") == "avx2"
    assert calls == ["int8", "int8"]  # the second machine of the same flags read the first one's choice
    dispatch._measured.cache_clear()


@pytest.mark.parametrize("kind", ["bfloat16", "float32", "int8", "int4"])
def test_probe_times_every_candidate(builds, kind: str, monkeypatch) -> None:  # noqa: ANN001
    """The probe runs each path on real products (a path that failed would raise here) and times it."""
    from gptlab.kernels import dispatch

    monkeypatch.setattr(dispatch, "_working_set", lambda: 2**20)  # a small probe for the test
    times = dispatch.probe(kind, tuple(builds), rounds=1, calls=1, rows=3)
    assert set(times) == {"torch", *builds} and all(t > 0 for t in times.values())


def test_a_candidate_far_behind_after_the_first_round_sits_out_the_others(monkeypatch) -> None:  # noqa: ANN001
    """A path SURE_LOSS times slower than the leader in the first round cannot be chosen: it is not timed again
    (its passes were most of a probe's time), and its time stays its first round's."""
    from gptlab.kernels import dispatch

    monkeypatch.setattr(dispatch, "kernel_builds", lambda: {"near": "near", "far": "far"})
    monkeypatch.setattr(dispatch, "emulated_builds", frozenset)
    monkeypatch.setattr(dispatch, "_working_set", lambda: 1)  # one copy of each shape
    seconds = {"torch": 0.01, "near": 0.01, "far": 0.05}  # (sleeps: level ones stay level under load)
    calls = collections.Counter()

    def product(name: str):  # noqa: ANN202 - a () -> None
        def run() -> None:
            calls[name] += 1
            time.sleep(seconds[name])
        return run

    monkeypatch.setattr(dispatch, "_torch_product", lambda kind, weight, x: product("torch"))
    monkeypatch.setattr(dispatch, "_build_product", lambda ops, kind, weight, x: product(ops))
    times = dispatch.probe("float32", ("near", "far"), rounds=3, calls=2)
    shapes = len(dispatch._SHAPES)
    assert calls["torch"] == calls["near"] == 3 * 2 * shapes  # every round
    assert calls["far"] == 2 * shapes  # the first round only
    assert times["far"] >= dispatch.SURE_LOSS * min(times["torch"], times["near"])


@pytest.mark.parametrize(("sizes", "want_mib"), [
    (["48K", "2048K", "32768K"], 128),  # four times a 32 MiB last-level cache
    (["32K", "512K"], 64),  # at least 64 MiB
    (["48K", "2048K", "491520K"], 512),  # a virtual machine reporting its host's whole cache: capped
    ([], 64),  # no sysfs cache listing
])
def test_the_probe_streams_four_times_the_cache_within_bounds(tmp_path, sizes, want_mib) -> None:  # noqa: ANN001
    from gptlab.kernels import dispatch

    for i, size in enumerate(sizes):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert dispatch._working_set(tmp_path) == want_mib * 2**20


# ---------------------------------------------------------------------------------------------------------------
# Building: a killed build leaves nothing that blocks or crashes the next run
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_build(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """cpp_extension's load replaced by one that writes a "library" (no compiler runs); returns its calls."""
    import torch.utils.cpp_extension as cpp

    from gptlab.kernels import build

    calls = []

    def load(name: str, **kw) -> None:  # noqa: ANN003
        assert not (tmp_path / name / "lock").exists(), "a stale lock would make load wait for ever"
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / f"{name}.so").write_bytes(b"library " + name.encode())
        calls.append(name)

    monkeypatch.setattr(cpp, "load", load)
    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    monkeypatch.setattr(build, "_open", lambda library: calls.append(f"open {library.name}"))
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def test_the_sources_are_dealt_to_unity_files_once_each_and_not_rewritten(tmp_path) -> None:  # noqa: ANN001
    """A build compiles a unity file per core, each including some of the sources: every source in exactly one, the
    files about as large as whole sources allow, and a second build of the same sources leaves them untouched (a
    rewritten file would make ninja compile it again)."""
    from gptlab.kernels import SOURCES
    from gptlab.kernels.build import unity_sources

    made = unity_sources(SOURCES, tmp_path, 2)
    included = [Path(line.split('"')[1]) for unity in made for line in unity.read_text().splitlines()]
    assert len(made) == 2 and sorted(included) == sorted(s.resolve() for s in SOURCES)
    sizes = [sum(Path(line.split('"')[1]).stat().st_size for line in unity.read_text().splitlines()) for unity in made]
    assert max(sizes) - min(sizes) <= max(s.stat().st_size for s in SOURCES)
    for unity in made:
        os.utime(unity, ns=(10**9, 10**9))
    assert unity_sources(SOURCES, tmp_path, 2) == made
    assert all(unity.stat().st_mtime_ns == 10**9 for unity in made)
    assert len(unity_sources(SOURCES, tmp_path / "many", 64)) == len(SOURCES)  # at most one a source
    assert len(unity_sources(SOURCES, tmp_path / "one", 1)) == 1


@pytest.mark.slow  # four compiler passes over every source: ~40 s
@pytest.mark.parametrize("build", BUILDS)
def test_every_builds_sources_compile_as_one_unity_file(build: str, tmp_path) -> None:  # noqa: ANN001
    """Every build's sources compile together in one translation unit, whichever CPU runs the test: the code under
    an AVX-512 or AMX guard too, which only such a CPU builds (names at namespace scope must differ between
    sources)."""
    import shutil
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    import gptlab.kernels as kernels
    from gptlab.kernels.build import unity_sources

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    flags = {"avx2": kernels.AVX2_FLAGS, "avxvnni": kernels.AVXVNNI_FLAGS, "avx512": kernels.AVX512_FLAGS,
             "amx": kernels.AMX_FLAGS}[build]
    (unity,) = unity_sources(kernels.SOURCES, tmp_path, 1)
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    done = subprocess.run(["c++", "-std=c++20", "-fsyntax-only", "-fPIC", "-DTORCH_EXTENSION_NAME=gptlab_unity",
                           *kernels._COMMON_FLAGS, *flags, *includes, str(unity)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_extra_flags_reach_the_compiler_and_the_linker_and_name_another_build(monkeypatch) -> None:  # noqa: ANN001
    """GPTLAB_KERNEL_CFLAGS (coverage, sanitizers) goes to both and into the build's name: the usual build stays."""
    import gptlab.kernels as kernels

    seen = []

    def load(name: str, sources: list, cflags: list[str], ldflags: list[str]) -> None:
        seen.append((name, cflags, ldflags))
        raise RuntimeError("no build in this test")

    monkeypatch.setattr(kernels, "load_library", load)
    monkeypatch.setattr(kernels.shutil, "which", lambda _: "/usr/bin/c++")
    monkeypatch.delenv(kernels.EXTRA_FLAGS_ENV, raising=False)
    with pytest.warns(UserWarning, match="no build in this test"):
        assert kernels._build("gptlab_avx2", "AVX2", kernels.AVX2_FLAGS) is None
    monkeypatch.setenv(kernels.EXTRA_FLAGS_ENV, "--coverage  -O1")
    with pytest.warns(UserWarning, match="no build in this test"):
        kernels._build("gptlab_avx2", "AVX2", kernels.AVX2_FLAGS)
    (usual, usual_cflags, usual_ldflags), (covered, cflags, ldflags) = seen
    assert usual != covered and cflags == [*usual_cflags, "--coverage", "-O1"]
    assert ldflags == [*usual_ldflags, "--coverage", "-O1"]


def test_a_stale_build_lock_is_removed_and_the_library_checksummed(tmp_path, fake_build) -> None:  # noqa: ANN001
    from gptlab.kernels.build import CHECKSUM, load_library

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "lock").write_text("")  # left by a build killed with Ctrl-C
    load_library("lib", [], [], [])
    assert fake_build == ["lib"] and (tmp_path / "lib" / CHECKSUM).is_file()
    load_library("lib", [], [], [])  # a good cached build is opened as it is, without cpp_extension's load
    assert fake_build == ["lib", "open lib.so"]
    assert (tmp_path / "lib" / "lib.so").read_bytes() == b"library lib"


def test_a_library_cut_short_is_built_again(tmp_path, fake_build) -> None:  # noqa: ANN001
    from gptlab.kernels.build import load_library

    load_library("lib", [], [], [])
    (tmp_path / "lib" / "lib.so").write_bytes(b"libr")  # truncated: a build killed while it linked
    (tmp_path / "lib" / "object.o").write_bytes(b"")
    load_library("lib", [], [], [])
    assert fake_build == ["lib", "lib"]  # the recorded library no longer matches its checksum: not opened
    assert not (tmp_path / "lib" / "object.o").exists()  # the directory was made anew
    assert (tmp_path / "lib" / "lib.so").read_bytes() == b"library lib"


def test_a_built_library_loads_without_importing_cpp_extension(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The first process that loads a built library records it; the next opens it without importing
    torch.utils.cpp_extension (setuptools: ~0.15 s of every run's start-up)."""
    import subprocess
    import sys

    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("no gptlab kernel build on this machine")
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))  # no record yet
    script = ("import sys; from gptlab.kernels import widest_ops\n"
              "assert widest_ops() is not None\nprint('torch.utils.cpp_extension' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)]
    assert runs == ["True", "False"]


def test_the_build_lock_dies_with_its_holder(tmp_path) -> None:  # noqa: ANN001
    import subprocess
    import sys
    import time

    from gptlab.kernels.build import held

    lock = tmp_path / "x.gptlab-lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from gptlab.kernels.build import held\n"
                               f"with held(__import__('pathlib').Path({str(lock)!r})):\n"
                               "    print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # SIGKILL mid-build
    holder.wait()
    t = time.monotonic()
    with held(lock):
        assert time.monotonic() - t < 5
