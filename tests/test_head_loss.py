"""`gptlab.head_loss`: the LM head and its cross-entropy as one autograd node in training on a CPU. Against the
model's unfused path (the head's product, then `ops.cross_entropy`): the same logits and loss to the bit, the
gradients within rounding (fp32) or no further from fp64's than the unfused path's (bf16), for every reduction,
ignored targets, a head with a bias, soft-capped logits, and logits that another loss reads too."""

from __future__ import annotations

import copy

import pytest
import torch

from gptlab import head_loss
from gptlab.config import GPTConfig
from gptlab.model import GPT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _kernels() -> None:
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("gptlab's kernels do not run on this CPU: the unfused path is the only one")


def _model(head_bias: bool = False, softcap: float | None = None) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=1, n_embd=64, n_head=2, n_kv_head=2, block_size=32,
                                 vocab_size=4099, head_bias=head_bias, logit_softcap=softcap))
    if softcap is not None:  # logits large enough that the cap bends them
        with torch.no_grad():
            model.lm_head.weight.mul_(20)
    return model


def _run(model: GPT, fused: bool, reduction: str, also_logits: bool = False):  # noqa: ANN202
    """(logits, loss, gradients) of one backward, through the fused node or not (which is asserted)."""
    rows = torch.randint(0, 4099, (2, 33), generator=torch.Generator().manual_seed(1))
    targets = rows[:, 1:].clone()
    targets[0, :5] = -1
    calls = []
    real = head_loss._HeadCrossEntropy.apply
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(head_loss._HeadCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
        if not fused:
            patch.setattr(head_loss, "_xent", lambda h, head: None)
        out = model(rows[:, :-1], targets, reduction=reduction)
    assert len(calls) == int(fused)
    loss = out.loss if reduction != "none" else (out.loss * torch.linspace(0.5, 2, out.loss.numel())).sum()
    if also_logits:  # a second loss on the logits: their gradient joins the loss's
        loss = loss + out.logits.float().square().mean() * 1e-3
    loss.backward()
    return out.logits.detach(), out.loss.detach(), [p.grad.double() for p in model.parameters()]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("head_bias", "also_logits", "softcap"),
                         [(False, False, None), (True, False, None), (False, True, None), (False, False, 3.0),
                          (True, True, 3.0)])
def test_fp32_fused_is_the_unfused_path(reduction: str, head_bias: bool, also_logits: bool,
                                        softcap: float | None) -> None:
    model = _model(head_bias, softcap)
    fused = _run(copy.deepcopy(model), True, reduction, also_logits)
    plain = _run(copy.deepcopy(model), False, reduction, also_logits)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    for (name, _), a, b in zip(model.named_parameters(), fused[2], plain[2], strict=True):
        # (the soft-cap's derivative is rounded once, tanh_backward's too: fp32 rounding of the largest entries)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7 + 1e-6 * float(b.abs().max()), msg=name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_bf16_fused_is_no_further_from_fp64_than_the_unfused_path(reduction: str, softcap: float | None) -> None:
    """In bf16 the scale goes onto the hidden states and the input's gradient instead of the logits' gradient:
    other roundings, as close to the fp64 gradients; with a soft-cap too."""
    from gptlab.ops import native_low_precision_matmul

    if not native_low_precision_matmul(torch.bfloat16):
        pytest.skip("bf16 products run through fp32 on this CPU: the fused node does not apply (test below)")
    model = _model(softcap=softcap)
    want = _run(copy.deepcopy(model).double(), False, reduction)[2]
    fused = _run(copy.deepcopy(model).to(torch.bfloat16), True, reduction)
    plain = _run(copy.deepcopy(model).to(torch.bfloat16), False, reduction)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    for (name, _), a, b, w in zip(model.named_parameters(), fused[2], plain[2], want, strict=True):
        error = float((a - w).norm() / w.norm())
        assert error <= 1.5 * float((b - w).norm() / w.norm()) + 2e-3 and error < 0.03, name


def test_bf16_on_a_cpu_without_bf16_products_takes_the_unfused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where bf16 Linears run through fp32 (an AVX2-only CPU) the head's logits come from that fp32 product, so
    the bf16 node does not apply: the unfused path, with the same loss as the fp32 model's within bf16 rounding."""
    from gptlab import ops

    monkeypatch.setattr(ops, "native_low_precision_matmul", lambda dtype: False)
    calls = []
    real = head_loss._HeadCrossEntropy.apply
    monkeypatch.setattr(head_loss._HeadCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
    rows = torch.randint(0, 4099, (2, 9), generator=torch.Generator().manual_seed(1))
    model = _model()
    loss = copy.deepcopy(model).to(torch.bfloat16)(rows, rows).loss
    loss.backward()
    assert calls == []
    assert float(loss) == pytest.approx(float(model(rows, rows).loss), rel=2e-2)


def test_the_unfused_path_serves_hooked_and_evaluating_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks on the logits, and no gradient: the unfused path."""
    calls = []
    real = head_loss._HeadCrossEntropy.apply
    monkeypatch.setattr(head_loss._HeadCrossEntropy, "apply", lambda *a: calls.append(1) or real(*a))
    rows = torch.randint(0, 4099, (2, 9))
    model = _model()
    model.hooks = lambda name, x: x  # as gptlab.hooks sets while a caller looks inside
    model(rows, rows).loss.backward()
    model.hooks = None
    with torch.no_grad():
        model(rows, rows)
    assert calls == []
    model(rows, rows).loss.backward()
    assert calls == [1]


def test_a_tied_table_gets_its_gradient_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's tied head: the head's node hands its weight gradient to the token lookup's node (which adds its rows:
    the gradients compared above), rather than each making a V x C gradient for autograd to sum."""
    handed = []

    class Recording(head_loss.TiedGradient):
        def __setattr__(self, name: str, value: object) -> None:
            if value is not None:
                handed.append(tuple(value.shape))
            super().__setattr__(name, value)

    monkeypatch.setattr(head_loss, "TiedGradient", Recording)
    model = _model()
    assert model.lm_head.weight is model.transformer.wte.weight
    _run(model, True, "mean")
    assert handed == [tuple(model.lm_head.weight.shape)]
