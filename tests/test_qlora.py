"""QLoRA: adapters over an int8 / int4 frozen base. Their gradients through the quantized base equal those through the
dequantized weights in fp32 (a manual reference), the merged export is the dequantized base plus the update, and
`train --lora-rank R --quantize int4` trains, exports and chats; its exact resume after SIGKILL is in test_faults."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import make_data, one_line_error, tiny_model, write_recipe
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gptlab import qlora
from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.integer_weights import pack_nibbles, quantize_int4_low
from gptlab.linear import plain_linear
from gptlab.lora import LoRALinear, LoRASpec, add_lora, merge_lora
from gptlab.qlora import FrozenQuantizedLinear, quantize_base
from gptlab.quantize import QuantizedLinear


def nonzero_adapters(model: nn.Module, seed: int) -> None:
    """B away from 0, so that every adapter's A gets a gradient too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_adapter_gradients_through_the_quantized_base_equal_the_dequantized_fp32_ones(mode: str) -> None:
    base = tiny_model().float()
    quantized = quantize_base(copy.deepcopy(base), mode)
    reference = copy.deepcopy(base)  # by hand: each block Linear's weight replaced by its dequantized one
    with torch.no_grad():
        for (_, layer), (_, q) in zip(reference.named_modules(), quantized.named_modules(), strict=True):
            if isinstance(q, FrozenQuantizedLinear):
                layer.weight.copy_(q.dequantize())
    assert sum(isinstance(m, FrozenQuantizedLinear) for m in quantized.modules()) == 4 * base.config.n_layer
    spec = LoRASpec(rank=4, quantize=mode)
    for model in (quantized, reference):
        torch.manual_seed(0)
        add_lora(model, spec)
        nonzero_adapters(model, 1)
    x = torch.randint(0, base.config.vocab_size, (3, 16))
    losses = []
    for model in (quantized, reference):
        _, loss = model.train()(x, x)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    got, want = dict(quantized.named_parameters()), dict(reference.named_parameters())
    trained = [n for n, p in got.items() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    for name in trained:
        torch.testing.assert_close(got[name].grad, want[name].grad, atol=1e-6, rtol=1e-5, msg=name)
    assert all(p.grad is None for n, p in got.items() if n not in trained)


# --- one layer against the maths: peft's LoRA over the dequantized weight -------------------------------------------
def qlora_and_peft(mode: str, dtype: torch.dtype, bias: bool, shape: tuple[int, int] = (48, 64)
                   ) -> tuple[LoRALinear, nn.Module]:
    """A `LoRALinear` over a `FrozenQuantizedLinear` of a random Linear of `shape` (out, in), and peft's LoRA over a
    plain Linear holding that layer's dequantized weight in `dtype`, with the same adapters (B away from 0)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    n, k = shape
    linear = nn.Linear(k, n, bias=bias)
    quantized = FrozenQuantizedLinear(linear, mode, 32)
    ours = LoRALinear(quantized, {"all": (0, n)}, LoRASpec(rank=4, alpha=8, quantize=mode))
    nonzero_adapters(ours, 3)
    plain = nn.Sequential(nn.Linear(k, n, bias=bias))
    with torch.no_grad():
        plain[0].weight.copy_(quantized.dequantize())
        if bias:
            plain[0].bias.copy_(linear.bias)
    theirs = peft.get_peft_model(plain.to(dtype), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    layer = theirs.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(ours.lora_A["all"])
        layer.lora_B["default"].weight.copy_(ours.lora_B["all"])
    for module in (layer.lora_A["default"], layer.lora_B["default"]):
        module.float()  # adapters in fp32 over a low-precision base, as gptlab's "frozen" precision keeps them
    if ours.base_layer.bias is not None:
        ours.base_layer.bias.data = ours.base_layer.bias.data.to(dtype)
    return ours, theirs


LAYER_CASES = [("int4", torch.float32, True), ("int8", torch.float32, False), ("int4", torch.bfloat16, False),
               ("int8", torch.bfloat16, True)]


@pytest.mark.parametrize("blocks", ["whole", "blocks"])
@pytest.mark.parametrize(("mode", "dtype", "bias"), LAYER_CASES)
def test_a_qlora_layer_equals_peft_lora_over_the_dequantized_weight(mode: str, dtype: torch.dtype, bias: bool,
                                                                    blocks: str, monkeypatch) -> None:
    """Forward, the gradient to the input and the adapters' gradients: fp32 within rounding; in bf16 (the base's
    product in bf16, the adapters in fp32) within bf16's rounding of the output. "blocks": a (200, 320) layer
    dequantized in blocks of 64 x 64 weights (4 blocks of rows forward, 5 of columns backward, the last ones
    short), as a large model's layers are."""
    shape = (48, 64)
    if blocks == "blocks":
        monkeypatch.setattr(qlora, "block_elements", lambda device: 64 * 64)
        shape = (200, 320)
    ours, theirs = qlora_and_peft(mode, dtype, bias, shape)
    if blocks == "blocks":
        layer = ours.base_layer
        assert len(qlora.weight_blocks(layer, along_rows=True)) == 4
        assert len(qlora.weight_blocks(layer, along_rows=False)) == 5
    x = torch.randn(3, 5, shape[1], dtype=dtype)
    out_grad = torch.randn(3, 5, shape[0], dtype=dtype)
    results = []
    for model in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.backward(out_grad)
        results.append((y, xi.grad))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    (y, gx), (y_ref, gx_ref) = results
    assert y.dtype == y_ref.dtype == dtype
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(gx, gx_ref, **tol)
    layer = theirs.base_model.model[0]
    for name in ("lora_A", "lora_B"):
        got, want = getattr(ours, name)["all"].grad, getattr(layer, name)["default"].weight.grad
        torch.testing.assert_close(got, want, **tol, msg=name)


