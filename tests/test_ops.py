"""The model's kernels against torch's: the chunked cross-entropy against F.cross_entropy (values and gradients,
every reduction, ignored targets), the fp32 path for low-precision linears against an fp32 matmul rounded once,
and the fused fp32 LoRA layer against the layer's plain path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptlab import ops
from gptlab.lora import LoRALinear, LoRASpec


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), vocab=st.integers(2, 300), ignored=st.floats(0, 1), seed=st.integers(0, 10_000),
       reduction=st.sampled_from(["mean", "sum", "none"]))
def test_cross_entropy_equals_torchs(n: int, vocab: int, ignored: float, seed: int, reduction: str) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignored] = -1
    targets[0] = 0  # at least one counted target: the mean over none is NaN in both
    ours = ops.cross_entropy(logits, targets, reduction=reduction)
    theirs = F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    weights = torch.randn(theirs.shape, generator=g)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    (g_theirs,) = torch.autograd.grad((theirs * weights).sum(), logits)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-6)


def test_cross_entropy_of_bf16_logits_is_computed_in_fp32() -> None:
    logits = torch.randn(64, 1000).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (64,))
    expected = F.cross_entropy(logits.float(), targets)
    torch.testing.assert_close(ops.cross_entropy(logits, targets), expected, rtol=0, atol=1e-6)


def test_cross_entropy_gradient_of_wide_bf16_logits_over_chunks() -> None:
    """The gradient made in the forward (softmax minus one-hot, stored in bf16, scaled in backward) against the
    fp64 gradient: GPT-2's 50,257-wide rows over several row chunks, ignored targets, a per-row weight. bf16 keeps
    8 bits: two roundings (the stored softmax, the scaled result) stay within 2^-7 of each entry."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(100, 50257, generator=g) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50257, (100,), generator=g)
    targets[::7] = -1
    assert len(list(ops.row_chunks(100, 50257, logits.device))) > 1
    weights = torch.rand(100, generator=g) + 0.5
    ours = ops.cross_entropy(logits, targets, reduction="none")
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits, retain_graph=True)
    (again,) = torch.autograd.grad((ours * weights).sum(), logits)  # backward leaves its saved gradient as it was
    ref = logits.detach().double().requires_grad_()
    theirs = F.cross_entropy(ref, targets, ignore_index=-1, reduction="none")
    (g_theirs,) = torch.autograd.grad((theirs * weights.double()).sum(), ref)
    torch.testing.assert_close(ours.double(), theirs, rtol=0, atol=1e-5)
    assert g_ours.dtype == torch.bfloat16 and torch.equal(g_ours, again)
    torch.testing.assert_close(g_ours.double(), g_theirs, rtol=2**-7, atol=1e-9)
    assert not g_ours[::7].any()  # ignored rows: no gradient at all


