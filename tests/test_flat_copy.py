"""The bf16 working-copy step over flat buffers (gptlab.train.flat): the same weights as the step spelled out per
parameter with torch's clipping, and a fixed number of ops however many parameters the model has; with AdamW and
gptlab's kernels, the one-pass step (`FlatCopy.adamw_step`) within fp32 rounding of it (its kernel against torch's
fused AdamW: tests/test_adamw_step.py)."""

from __future__ import annotations

import contextlib
import copy
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_data, write_recipe
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from gptlab.cli import main
from gptlab.config import GPTConfig
from gptlab.data import global_batch
from gptlab.model import GPT
from gptlab.train import flat as flat_copy
from gptlab.train.flat import global_norm
from gptlab.train.optim import OptimizerSpec, build_optimizers, step_optimizers, takes_grad_scale
from gptlab.train.precision import Precision

TOKENS = np.random.default_rng(0).integers(0, 50, 2000).astype(np.uint16)


def tiny(n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=n_layer, n_embd=32, n_head=2, n_kv_head=2, block_size=16,
                                vocab_size=50))


def batch(step: int) -> torch.Tensor:
    return torch.from_numpy(global_batch(TOKENS, 3, step, 8, 16))


def per_parameter_steps(model: GPT, spec: OptimizerSpec, steps: int, clip: float) -> list[float]:
    """The working-copy step as written before the buffers: a bf16 deep copy, each gradient cast to fp32 on its
    own, torch's clip_grad_norm_, the optimizer, each master cast back. Returns the pre-clip gradient norms."""
    working = copy.deepcopy(model).to(torch.bfloat16)
    working.set_attention_dtype(torch.float32)
    optimizers = build_optimizers(model, spec)
    norms = []
    for step in range(steps):
        rows = batch(step)
        _, loss = working(rows[:, :-1], rows[:, 1:])
        loss.backward()
        for w, m in zip(working.parameters(), model.parameters(), strict=True):
            m.grad = w.grad.to(torch.float32)
            w.grad = None
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip, foreach=True)))
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w, m in zip(working.parameters(), model.parameters(), strict=True):
                w.copy_(m)
    return norms


@pytest.fixture(params=["buffers", "one pass"])
def adamw_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The working step's two forms for AdamW: over the flat buffers (the kernels' step switched off, as on a CPU
    without them), and in one C++ pass where this CPU runs gptlab's kernels."""
    if request.param == "buffers":
        monkeypatch.setattr(flat_copy, "_adamw_ops", lambda masters, grads: None)
    else:
        from gptlab.kernels import widest_ops

        if widest_ops() is None:
            pytest.skip("gptlab's kernels do not run on this CPU")
    return request.param


def flat_steps(model: GPT, spec: OptimizerSpec, steps: int, clip: float) -> Precision:
    precision = Precision(model, "bfloat16", "cpu", attention_fp32=True, distributed=False)
    optimizers = build_optimizers(model, spec)
    for step in range(steps):
        rows = batch(step)
        _, loss = precision.train_module(rows[:, :-1], rows[:, 1:])
        precision.backward(loss)
        precision.step(optimizers, grad_clip=clip)
    return precision