def test_a_qlora_layer_keeps_its_integers_and_fp16_scales_and_saves_no_weight_for_backward() -> None:
    """int4: two weights a byte, an fp16 scale and low end per group of 32, no other tensor; its forward under
    autograd saves nothing of the weight's size (it dequantizes again in backward)."""
    ours, _ = qlora_and_peft("int4", torch.bfloat16, False)
    layer = ours.base_layer
    assert {n: (b.dtype, tuple(b.shape)) for n, b in layer.named_buffers()} == {
        "qweight": (torch.uint8, (48, 32)), "scale": (torch.float16, (48, 2)), "low": (torch.float16, (48, 2))}
    assert list(layer.parameters()) == []
    saved = []
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        y = ours(x)
    y.sum().backward()
    assert saved and max(saved) < 48 * 64 // 4
    torch.testing.assert_close(layer.dequantize(torch.bfloat16), layer.dequantize().to(torch.bfloat16), atol=0, rtol=0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), groups=st.integers(1, 3), log_scale=st.floats(-4, 3), shift=st.floats(-2, 2),
       seed=st.integers(0, 2**16))
def test_the_stored_int4_weight_is_the_min_max_grid_within_rounding(rows, groups, log_scale, shift, seed) -> None:
    """The base stores `quantize_int4_low`'s grid (one pass as a model loads; inference's layer refits each group,
    `quantize_int4`), its fp16 scale and low end exactly: dequantized, q * scale + low up to fp32 rounding, and
    within half a step of the original; the inference layer's grid errs no more."""
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(32 * groups, rows, bias=False)
    with torch.no_grad():
        linear.weight.copy_((torch.randn(rows, 32 * groups, generator=g) + shift) * 10.0**log_scale)
    ours = FrozenQuantizedLinear(linear, "int4", 32)
    assert ours.scale.dtype == ours.low.dtype == torch.float16
    q, scale, low = quantize_int4_low(linear.weight.detach(), 32)
    assert torch.equal(ours.qweight, pack_nibbles(q))
    want = (q.view(rows, groups, 32) * scale[..., None] + low[..., None]).view(rows, -1)
    torch.testing.assert_close(ours.dequantize(), want, atol=4e-7 * float(want.abs().max()), rtol=0)
    step = scale.repeat_interleave(32, dim=1)
    error = (ours.dequantize() - linear.weight).abs()
    assert bool((error <= step / 2 + 4e-7 * float(want.abs().max())).all())
    fitted = QuantizedLinear(linear, "int4", 32).dequantize() - linear.weight
    rounding = fitted.numel() * (2**-23 * float(want.abs().max())) ** 2  # fp32 dequantization
    assert float(fitted.square().sum()) <= float(error.square().sum()) * (1 + 1e-5) + rounding