def test_cross_entropy_without_gradient_is_the_same_loss() -> None:
    """Under no_grad (evaluation) the forward skips the gradient; the loss is the same."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(30, 3000, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 3000, (30,), generator=g)
    with torch.no_grad():
        plain = ops.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(plain, ops.cross_entropy(logits, targets, reduction="none"), rtol=0, atol=2e-6)



@pytest.fixture
def native_xent(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ cross-entropy (gptlab.kernels) for logits of any size; skipped where it cannot be built."""
    from gptlab.kernels import avx2_ops, avx512_ops

    if avx512_ops() is None and avx2_ops() is None:
        pytest.skip("no gptlab kernel build on this machine")
    monkeypatch.setattr(ops, "_NATIVE_XENT_MIN", 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 24), vocab=st.integers(1, 3000), ignored=st.floats(0, 1), seed=st.integers(0, 10_000),
       bf16=st.booleans(), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_native_cross_entropy_equals_torchs_in_fp64(native_xent: None, n: int, vocab: int, ignored: float, seed: int,
                                                    bf16: bool, reduction: str) -> None:
    """The C++ kernel's loss and gradient against F.cross_entropy in fp64 on the same values: any width (the
    vectorized lanes' remainders), ignored rows, every reduction, a per-row weight or one scale for all rows."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 4).to(torch.bfloat16 if bf16 else torch.float32)
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignored] = -1
    targets[0] = vocab - 1
    assert ops._native_softmax_xent(logits, False) is not None
    ours = ops.cross_entropy(logits, targets, reduction=reduction)
    ref = logits.detach().double().requires_grad_()
    theirs = F.cross_entropy(ref, targets, ignore_index=-1, reduction=reduction)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=1e-5)
    weights = torch.rand(theirs.shape, generator=g, dtype=torch.float64) + 0.5
    (g_ours,) = torch.autograd.grad((ours * weights.float()).sum() * 0.3, logits)
    (g_theirs,) = torch.autograd.grad((theirs * weights).sum() * 0.3, ref)
    # fp32: a few ulps of the fp32 exp and sums; bf16: the stored gradient and its scaled result each rounded once
    tol = dict(rtol=2**-7, atol=1e-9) if bf16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_ours.double(), g_theirs, **tol)
    assert not g_ours[targets == -1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cross_entropy_matches_the_chunked_ops(native_xent: None, monkeypatch: pytest.MonkeyPatch,
                                                      dtype: torch.dtype) -> None:
    """GPT-2's 50,257-wide rows: the kernel and the ATen chunks give the same losses (fp32 sums in another order)
    and bf16 gradients equal but for the rare entry that lands on the other side of a rounding boundary."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(40, 50257, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 50257, (40,), generator=g)
    targets[::5] = -1

    def loss_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
        loss = ops.cross_entropy(logits, targets, reduction="sum") / 7
        return loss.detach(), torch.autograd.grad(loss, logits)[0]

    native = loss_and_grad()
    monkeypatch.setattr(ops, "_native_softmax_xent", lambda logits, training: None)
    chunked = loss_and_grad()
    torch.testing.assert_close(native[0], chunked[0], rtol=1e-6, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(native[1], chunked[1], rtol=1e-5, atol=1e-9)
    else:
        differ = native[1] != chunked[1]
        assert differ.float().mean() < 1e-4
        torch.testing.assert_close(native[1][differ].float(), chunked[1][differ].float(), rtol=2**-7, atol=1e-9)


def test_small_logits_take_the_kernel_in_training_only() -> None:
    """A character model's 65-word logits: in training the kernel (one op for ~12; the library is loaded for the
    attention already), outside it ATen's chunks (a small evaluation need not load the library)."""
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("no gptlab kernel build on this machine")
    logits = torch.randn(2048, 65)
    assert ops._native_softmax_xent(logits, True) is not None
    assert ops._native_softmax_xent(logits, False) is None


def test_native_cross_entropy_keeps_non_finite_rows_non_finite(native_xent: None) -> None:
    """A NaN or +inf logit makes its row's loss (and so the step's) non-finite, as in torch, so that the trainer
    skips the step; a -inf logit off the target is a word of probability 0 and leaves the row finite."""
    logits = torch.randn(4, 300)
    logits[0, 5], logits[1, 7], logits[2, 9] = float("nan"), float("inf"), float("-inf")
    targets = torch.tensor([1, 2, 3, 4])
    ours = ops.cross_entropy(logits, targets, reduction="none")
    theirs = F.cross_entropy(logits, targets, reduction="none")
    assert ours[:2].isnan().all() and not theirs[:2].isfinite().any()
    torch.testing.assert_close(ours[2:], theirs[2:])

@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), vocab=st.integers(1, 2100), seed=st.integers(0, 10_000), bf16=st.booleans(),
       pad=st.sampled_from([0, 1, 63, 200]))
