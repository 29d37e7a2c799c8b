"""`gptlab.causal_attention`'s bf16 path: causal attention's backward in bf16 training on a CPU
(kernels/attention_backward.cpp).
Every build with bf16 dot products this machine runs against the maths in fp64, no further from it than PyTorch's
own flash-attention backward; the forward is PyTorch's to the bit; a model's loss and gradients through it against
the same model through F.scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import causal_attention_fp64
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import causal_attention
from gptlab.config import GPTConfig
from gptlab.model import GPT


@pytest.fixture(autouse=True, scope="module")
def _torch_flash_runs() -> None:
    """PyTorch's bf16 flash attention (the forward here and the reference) raises "pack_vnni2 is only supported
    when avx512 is supported" where its dispatch is lowered below what the CPU has (ATEN_CPU_CAPABILITY=avx2 on an
    AMX Xeon); there F.scaled_dot_product_attention itself cannot run bf16, and nothing here can be compared."""
    q = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)  # (at 32 x 32 it runs another path, which works)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True, scale=0.2)
    except RuntimeError as error:
        pytest.skip(f"PyTorch's bf16 flash attention does not run here: {error}")


def _with_backward(build_name: str):  # noqa: ANN202 - the build's ops
    from gptlab.kernels import kernel_builds

    ops = kernel_builds()[build_name]
    if not hasattr(ops, "causal_attention_backward"):
        pytest.skip(f"the {build_name} build has no bf16 dot products: PyTorch's attention backward runs there")
    return ops


def _relative(a: torch.Tensor, want: torch.Tensor) -> float:
    return float((a.double() - want).norm() / want.norm())


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3]),
       blocks=st.integers(1, 5), head_size=st.sampled_from([32, 64, 128]), scale=st.floats(0.05, 0.3),
       seed=st.integers(0, 10_000))
def test_every_builds_backward_is_the_maths_in_fp64(build_name: str, batch: int, kv_heads: int, group: int,
                                                    blocks: int, head_size: int, scale: float, seed: int) -> None:
    """Any sequence length and head size in whole blocks of 32, grouped kv heads, any scale: each gradient within
    bf16's rounding of the fp64 one, and no further from it than PyTorch's flash-attention backward (with the kv
    heads repeated, its key and value gradients summed over each group)."""
    ops = _with_backward(build_name)
    g = torch.Generator().manual_seed(seed)
    heads, T = kv_heads * group, 32 * blocks
    q = torch.randn(batch, heads, T, head_size, generator=g).bfloat16()
    k, v = (torch.randn(batch, kv_heads, T, head_size, generator=g).bfloat16() for _ in range(2))
    grad = torch.randn(batch, heads, T, head_size, generator=g).bfloat16()
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, True,
                                                                           scale=scale)[:2]
    ours = ops.causal_attention_backward(grad, q, k, v, out, lse, scale)
    theirs = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, keys, values, out, lse,
                                                                                 0.0, True, scale=scale)
    theirs = (theirs[0], *(t.view(batch, kv_heads, group, T, head_size).sum(2) for t in theirs[1:]))
    want_grads = causal_attention_fp64(q, k, v, grad, scale)[2:]
    for name, mine, torchs, want in zip("qkv", ours, theirs, want_grads, strict=True):
        assert mine.dtype == torch.bfloat16 and mine.shape == want.shape, name
        assert _relative(mine, want) < 8e-3, name
        assert _relative(mine, want) <= 1.25 * _relative(torchs, want) + 1e-3, name


def test_the_backward_takes_strided_rows(build_name: str) -> None:
    """Rows of q, k, v, the output and its gradient laid out (B, T, H, D) as the model's heads and SDPA's output
    are: the same gradients as from contiguous copies."""
    ops = _with_backward(build_name)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 64, 3, 32, generator=g).bfloat16().transpose(1, 2) for _ in range(4))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.2)[:2]
    strided = ops.causal_attention_backward(grad, q, k, v, out, lse, 0.2)
    dense = ops.causal_attention_backward(*(t.contiguous() for t in (grad, q, k, v, out)), lse, 0.2)
    assert all(torch.equal(a, b) for a, b in zip(strided, dense, strict=True))


def test_the_backward_refuses_lengths_off_its_blocks(build_name: str) -> None:
    ops = _with_backward(build_name)
    q = torch.randn(1, 2, 40, 32).bfloat16()
    with pytest.raises(RuntimeError, match="T and D must be multiples of 32"):
        ops.causal_attention_backward(q, q, q, q, q, torch.zeros(1, 2, 40), 0.2)


def _model(n_kv_head: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=2, n_embd=128, n_head=4, n_kv_head=n_kv_head, block_size=64,
                                vocab_size=300)).to(torch.bfloat16)


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_a_models_loss_and_gradients_match_torchs_attention(build_name: str, n_kv_head: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model (GPT-2-like heads, and grouped kv heads) trained through gptlab's backward on each build with
    bf16 dot products against the same model through F.scaled_dot_product_attention: the same loss to the bit
    (PyTorch's forward), every gradient within bf16 rounding."""
    ops = _with_backward(build_name)
    monkeypatch.setattr(causal_attention, "_bf16_dot_ops", lambda: ops)
    rows = torch.randint(0, 300, (3, 65), generator=torch.Generator().manual_seed(1))
    calls = []
    real = causal_attention._CausalAttention.apply
    monkeypatch.setattr(causal_attention._CausalAttention, "apply", lambda *a: calls.append(1) or real(*a))

    def loss_and_grads(model: GPT) -> tuple[torch.Tensor, list[torch.Tensor]]:
        _, loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        return loss.detach(), [p.grad.float() for p in model.parameters()]

    ours = loss_and_grads(_model(n_kv_head))
    assert len(calls) == 2  # both layers took the kernel
    monkeypatch.setattr(causal_attention, "_bf16_ops", lambda q, k, v: None)
    theirs = loss_and_grads(_model(n_kv_head))
    assert len(calls) == 2
    assert torch.equal(ours[0], theirs[0])
    for (name, _), a, b in zip(_model(n_kv_head).named_parameters(), ours[1], theirs[1], strict=True):
        assert float((a - b).norm()) <= 0.02 * float(b.norm()) + 1e-4, name