def test_the_merged_model_is_the_dequantized_base_plus_the_update() -> None:
    model = quantize_base(tiny_model().float(), "int4")
    torch.manual_seed(0)
    add_lora(model, LoRASpec(rank=4, quantize="int4"))
    nonzero_adapters(model, 2)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    want = {name: m.base_layer.dequantize() + m.delta_weight() for name, m in layers.items()}
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    before = model.eval()(x)[0].detach()  # gradients on: the dequantized weights exactly (no inference kernel)
    with torch.no_grad():
        merge_lora(model)
        after = model(x)[0]
    for name, weight in want.items():
        merged = model.get_submodule(name)
        assert plain_linear(merged) and merged.weight.dtype == torch.float32
        torch.testing.assert_close(merged.weight, weight, atol=0, rtol=0)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_qlora_trains_exports_merged_and_chats(tmp_path: Path, monkeypatch, capsys) -> None:
    from gptlab.loading import load_model

    data = make_data(tmp_path, chars=20_000)
    base_recipe = write_recipe(tmp_path, "base.toml", max_steps=20, eval_interval=0)
    assert main(["train", str(base_recipe), "--data", str(data), "--out", str(tmp_path / "base"), "--quiet"]) == 0
    recipe = write_recipe(tmp_path, "qlora.toml", max_steps=10, eval_interval=0, lr=1e-2)
    recipe.write_text("\n".join(line for line in recipe.read_text().splitlines()
                                if line.split(" =")[0] not in ("model", "n_embd", "n_head", "n_kv_head", "block_size")))
    run = tmp_path / "run"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet", "--init-from",
                 str(tmp_path / "base"), "--lora-rank", "4", "--quantize", "int4"]) == 0
    losses = [float(line.split('"train_loss": ')[1].split(",")[0])
              for line in (run / "metrics.jsonl").read_text().splitlines() if "train_loss" in line]
    assert losses[-1] < losses[0]
    merged, _ = load_model(run, prefer="latest")
    unmerged, _ = load_model(run, prefer="latest", merge_adapters=False)
    base, _ = load_model(tmp_path / "base", prefer="latest")
    quantize_base(base, "int4")
    for name, layer in unmerged.named_modules():
        if isinstance(layer, LoRALinear):
            want = base.get_submodule(name).dequantize() + layer.delta_weight()
            torch.testing.assert_close(merged.get_submodule(name).weight, want, atol=0, rtol=0)
    pytest.importorskip("gguf")  # quantized again on export: GGUF holds q8_0 weights
    assert main(["convert", str(run), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", "q8_0"]) == 0
    assert (tmp_path / "m.gguf").stat().st_size > 0
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("Hello\n"))
    capsys.readouterr()
    assert main(["chat", str(run), "--max-new-tokens", "3", "--temperature", "0"]) == 0


def test_quantize_needs_lora(tmp_path: Path, capsys) -> None:
    recipe = write_recipe(tmp_path, quantize="int4")
    rc = main(["train", str(recipe), "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--quiet"])
    assert "set lora_rank" in one_line_error(rc, capsys.readouterr().err)


def test_a_width_no_int4_group_divides_is_one_line_offering_int8() -> None:
    """QLoRA's groups are 32 inputs unless its lora.json says otherwise; when no group size divides a layer's width
    the error offers int8, not another group size (the smallest one failed, and a recipe has no key for it)."""
    from gptlab import GPT, GPTConfig

    model = GPT(GPTConfig(norm="rmsnorm", bias=False, position="rope", mlp="swiglu", mlp_hidden=64, n_layer=1,
                          n_head=2, n_embd=40, vocab_size=50, block_size=16))
    with pytest.raises(GptlabError, match="int4 group size 32 does not divide transformer.h.0.attn.c_attn's input "
                                          r"width 40: choose one of none \(quantize to int8 instead\)"):
        quantize_base(model, "int4", 32)
    with pytest.raises(GptlabError, match="int4 quantizes in groups of 32 inputs, which do not divide "
                                          "transformer.h.0.attn.c_attn's input width 40: quantize to int8 instead"):
        quantize_base(model, "int4")  # a recipe's default: no group size to choose
    wide = GPT(GPTConfig(norm="rmsnorm", bias=False, position="rope", mlp="swiglu", mlp_hidden=96, n_layer=1,
                         n_head=2, n_embd=64, vocab_size=50, block_size=16))
    with pytest.raises(GptlabError, match="int4 group size 64 does not divide transformer.h.0.mlp.c_proj's input "
                                          "width 96: choose one of 32$"):
        quantize_base(wide, "int4", 64)


def test_an_int4_base_of_widths_its_groups_do_not_divide_is_refused_in_terms_training_takes(tmp_path: Path,
                                                                                            capsys) -> None:
    """A recipe has no group size (QLoRA's int4 base is in groups of 32): a base of width 48 was refused with
    "choose another group size, or int8", a choice no recipe key or flag offers."""
    data = make_data(tmp_path, chars=5_000)
    base_recipe = write_recipe(tmp_path, "base.toml", max_steps=2, warmup_steps=1, eval_interval=0, n_embd=48)
    assert main(["train", str(base_recipe), "--data", str(data), "--out", str(tmp_path / "base"), "--quiet"]) == 0
    recipe = write_recipe(tmp_path, "qlora.toml", max_steps=2, warmup_steps=1, eval_interval=0)
    recipe.write_text("\n".join(line for line in recipe.read_text().splitlines()
                                if line.split(" =")[0] not in ("model", "n_embd", "n_head", "n_kv_head", "block_size")))
    rc = main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / "run"), "--quiet", "--init-from",
               str(tmp_path / "base"), "--lora-rank", "4", "--quantize", "int4"])
    err = one_line_error(rc, capsys.readouterr().err)
    assert "input width 48" in err and "quantize to int8 instead" in err and "group size" not in err, err
    with pytest.raises(GptlabError, match="input width 96: choose one of 32$"):
        quantize_base(tiny_model(n_embd=96), "int4", 64)  # a caller that chose the size is told which divide