def test_every_builds_cross_entropy_is_the_maths_in_fp64(build_name: str, n: int, vocab: int, seed: int,
                                                         bf16: bool, pad: int) -> None:
    """Each build's kernel (8 lanes a vector in the AVX2 builds, 16 in the AVX-512 ones; any width, so every
    remainder) against log-sum-exp and softmax minus the one-hot in fp64, an ignored row included; the logits'
    rows contiguous or `pad` elements apart (`ops.split_product`'s padded rows), the gradient's rows as far apart
    as theirs, or contiguous where the logits are a few columns of much wider rows."""
    from gptlab.kernels import kernel_builds

    g = torch.Generator().manual_seed(seed)
    stored = (torch.randn(n, vocab + pad, generator=g) * 4).to(torch.bfloat16 if bf16 else torch.float32)
    stored[:, vocab:] = float("nan")  # the padding is never read
    logits = stored[:, :vocab]
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[n // 2] = -1
    losses, grad = kernel_builds()[build_name].softmax_xent(logits, targets, True)
    ref, ignored = logits.double(), targets < 0
    want = ref.logsumexp(-1) - ref.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    want_grad = ref.softmax(-1) - F.one_hot(targets.clamp(min=0), vocab).double()
    want[ignored], want_grad[ignored] = 0.0, 0.0
    torch.testing.assert_close(losses.double(), want, rtol=1e-6, atol=1e-5)
    assert grad.dtype == logits.dtype and grad.stride(1) == 1
    assert n == 1 or grad.stride(0) == (vocab + pad if pad < 128 else vocab)
    # bf16: the stored value rounded once; fp32: the target's entry p - 1 carries p's error, a few ulps of 1
    tol = dict(rtol=2**-8, atol=1e-9) if bf16 else dict(rtol=1e-5, atol=2**-21)
    torch.testing.assert_close(grad.double(), want_grad, **tol)


def _gelu_fp64(x: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GELU, its slope and the slope's two terms in magnitude (what its rounding scales with: they cancel where the
    slope crosses 0, near x = -0.75), from the maths in fp64. Erf form: y = x Phi(x), slope = Phi(x) + x phi(x),
    Phi from erfc (no cancellation in the negative tail). Tanh form: 1 + tanh u as 2 / (1 + e^-2u) and
    1 - tanh^2 u as 1 / cosh^2 u (fp64's 1 + tanh keeps few digits in the negative tail)."""
    x = x.double()
    if approximate == "none":
        cdf = 0.5 * torch.special.erfc(-x / math.sqrt(2))
        first, second = cdf, x * torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        return x * cdf, first + second, first.abs() + second.abs()
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    one_plus, one_minus_sq = 2 / (1 + torch.exp(-2 * u)), torch.cosh(u) ** -2
    first, second = 0.5 * one_plus, 0.5 * x * one_minus_sq * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x**2)
    return 0.5 * x * one_plus, first + second, first.abs() + second.abs()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), scale=st.floats(0.1, 12), seed=st.integers(0, 10_000), bf16=st.booleans(),
       approximate=st.sampled_from(["none", "tanh"]))