@pytest.mark.parametrize(("kind", "impl"), [("adamw", "torch"), ("adamw", "gptlab"), ("muon", "gptlab")])
def test_flat_steps_are_the_per_parameter_steps_exactly(kind: str, impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without clipping the buffers change no number: the same casts and copies, fewer calls."""
    monkeypatch.setattr(flat_copy, "_adamw_ops", lambda masters, grads: None)
    spec = OptimizerSpec(kind=kind, impl=impl, lr=1e-2, weight_decay=0.1)
    reference, flat = tiny(), tiny()
    per_parameter_steps(reference, spec, 4, clip=0.0)
    precision = flat_steps(flat, spec, 4, clip=0.0)
    for (name, r), f in zip(reference.named_parameters(), flat.parameters(), strict=True):
        assert torch.equal(f, r), name
    for w, m in zip(precision.working.parameters(), flat.parameters(), strict=True):
        assert torch.equal(w, m.to(torch.bfloat16))  # the working copy is the masters, cast


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("impl", ["torch", "gptlab"])
def test_one_pass_adamw_step_is_the_per_parameter_step_within_rounding(impl: str, clip: float) -> None:
    """The kernels' AdamW step (`FlatCopy.adamw_step`, taken where this CPU runs them), clipped or not: the masters
    within fp32 rounding of the step spelled out per parameter, and the working weights exactly the masters
    rounded to bf16, as the copy back would leave them. (One step: over several, AdamW's normalized updates of
    gradients that are rounding noise, such as a key bias's, let 1-ulp differences grow.)"""
    from gptlab.kernels import widest_ops

    if widest_ops() is None:
        pytest.skip("gptlab's kernels do not run on this CPU")
    spec = OptimizerSpec(kind="adamw", impl=impl, lr=1e-2, weight_decay=0.1)
    reference, model = tiny(), tiny()
    per_parameter_steps(reference, spec, 1, clip)
    precision = flat_steps(model, spec, 1, clip)
    for (name, r), m in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7, msg=name)
    for w, m in zip(precision.working.parameters(), model.parameters(), strict=True):
        assert torch.equal(w, m.to(torch.bfloat16))
    assert all(w.grad is None for w in precision.working.parameters())


@pytest.mark.parametrize(("kind", "impl"), [("adamw", "gptlab"), ("adamw", "torch"), ("muon", "gptlab")])
def test_flat_clipping_matches_torchs(kind: str, impl: str, adamw_path: str) -> None:
    """One clipped step against torch's clip_grad_norm_: the one difference is the global norm's rounding (all
    gradients at once vs the norm of per-tensor norms; the one-pass step: fp64 sums of squares), far below what a
    bf16 working copy resolves, and for the fused AdamWs over the buffers the gradients divided by the inverse
    coefficient as the update reads them rather than scaled by it first (Muon, and the one-pass step: scaled
    first). Muon's matrices: a first step's update is Newton-Schulz of the gradient, whose scale it normalizes
    away; the iteration (fp32 where bf16 products are emulated) magnifies that rounding in a small matrix's small
    singular directions, so that its bf16 update may round a step or two apart."""
    spec = OptimizerSpec(kind=kind, impl=impl, lr=1e-2, weight_decay=0.1)
    reference, flat = tiny(), tiny()
    clip = 0.05
    (norm,) = per_parameter_steps(reference, spec, 1, clip)
    assert norm > 10 * clip  # the step clips: the clipping path is what is compared
    flat_steps(flat, spec, 1, clip)
    muon_matrices = {name for name, _ in reference.parameter_groups_by_kind()["matrix"]} if kind == "muon" else set()
    for (name, r), f in zip(reference.named_parameters(), flat.parameters(), strict=True):
        # (lr times sqrt(rows / cols) <= 2 times the update's bf16 steps near 1, twice)
        atol = spec.muon_lr * 2 * 2 ** -7 if name in muon_matrices else 1e-7
        torch.testing.assert_close(f, r, rtol=1e-6, atol=atol, msg=name)


def test_a_grad_scale_goes_only_to_optimizers_that_divide_by_it() -> None:
    """Muon reads no grad_scale: handing it one would skip the clipping, so it is refused (Precision scales the
    buffer first where any optimizer is such)."""
    optimizers = build_optimizers(tiny(), OptimizerSpec(kind="muon", impl="gptlab", lr=1e-2))
    assert not all(takes_grad_scale(opt) for opt in optimizers)
    with pytest.raises(ValueError, match="grad_scale"):
        step_optimizers(optimizers, grad_scale=torch.tensor(2.0))


def test_masters_and_working_weights_live_in_one_buffer_each() -> None:
    model = tiny()
    precision = Precision(model, "bfloat16", "cpu", attention_fp32=True, distributed=False)
    flat = precision.flat
    for params, buffer in ((list(model.parameters()), flat.master_data),
                           (list(precision.working.parameters()), flat.working_data)):
        assert {p.untyped_storage().data_ptr() for p in params} == {buffer.untyped_storage().data_ptr()}
        assert sum(p.numel() for p in params) == buffer.numel()


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not func.is_view:  # views (each gradient flattened for the cat) move no data
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step_ops(n_layer: int) -> Counter[str]:
    """The ops of Precision.step (gradients to the masters, clip, fused AdamW, copy back; or the one-pass step) for
    a model this deep, in its second step (the first also makes the optimizer's state)."""
    model = tiny(n_layer)
    precision = Precision(model, "bfloat16", "cpu", attention_fp32=True, distributed=False)
    optimizers = build_optimizers(model, OptimizerSpec(kind="adamw", impl="gptlab", lr=1e-2, weight_decay=0.1))
    counter = OpCounter()
    for step in range(2):
        rows = batch(step)
        _, loss = precision.train_module(rows[:, :-1], rows[:, 1:])
        precision.backward(loss)
        with counter if step == 1 else contextlib.nullcontext():
            precision.step(optimizers, grad_clip=1.0)
    return counter.ops


def test_step_ops_do_not_grow_with_the_parameters(adamw_path: str) -> None:
    shallow, deep = step_ops(1), step_ops(4)
    assert shallow == deep  # no op per parameter: 4 layers add 24 tensors and not one op
    if adamw_path == "buffers":
        assert shallow["aten.copy_"] <= 1 and shallow["aten.linalg_vector_norm"] == 2  # blocks' norms, their norm
        assert shallow["aten.mul_"] == 0  # the fused AdamW applies the clipping as it reads the gradients
    else:  # one sum of squares, one pass per param group (decayed matrices, the rest), nothing else
        assert sorted(op.split(".")[-1] for op in shallow.elements()) == ["adamw_working", "adamw_working",
                                                                           "sum_squares"]


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 1 << 25])
def test_the_global_norm_of_a_long_buffer_is_the_fp64_norm(n: int) -> None:
    """Block by block: within 1e-6 of the fp64 norm at 33M values (short of the last block, a whole one, a
    remainder), where one fp32 reduction (ATen's vector_norm) is off by more than 1e-4."""
    values = torch.rand(n, generator=torch.Generator().manual_seed(n))
    want = float(torch.linalg.vector_norm(values.double()))
    assert abs(float(global_norm(values)) - want) <= 1e-6 * want
    if n == 1 << 25:
        assert abs(float(torch.linalg.vector_norm(values)) - want) > 1e-4 * want  # what the blocks are for