# --- the memory: the base read as it trains, and the check's count of it -------------------------------------------
def model_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of every parameter and buffer, tied ones once; trainable parameters), counted on the real tensors."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return (sum(t.numel() * t.element_size() for t in tensors.values()),
            sum(p.numel() for p in model.parameters() if p.requires_grad))


@pytest.mark.parametrize(("mode", "dtype"), [("int4", "bfloat16"), ("int8", "bfloat16"), (None, "bfloat16"),
                                             ("int4", "float32")])
def test_the_memory_estimate_counts_the_weights_a_lora_run_holds(mode: str | None, dtype: str) -> None:
    """Built on the meta device, the estimate's weights are the bytes of the real model after the trainer's
    quantizing, adapting and casting (`Precision`'s frozen mode), and its states 12 bytes a trainable parameter;
    the quantized Linears by hand: int4 half a byte a weight + an fp16 scale and low end per 32, int8 a byte + an
    fp32 scale per row."""
    from gptlab.train import build_train_config
    from gptlab.train.memory import step_memory
    from gptlab.train.precision import Precision

    cfg = build_train_config({"init_from": "x", "lora_rank": 4, "dtype": dtype, "batch_size": 2, "grad_accum": 1,
                              **({"quantize": mode} if mode else {})})
    model = tiny_model().float().train()
    linears = [(m.out_features, m.in_features) for m in model.modules() if plain_linear(m) and m is not
               model.lm_head]
    plain = sum(p.numel() for p in model.parameters())
    if mode:
        quantize_base(model, mode)
    torch.manual_seed(0)
    add_lora(model, LoRASpec(rank=4, quantize=mode))
    Precision(model, dtype, "cpu", attention_fp32=True, distributed=False)
    real, trainable = model_bytes(model)
    estimate = step_memory(cfg, model.config, 1, fresh=False)
    assert (estimate.weights, estimate.states) == (real, 12 * trainable)
    elt = 4 if dtype == "float32" else 2
    quantized = sum(n * k for n, k in linears) if mode else 0
    per_layer = {"int4": lambda n, k: n * k // 2 + 2 * 2 * n * k // 32, "int8": lambda n, k: n * k + 4 * n,
                 None: lambda n, k: 0}[mode]
    assert real == elt * (plain - quantized) + sum(per_layer(n, k) for n, k in linears) + 4 * trainable
    largest = max(n * k for n, k in linears)
    without = step_memory(dataclasses.replace(cfg, quantize=None), model.config, 1, fresh=False)
    assert estimate.activations - without.activations == (largest * elt if mode else 0)
    assert estimate.to_come == estimate.states + estimate.activations