def test_bf16_is_served_only_in_training_in_whole_blocks() -> None:
    """bf16 with no gradient, a length or head size off the blocks of 32: None (F.scaled_dot_product_attention
    runs). (fp32: tests/test_attention_fp32.py.)"""
    def qkv(T: int = 64, D: int = 32, dtype: torch.dtype = torch.bfloat16, grad: bool = True) -> list:
        return [torch.randn(1, 2, T, D, dtype=dtype, requires_grad=grad) for _ in range(3)]

    assert causal_attention.attention(*qkv(grad=False), 0.2) is None
    assert causal_attention.attention(*qkv(T=48), 0.2) is None
    assert causal_attention.attention(*qkv(D=48), 0.2) is None
    with torch.no_grad():
        assert causal_attention.attention(*qkv(), 0.2) is None
    q, k, v = qkv()
    y = causal_attention.attention(q, k, v, 0.2)
    # what the trainer asks before choosing bf16 attention for narrow heads says the same as what runs
    assert causal_attention.serves(32, 64) is (y is not None)
    assert not causal_attention.serves(48, 64) and not causal_attention.serves(32, 48)
    if y is not None:  # where the kernels have bf16 dot products: PyTorch's forward, to the bit
        assert torch.equal(y, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2))


def test_the_trainer_runs_narrow_heads_in_bf16_where_the_kernel_serves_them(tmp_path) -> None:  # noqa: ANN001
    """A bf16 character model with 32-wide heads (the speedrun's): attention in bf16 where gptlab's backward serves
    those heads on this CPU (1.4-1.7x fp32 flash attention there), else in fp32; a recipe's explicit choice stays."""
    from helpers import make_data, write_recipe

    from gptlab.train import Trainer
    from gptlab.train.recipe import load_train_config

    data = make_data(tmp_path / "data", chars=20_000)
    for choice, want in (("auto", not causal_attention.serves(32, 64)), (True, True)):
        recipe = write_recipe(tmp_path, name=f"{choice}.toml", n_embd=64, n_head=2, block_size=64,
                              dtype="bfloat16", attention_fp32=choice, eval_interval=0)
        trainer = Trainer(load_train_config(recipe), data, tmp_path / f"run-{choice}", quiet=True)
        try:
            assert trainer.cfg.attention_fp32 is want
        finally:
            trainer.release()