def test_every_builds_gelu_is_the_maths_in_fp64(build_name: str, n: int, scale: float, seed: int, bf16: bool,
                                                approximate: str) -> None:
    """Each build's GELU (erf and tanh forms) and its slope against fp64: any length (every vector remainder),
    inputs out to the tails where 1 + tanh, 1 - tanh^2 and 1 + erf lose digits in a careless formula; fp32 within
    a few ulps of the largest value (the erf form: Abramowitz & Stegun's erfc, as ATen's, within 1.5e-7 of it),
    bf16 rounded once."""
    from gptlab.kernels import kernel_builds

    ops_ = kernel_builds()[build_name]
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = (torch.randn(n, generator=g) * scale).to(dtype)
    want, want_slope, terms = _gelu_fp64(x, approximate)
    y, slope = ops_.gelu_with_slope(x, approximate == "tanh")
    erfc_error = 1e-7 * x.double().abs().clamp(min=1) if approximate == "none" else 0.0  # (|error| of Phi: 7.5e-8)
    for ours, theirs, size in ((y, want, want.abs()), (slope, want_slope, terms)):
        # fp32: e^(2|u|) from an fp32 u errs by ~1e-7 x 2|u| relative in the tail; sums of terms that cancel (the
        # slope's zero near x = -0.75) by ~1e-7 of the largest term summed, whatever the sum came to
        largest = max(1e-6 * float(size.max()), torch.finfo(torch.float32).tiny)  # (0: below fp32's range)
        assert ours.dtype == dtype and ours.shape == x.shape
        bound = (2**-8 if bf16 else 1e-5) * theirs.abs() + largest + erfc_error
        assert ((ours.double() - theirs).abs() <= bound).all()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_runs_the_kernel_in_training_and_atens_otherwise(dtype: torch.dtype, approximate: str,
                                                              monkeypatch) -> None:  # noqa: ANN001
    """`ops.gelu` is F.gelu: bit for bit without a gradient (inference), within rounding in training, where it runs
    gptlab's kernel where there is one, which keeps the slope for the backward."""
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("no gptlab kernel build on this machine")
    monkeypatch.setattr(ops, "_NATIVE_GELU_MIN", 0)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 1024, generator=g) * 3).to(dtype)
    assert torch.equal(ops.gelu(x, approximate), F.gelu(x, approximate=approximate))
    with torch.no_grad():
        assert torch.equal(ops.gelu(x.clone().requires_grad_(), approximate), F.gelu(x, approximate=approximate))
    x.requires_grad_()
    ours = ops.gelu(x, approximate)
    assert "Gelu" in type(ours.grad_fn).__name__  # the kernel ran
    ref = x.detach().clone().requires_grad_()
    theirs = F.gelu(ref, approximate=approximate)
    up = torch.randn(ours.shape, generator=g).to(dtype)
    (g_ours,), (g_theirs,) = torch.autograd.grad(ours, x, up), torch.autograd.grad(theirs, ref, up)
    for a, b in ((ours, theirs), (g_ours, g_theirs)):  # fp32: within ~1e-6 of the largest value (cancelling sums)
        # bf16: the slope rounded, then its product (ATen rounds the product only)
        bf16, largest = dtype == torch.bfloat16, float(b.detach().abs().max())
        torch.testing.assert_close(a, b, rtol=2**-7 if bf16 else 1e-5, atol=1e-5 if bf16 else 2e-6 * largest)