@pytest.mark.parametrize("mode", ["int4", None])
def test_the_base_read_one_tensor_at_a_time_is_the_base_loaded_whole_then_converted(tmp_path: Path,
                                                                                      mode: str | None) -> None:
    from gptlab.checkpoint import save_model
    from gptlab.loading import load_frozen_base

    save_model(tmp_path / "base", tiny_model())
    streamed = load_frozen_base(tmp_path / "base", torch.bfloat16, mode)
    whole = tiny_model().float()
    if mode:
        quantize_base(whole, mode)
    want = {**{n: p.to(torch.bfloat16) for n, p in whole.named_parameters()}, **dict(whole.named_buffers())}
    got = {**dict(streamed.named_parameters()), **dict(streamed.named_buffers())}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=name)
    assert not any(p.requires_grad for p in streamed.parameters())
    assert streamed.lm_head.weight is streamed.transformer.wte.weight or not streamed.config.tie_embeddings


def test_the_trainer_prints_the_estimate_before_the_first_step(tmp_path: Path, capsys) -> None:
    data = make_data(tmp_path, chars=5_000)
    base_recipe = write_recipe(tmp_path, "base.toml", max_steps=2, warmup_steps=1, eval_interval=0)
    assert main(["train", str(base_recipe), "--data", str(data), "--out", str(tmp_path / "base"), "--quiet"]) == 0
    recipe = write_recipe(tmp_path, "qlora.toml", max_steps=2, warmup_steps=1, eval_interval=0)
    recipe.write_text("\n".join(line for line in recipe.read_text().splitlines()
                                if line.split(" =")[0] not in ("model", "n_embd", "n_head", "n_kv_head", "block_size")))
    capsys.readouterr()
    assert main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / "run"), "--init-from",
                 str(tmp_path / "base"), "--lora-rank", "4", "--quantize", "int4"]) == 0
    out = capsys.readouterr().out
    assert "memory per step: at least" in out and "weights" in out and "free on cpu" in out


@pytest.mark.parametrize(("mode", "dtype"), [("int4", torch.bfloat16), ("int8", torch.bfloat16),
                                             ("int4", torch.float32)])
def test_blocks_compute_what_the_whole_weight_does_without_ever_holding_it(mode: str, dtype: torch.dtype,
                                                                          monkeypatch) -> None:
    """A (200, 320) layer in blocks of 64 x 64 weights: output and input gradient equal to the one-block call's
    (the whole weight dequantized), in bf16 to the bit, in fp32 within its rounding (the CPU's fp32 GEMM orders a
    sum by the output's width: a short last block's differs), and no tensor of the step as large as the weight in
    `dtype` (the whole-weight call's buffer is)."""
    torch.manual_seed(0)
    layer = FrozenQuantizedLinear(nn.Linear(320, 200), mode, 32)
    layer.bias.data = layer.bias.data.to(dtype)
    x = torch.randn(4, 7, 320, dtype=dtype)
    out_grad = torch.randn(4, 7, 200, dtype=dtype)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(out_grad)
        return y, xi.grad

    qlora._WORKSPACES.clear()
    y_whole, gx_whole = run()
    monkeypatch.setattr(qlora, "block_elements", lambda device: 64 * 64)
    qlora._WORKSPACES.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        y, gx = run()
    exact = {"atol": 0, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(y, y_whole, **exact)
    torch.testing.assert_close(gx, gx_whole, **exact)
    allocations = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    weight_bytes = 200 * 320 * torch.finfo(dtype).bits // 8
    assert allocations and max(allocations) < weight_bytes
    assert qlora._WORKSPACES[(torch.device("cpu"), dtype)].numel() == qlora.workspace_elements(layer) == 64 * 320