def test_a_parameter_without_a_gradient_keeps_none_and_is_not_stepped() -> None:
    """A parameter off the loss's path this step gets no master gradient, so AdamW's decay leaves it alone, and its
    stale zeros in the buffer change no norm."""
    model = tiny()
    unused = torch.nn.Parameter(torch.ones(3, 3))  # a matrix: in the decayed group
    model.register_parameter("unused", unused)
    spec = OptimizerSpec(kind="adamw", impl="gptlab", lr=1e-2, weight_decay=0.1)
    flat_steps(model, spec, 2, 1.0)
    assert unused.grad is None and torch.equal(unused, torch.ones(3, 3))


def test_a_bf16_run_resumed_from_a_checkpoint_ends_bit_identical(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The masters' checkpoint holds views of one buffer; loading copies into them, so resuming keeps the buffers
    and the run: its last weights equal an uninterrupted run's."""
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    data = make_data(tmp_path / "data")
    recipe = write_recipe(tmp_path, max_steps=8, checkpoint_interval=4, eval_interval=0, dtype="bfloat16")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run = ["train", str(recipe), "--data", str(data), "--quiet", "--out"]
    assert main([*run, str(whole)]) == 0
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-0000008")
    assert main([*run, str(resumed), "--resume"]) == 0
    final = Path("checkpoints") / "step-0000008" / "model.safetensors"
    a, b = load_file(whole / final), load_file(resumed / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_attention_keeps_a_bf16_steps_gradients_as_close_to_fp32_as_fp32_attention_does() -> None:
    """At GPT-2's head size (64, where `attention_fp32 = "auto"` picks bf16 on a CPU) a bf16 working-copy step's
    loss and gradients, against the fp32 model's, differ no more with attention in bf16 than with it in fp32: the
    error is the bf16 weights' and activations', not attention's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=2, n_embd=128, n_head=2, n_kv_head=2, block_size=64,
                                 vocab_size=300))
    assert model.config.head_size == 64
    rows = torch.randint(0, 300, (4, 65), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(net: torch.nn.Module) -> tuple[float, torch.Tensor]:
        _, loss = net(rows[:, :-1], rows[:, 1:])
        loss.backward()
        grads = torch.cat([p.grad.float().reshape(-1) for p in net.parameters()])
        net.zero_grad(set_to_none=True)
        return float(loss.detach()), grads

    ref_loss, ref = loss_and_grads(copy.deepcopy(model))
    errors = {}
    for fp32_attention in (True, False):
        working = Precision(copy.deepcopy(model), "bfloat16", "cpu", attention_fp32=fp32_attention,
                            distributed=False).train_module
        loss, grads = loss_and_grads(working)
        errors[fp32_attention] = (abs(loss - ref_loss), float((grads - ref).norm() / ref.norm()))
    assert errors[True][1] < 0.05  # what a bf16 step resolves at all
    assert errors[False][0] <= 2 * errors[True][0] + 1e-3
    assert errors[False][1] <= 1.25 * errors[True][1]