@pytest.fixture
def no_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the path of a CPU without bf16 matmul units, whatever this one has."""
    monkeypatch.setattr(ops, "native_low_precision_matmul", lambda dtype: dtype == torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_upcast_linear_is_an_fp32_matmul_rounded_once(no_native_bf16: None, bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 7, 48).to(torch.bfloat16).requires_grad_()
    w = torch.randn(5000, 48).to(torch.bfloat16).requires_grad_()  # more rows than one chunk holds
    b = torch.randn(5000).to(torch.bfloat16).requires_grad_() if bias else None
    assert ops.upcasts(x, w)
    out = ops.upcasting_linear(x, w, b)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16), rtol=0, atol=0)
    grad = torch.randn(out.shape).to(torch.bfloat16)
    ours = torch.autograd.grad(out, [x, w] + ([b] if bias else []), grad)
    theirs = torch.autograd.grad(expected, [x, w] + ([b] if bias else []), grad.float())
    for a, e in zip(ours, theirs, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), rtol=1e-2, atol=1e-2)  # bf16 roundings of fp32 results


def test_padded_rows_start_aligned_and_are_never_whole_pages_apart() -> None:
    """An LM head's logits rows: a multiple of 64 elements, and not a multiple of 4 KiB apart (cache sets)."""
    for n, itemsize, want in ((50257, 4, 50304), (4097, 4, 4160), (32000, 4, 32000), (151936, 4, 151936),
                              (49152, 4, 49216), (49152, 2, 49216), (32768, 2, 32832), (64, 4, 64), (1, 4, 64)):
        width = ops.padded_width(n, itemsize)
        assert width == want and width % 64 == 0 and width >= n and width * itemsize % 4096 != 0, (n, itemsize)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [4097, 4160, 50257])  # odd widths (split at 4096 / 50240) and an aligned one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_split_head_equals_f_linear_with_its_gradients(bias: bool, rows: int, dtype: torch.dtype) -> None:
    """A wide weight of an odd width on a CPU runs as two products split at a multiple of 64 rows: the same
    output and gradients as F.linear in the same dtype (each element is the same dot product); the output's rows
    contiguous and padded apart to a multiple of 64 elements (aligned GEMM stores), the gradients contiguous."""
    torch.manual_seed(0)
    x = torch.randn(2, 40, 48).to(dtype).requires_grad_()
    w = torch.randn(rows, 48).to(dtype).requires_grad_()
    b = torch.randn(rows).to(dtype).requires_grad_() if bias else None
    assert ops._SplitLinear.helps(x, w) == (rows % 64 != 0)
    assert not ops._SplitLinear.helps(x[:, :1], w)  # a few rows (decoding): the plain product
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not ops._SplitLinear.helps(x, w)  # autocast casts inside F.linear
    out = ops.upcasting_linear(x, w, b)
    if ops.upcasts(x, w):  # bf16 on a CPU without bf16 products: each element is fp32's dot product, rounded once
        expected = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    else:
        expected = F.linear(x, w, b)
    assert out.shape == (2, 40, rows) and out.dtype == dtype
    split = ops._SplitLinear.helps(x, w) and not ops.upcasts(x, w)  # (bf16 without bf16 products: in fp32 chunks)
    width = ops.padded_width(rows, out.element_size()) if split else rows
    assert ops.rows_contiguous(out.view(-1, rows)) and out.stride(1) == width
    exact = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out, expected, **exact)
    reference = F.linear(x.double(), w.double(), None if b is None else b.double())  # and against fp64
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=1e-1 if dtype == torch.bfloat16 else 1e-4)
    grad = torch.randn(out.shape).to(dtype)
    inputs = [x, w] + ([b] if bias else [])
    ours, theirs = torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad)
    for a, e in zip(ours, theirs, strict=True):
        assert a.shape == e.shape and a.dtype == dtype and a.is_contiguous()
        torch.testing.assert_close(a.float(), e.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_the_gpus_padded_head_equals_f_linear_with_its_gradients(bias: bool) -> None:
    """What a GPU runs for an LM head of an odd width (F.pad of the weight, a slice of the output), run here on
    the CPU: the same output and gradients as F.linear; taken only on CUDA and only for wide, odd weights."""
    torch.manual_seed(0)
    x = torch.randn(3, 70, 32, dtype=torch.float64).requires_grad_()
    w = torch.randn(4097, 32, dtype=torch.float64).requires_grad_()
    b = torch.randn(4097, dtype=torch.float64).requires_grad_() if bias else None
    out, expected = ops.padded_linear(x, w, b), F.linear(x, w, b)
    assert out.shape == expected.shape == (3, 70, 4097)
    torch.testing.assert_close(out, expected)
    grad = torch.randn(out.shape, dtype=torch.float64)
    inputs = [x, w] + ([b] if bias else [])
    for a, e in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad), strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e)
    assert not ops._gpu_pads(x, w)  # a CPU tensor: the CPU's own rule applies
    meta = torch.empty(4097, 32, device="meta")
    assert not ops._gpu_pads(torch.empty(3, 70, 32, device="meta"), meta)


def test_fused_fp32_lora_path_equals_the_plain_one(no_native_bf16: None) -> None:
    """With a bf16 base on such a CPU the LoRA layer runs as one fp32 function; it must compute what the plain
    path (a bf16 base matmul plus fp32 adapters) computes, and the same adapter gradients."""
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 40, bias=True)
    layer = LoRALinear(base, {"q": (0, 16), "v": (24, 40)}, LoRASpec(rank=4, alpha=8.0))
    with torch.no_grad():
        for p in list(layer.lora_A.values()) + list(layer.lora_B.values()):
            p.copy_(torch.randn(p.shape) * 0.1)
    x = torch.randn(3, 5, 32)
    reference = layer(x)  # fp32 base: the plain path
    ref_grads = torch.autograd.grad(reference.square().sum(), list(layer.lora_A.values()))
    layer.weight.data, layer.bias.data = layer.weight.data.bfloat16(), layer.bias.data.bfloat16()
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)  # bf16 base weights and output
    grads = torch.autograd.grad(out.float().square().sum(), list(layer.lora_A.values()))
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=5e-2, atol=5e-2)
