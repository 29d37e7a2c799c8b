"""The model: causality, gradients, attention paths, KV cache, parameter counts, input errors."""

from __future__ import annotations

import itertools
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import attention_patterns
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import GPT, GPTConfig, KVCache, parameter_breakdown
from gptlab.hooks import hooked
from gptlab.kv_cache import Masks

SMALL = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)


def small(**overrides) -> GPTConfig:
    return GPTConfig(**{**SMALL, **overrides})


def build(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(small(**overrides)).eval()
    # move every weight off its init (norm weights of 1, zero biases) so a wrongly wired weight shows
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


GRID = list(itertools.product(("layernorm", "rmsnorm"), ("learned", "rope", "none"), ("gelu", "swiglu", "relu2"),
                              ("pre", "post", "parallel")))


@pytest.mark.parametrize("norm,position,mlp,block", GRID)
def test_causality_over_every_architecture(norm, position, mlp, block):
    model = build(norm=norm, position=position, mlp=mlp, block=block, n_kv_head=2, qk_norm=position == "rope")
    idx = torch.randint(0, 97, (2, 16))
    t = 7
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, 97, (2, 16 - t - 1))
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the later positions do see the change


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(0, 14),
    seq=st.lists(st.integers(0, 96), min_size=16, max_size=16),
    n_kv_head=st.sampled_from([1, 2, 4]),
    position=st.sampled_from(["learned", "rope", "none"]),
)
def test_causality_property(t, seq, n_kv_head, position):
    model = _cached_model(n_kv_head, position)
    idx = torch.tensor([seq])
    changed = idx.clone()
    changed[0, t + 1 :] = (changed[0, t + 1 :] + 1) % 97
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])


_MODELS: dict = {}


def _cached_model(n_kv_head: int, position: str) -> GPT:
    key = (n_kv_head, position)
    if key not in _MODELS:
        _MODELS[key] = build(n_kv_head=n_kv_head, position=position)
    return _MODELS[key]


@pytest.mark.parametrize("preset_like", [dict(), dict(norm="rmsnorm", position="rope", mlp="swiglu", bias=False,
                                                       tie_embeddings=False, n_kv_head=2, qk_norm=True)])
def test_every_parameter_gets_a_gradient_and_initial_loss_is_ln_vocab(preset_like):
    torch.manual_seed(0)
    config = GPTConfig(**{**SMALL, "vocab_size": 1000, **preset_like})
    model = GPT(config)
    idx = torch.randint(0, 1000, (4, 32))
    targets = torch.randint(0, 1000, (4, 32))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(1000)) < 0.1 * math.log(1000)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_loss_ignores_minus_one_targets():
    model = build()
    idx = torch.randint(0, 97, (2, 10))
    targets = torch.randint(0, 97, (2, 10))
    targets[:, :4] = -1
    logits, loss = model(idx, targets)
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, 97), targets[:, 4:].reshape(-1))
    assert torch.allclose(loss, expected, atol=1e-6)


def test_targets_not_shaped_as_the_ids_or_not_integers_are_refused_by_name():
    model = build()
    idx = torch.randint(0, 97, (2, 6))
    # were: "softmax_xent: targets must be (N,) int64" from the kernel; a (3, 4) reshape or the flattened ids
    # paired each target with another position's logits; float targets were truncated (2.7 taken as 2)
    for targets, message in ((idx[:, :3], r"targets must have the token ids' shape \(2, 6\), got \(2, 3\)"),
                             (idx.reshape(3, 4), r"shape \(2, 6\), got \(3, 4\)"),
                             (idx.flatten(), r"shape \(2, 6\), got \(12,\)"),
                             (idx.float() + 0.7, "targets must be an integer tensor, got dtype torch.float32"),
                             (idx.tolist(), "targets must be a torch.Tensor, got list")):
        for hooks in ({}, {"hook_logits": lambda x: None}):  # the fused loss and the plain one
            with pytest.raises(ValueError, match=message), hooked(model, hooks):
                model(idx, targets)
    expected = F.cross_entropy(model(idx).logits.flatten(0, 1), idx.int().flatten().long())
    torch.testing.assert_close(model(idx, idx.int()).loss, expected)  # int32 targets, as int32 ids, are taken


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_sdpa_equals_manual_attention(n_kv_head, position):
    model = build(n_kv_head=n_kv_head, position=position)
    idx = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        fused, _ = model(idx)
        manual, weights = attention_patterns(model, idx)
    assert (fused - manual).abs().max() < 1e-5
    assert len(weights) == 2 and weights[0].shape == (3, 4, 20, 20)
    w = weights[0]
    assert torch.allclose(w.sum(-1), torch.ones(3, 4, 20), atol=1e-5)  # each row a distribution
    assert torch.all(w.triu(diagonal=1) == 0)  # nothing attends to the future
    model.config.attention = "manual"  # the config switch takes the same path
    with torch.no_grad():
        switched, _ = model(idx)
    assert torch.equal(switched, manual)


def test_manual_attention_matches_a_reference_computation():
    """One layer's attention against softmax(QK^T/sqrt(d))V written out with einsum and GQA by hand."""
    model = build(n_kv_head=2, position="none", n_layer=1)
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        model.config.attention = "manual"
        seen: dict[str, torch.Tensor] = {}
        attn.hooks = seen.setdefault  # a hook point's function: records the activation, returns it unchanged
        out = attn(x, None, Masks(None, None), None)
        w = seen["hook_pattern"]
        q, k, v = attn.c_attn(x).split([32, 16, 16], dim=-1)
        q = q.view(2, 9, 4, 8)
        k = k.view(2, 9, 2, 8).repeat_interleave(2, dim=2)
        v = v.view(2, 9, 2, 8).repeat_interleave(2, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(8)
        scores = scores + torch.full((9, 9), float("-inf")).triu(1)
        ref_w = scores.softmax(-1)
        ref = attn.c_proj(torch.einsum("bhts,bshd->bthd", ref_w, v).reshape(2, 9, 32))
    assert torch.allclose(w, ref_w, atol=1e-6)
    assert torch.allclose(out, ref, atol=1e-6)


def test_rope_matches_complex_rotation():
    """RoPE rotates dim pairs (i, i + half) by angle pos * base^(-2i/rot): compare with complex multiplication."""
    from gptlab.rope import apply_rope, rope_tables

    config = small(position="rope", rotary_fraction=0.5)  # head 8, rotary 4: the last 4 dims pass through
    x = torch.randn(1, 4, 6, 8)
    pos = torch.arange(6)[None]
    out = apply_rope(x, *rope_tables(config, pos))
    half = 2
    freqs = 1.0 / (config.rope_base ** (torch.arange(0, 4, 2).float() / 4))
    z = torch.complex(x[..., :half], x[..., half:4]) * torch.polar(torch.ones(6, half), pos[0, :, None] * freqs)
    assert torch.allclose(out[..., :half], z.real, atol=1e-6)
    assert torch.allclose(out[..., half:4], z.imag, atol=1e-6)
    assert torch.equal(out[..., 4:], x[..., 4:])


def test_kept_rope_frequencies_follow_the_config_and_serve_training_after_inference():
    """inv_frequencies keeps what it made for the next forward: a changed base or scaling gets its own, and
    frequencies first made under inference_mode (a decoding step) work in a training forward after it."""
    from gptlab.config import RopeScaling
    from gptlab.rope import inv_frequencies, rope_tables

    config = small(position="rope")
    with torch.inference_mode():
        first, _ = inv_frequencies(config, 0)
    assert inv_frequencies(config, 0)[0] is first  # kept
    config.rope_base = 500.0
    assert torch.equal(inv_frequencies(config, 0)[0], 1.0 / 500.0 ** (torch.arange(0, 8, 2).float() / 8))
    config.rope_scaling = RopeScaling(kind="linear", factor=4.0)
    assert torch.equal(inv_frequencies(config, 0)[0], 1.0 / 500.0 ** (torch.arange(0, 8, 2).float() / 8) / 4)
    config.rope_base = 700.0
    with torch.inference_mode():
        rope_tables(config, torch.arange(6)[None])
    x = torch.randn(4, requires_grad=True)
    (x * inv_frequencies(config, 0)[0]).sum().backward()  # a graph saves them: no inference tensor
    assert torch.equal(x.grad, inv_frequencies(config, 0)[0])


@pytest.mark.parametrize("scaling", [None, "linear", "dynamic"])
def test_rope_looked_up_in_the_kept_table_is_the_computed_rope(scaling: str | None) -> None:
    """rope_at (a decode step's cos and sin, looked up in a kept table of every position) gives rope_tables' values
    for positions shared by the rows or each row's own, past the block size (the table grows), after the config's
    base changed (a table of its own), and under a length-dependent scaling (computed, as rope_tables does)."""
    from gptlab.config import RopeScaling
    from gptlab.rope import rope_at, rope_tables

    config = small(position="rope")
    if scaling is not None:
        extra = {"original_context": 8} if scaling == "dynamic" else {}
        config.rope_scaling = RopeScaling(kind=scaling, factor=2.0, **extra)
    for base in (10000.0, 500.0):
        config.rope_base = base
        for pos in (torch.arange(5, 8)[None], torch.tensor([[3], [0], [40]]), torch.tensor([[3 * config.block_size]])):
            end = int(pos.max()) + 1
            for got, want in zip(rope_at(config, pos, end), rope_tables(config, pos), strict=True):
                assert got.shape == want.shape
                assert torch.allclose(got, want, rtol=0, atol=1e-6)  # (cos computed in another layout: an ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rope_is_the_pairwise_formula_bit_for_bit(dtype, rotary_fraction):
    """apply_rope's full-width form (x cos + rotate_half(x) sin) gives exactly the pairwise sums (a cos - b sin,
    b cos + a sin), values and gradients, with and without dims passing through."""
    from gptlab.rope import apply_rope, rope_tables

    config = small(position="rope", rotary_fraction=rotary_fraction)
    x = torch.randn(2, 4, 6, 8).to(dtype).requires_grad_()
    cos, sin = rope_tables(config, torch.arange(6)[None])
    half, (c, s) = cos.shape[-1], (cos.to(dtype), sin.to(dtype))
    a, b, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    expected = torch.cat((a * c - b * s, b * c + a * s, rest), dim=-1)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out, expected)
    grad = torch.randn(out.shape).to(dtype)
    assert torch.equal(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])


@pytest.mark.parametrize("mlp", ["gelu", "swiglu", "geglu", "relu2"])
def test_mlp_matches_its_formula(mlp):
    model = build(mlp=mlp, n_layer=1)
    m = model.transformer.h[0].mlp
    x = torch.randn(3, 32)
    w1, b1, w2, b2 = m.c_fc.weight, m.c_fc.bias, m.c_proj.weight, m.c_proj.bias
    with torch.no_grad():
        h = x @ w1.T + b1
        if mlp == "gelu":  # GPT-2's tanh approximation, written out
            h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        elif mlp == "relu2":
            h = torch.clamp(h, min=0) ** 2
        elif mlp == "geglu":  # the gate through the tanh GELU, times up
            gate, up = h.chunk(2, dim=-1)
            h = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up
        else:
            gate, up = h.chunk(2, dim=-1)
            h = gate * torch.sigmoid(gate) * up
        assert torch.allclose(m(x), h @ w2.T + b2, atol=1e-5)


@pytest.mark.parametrize("block", ["pre", "post", "parallel", "parallel-shared", "sandwich"])
def test_block_layouts_match_their_formulas(block):
    shared = block == "parallel-shared"
    model = build(block="parallel" if shared else block, shared_norm=shared, n_layer=1, position="none")
    b = model.transformer.h[0]
    x = torch.randn(2, 5, 32)
    none = Masks(None, None)
    with torch.no_grad():
        for p in b.parameters():  # norms off their init, so a norm in the wrong place shows
            p.add_(torch.randn_like(p) * 0.1)
        out = b(x, None, none, None)

        def attn(z):
            return b.attn(z, None, none, None)

        if block == "pre":
            h = x + attn(b.ln_1(x))
            ref = h + b.mlp(b.ln_2(h))
        elif block == "parallel":
            ref = x + attn(b.ln_1(x)) + b.mlp(b.ln_2(x))
        elif shared:
            assert not hasattr(b, "ln_2")
            ref = x + attn(b.ln_1(x)) + b.mlp(b.ln_1(x))
        elif block == "sandwich":
            h = x + b.ln_attn_out(attn(b.ln_1(x)))
            ref = h + b.ln_mlp_out(b.mlp(b.ln_2(h)))
        else:
            h = b.ln_1(x + attn(x))
            ref = b.ln_2(h + b.mlp(h))
    assert torch.allclose(out, ref, atol=1e-6)


def test_rmsnorm_and_softcap():
    model = build(norm="rmsnorm", logit_softcap=2.0)
    x = torch.randn(2, 3, 32)
    norm = model.transformer.ln_f
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    assert torch.allclose(norm(x), ref, atol=1e-5)
    with torch.no_grad():
        logits, _ = model(torch.randint(0, 97, (2, 8)))
    assert logits.abs().max() < 2.0


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_kv_cache_equals_full_forward(n_kv_head, position):
    model = build(n_kv_head=n_kv_head, position=position)
    idx = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config, batch_size=2)
        pieces = [model(idx[:, :10], kv_cache=cache)[0]]  # prefill, then one token at a time
        for t in range(10, 24):
            pieces.append(model(idx[:, t : t + 1], kv_cache=cache)[0])
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-5
    assert cache.lengths.tolist() == [24, 24]


def test_kv_cache_rows_at_different_lengths():
    """Right-padded prompts prefilled together, rows rewound to their own lengths, decode as if alone."""
    model = build(n_kv_head=2, position="rope")
    a = torch.randint(0, 97, (1, 12))
    b = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        cache = KVCache(model.config, batch_size=2)
        padded = torch.cat([a, torch.cat([b, torch.zeros(1, 7, dtype=torch.long)], dim=1)])
        logits, _ = model(padded, kv_cache=cache)
        cache.lengths[1] = 5
        nxt = torch.tensor([[3], [4]])
        step, _ = model(nxt, kv_cache=cache)
        ref_a, _ = model(torch.cat([a, nxt[:1]], dim=1))
        ref_b, _ = model(torch.cat([b, nxt[1:]], dim=1))
    assert (logits[1, 4] - ref_b[0, 4]).abs().max() < 1e-5
    assert (step[0, 0] - ref_a[0, -1]).abs().max() < 1e-5
    assert (step[1, 0] - ref_b[0, -1]).abs().max() < 1e-5


def test_kv_cache_needs_no_grad_and_room():
    model = build()
    cache = KVCache(model.config, batch_size=1, max_len=8)
    with pytest.raises(ValueError, match="no_grad"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 8 tokens"):
        model(torch.zeros(1, 9, dtype=torch.long), kv_cache=cache)


# --- parameter counts: the figures transformers' num_parameters() reports for the same architectures ---------------
@pytest.mark.parametrize("name,count", [
    ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200), ("gpt-neox-20b", 20_554_567_680),
])
def test_parameter_counts_match_transformers(name, count):
    counts = parameter_breakdown(GPTConfig.preset(name))
    assert counts["total"] == count
    assert sum(v for k, v in counts.items() if k != "total") == count


def test_breakdown_matches_a_materialized_model_and_counts_tied_weights_once():
    for tie in (True, False):
        config = small(tie_embeddings=tie)
        model = GPT(config)
        counts = parameter_breakdown(config)
        assert counts["total"] == sum(p.numel() for p in model.parameters()) == model.num_parameters()
        assert counts["head"] == (0 if tie else 97 * 32)
        assert counts["embeddings"] == 97 * 32 + 32 * 32  # tokens + learned positions


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2", n_layer=4, vocab_size=1000))
    c_proj = model.transformer.h[0].attn.c_proj.weight.std().item()
    c_fc = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert abs(c_fc - 0.02) < 0.001
    assert abs(c_proj - 0.02 / math.sqrt(8)) < 0.0005
    assert model.transformer.h[0].attn.c_attn.bias.abs().sum() == 0
    assert model.lm_head.weight is model.transformer.wte.weight


def test_dropout_active_only_in_training():
    model = build(dropout=0.5)
    idx = torch.randint(0, 97, (2, 8))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_optimizer_groups_decay_matrices_only():
    model = build(bias=True, tie_embeddings=False)
    decay, no_decay = model.optimizer_groups(weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    ids = {id(p) for p in decay["params"]}
    assert id(model.transformer.wte.weight) not in ids and id(model.lm_head.weight) not in ids
    assert id(model.transformer.h[0].attn.c_attn.weight) in ids
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    decay_emb, _ = model.optimizer_groups(0.1, decay_embeddings=True)
    assert id(model.transformer.wte.weight) in {id(p) for p in decay_emb["params"]}


def test_frozen_parameters_are_in_no_optimizer_group():
    """A frozen base (adapters train on top of it) must not reach the optimizer: groups hold trainable ones only."""
    model = build(bias=True, tie_embeddings=False)
    for p in list(model.transformer.h[0].parameters()) + [model.lm_head.weight]:
        p.requires_grad_(False)
    grouped = [id(p) for g in model.optimizer_groups(0.1) for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    kinds = model.parameter_groups_by_kind()
    assert kinds["head"] == [] and all(p.requires_grad for ps in kinds.values() for _, p in ps)
    model.requires_grad_(False)
    assert model.optimizer_groups(0.1) == []  # no empty groups for an optimizer to choke on


def test_parameter_components_agree_with_the_breakdown():
    model = build(bias=True, tie_embeddings=False)
    assert parameter_breakdown(model.config)["total"] == model.num_parameters()
    no_emb = model.num_parameters(exclude_embeddings=True)
    tables = model.transformer.wte.weight.numel() + model.transformer.wpe.weight.numel()
    assert no_emb == model.num_parameters() - tables


# --- errors ----------------------------------------------------------------------------------------------------------
def test_input_errors_are_clear():
    model = build()
    with pytest.raises(ValueError, match="exceeds the model's block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token id 97 is outside \[0, 97\)"):
        model(torch.tensor([[1, 97]]))
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(4, dtype=torch.long))


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        small(n_embd=30)
    with pytest.raises(ValueError, match="n_head=4 is not divisible by n_kv_head=3"):
        small(n_kv_head=3)
    with pytest.raises(ValueError, match="norm='batchnorm'"):
        small(norm="batchnorm")
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.preset("gpt5")
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        GPTConfig.from_dict({"n_layers": 3})


def test_presets_and_overrides():
    config = GPTConfig.preset("pocket", n_layer=2)
    assert (config.n_layer, config.n_head, config.n_kv_head, config.n_embd, config.block_size) == (2, 6, 2, 384, 256)
    assert (config.norm, config.position, config.mlp) == ("rmsnorm", "rope", "relu2")
    assert config.hidden_size == 1536 and config.hidden_size % 64 == 0
    swiglu = GPTConfig.preset("pocket-swiglu")
    assert swiglu.hidden_size == 1024  # 8/3 * 384 = 1024, already a multiple of 256
    assert GPTConfig.preset("pythia-70m").rotary_dim == 16  # 25% of head size 64
    assert "gpt-neox-20b" in GPTConfig.presets()
    assert GPTConfig.from_dict(config.to_dict()) == config


def test_from_dict_refuses_what_is_not_a_dict_in_one_line():
    # were a TypeError from inside the unknown-field check ("sequence item 0: expected str instance") or
    # "unknown GPTConfig field(s): x" for the string "x"
    for bad in ([1], "x", None, [("n_layer", 2)]):
        with pytest.raises(ValueError, match=f"read from a dict of its fields, got {type(bad).__name__}$"):
            GPTConfig.from_dict(bad)


def test_a_model_built_from_anything_but_a_config_says_what_it_takes():
    # were "'dict' object has no attribute 'validate'", for the model and for parameter_breakdown alike
    for bad in (small().to_dict(), "gpt2"):
        for build_it in (GPT, parameter_breakdown):
            with pytest.raises(ValueError, match=f"GPT takes a GPTConfig .*, got {type(bad).__name__}$"):
                build_it(bad)


def test_replacing_n_head_keeps_every_head_its_own_keys_unless_told():
    config = small()  # n_kv_head defaults to n_head
    assert config.n_kv_head == config.n_head == 4
    wider = config.replace(n_head=8)
    assert (wider.n_head, wider.n_kv_head) == (8, 8)  # was 4: grouped-query without a word
    assert wider == small(n_head=8)
    assert config.replace(n_head=2).n_kv_head == 2  # was refused: 2 is not divisible by 4
    assert config.replace(n_head=8, n_kv_head=2).n_kv_head == 2
    grouped = small(n_kv_head=2)
    assert grouped.replace(n_head=8).n_kv_head == 2  # a chosen grouping stays


def test_info_command(capsys):
    from gptlab.cli import main

    assert main(["info", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out
    assert main(["info", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


@settings(max_examples=20, deadline=None)
@given(
    splits=st.lists(st.integers(1, 6), min_size=1, max_size=5),  # at most 30 <= block_size
    n_kv_head=st.sampled_from([1, 2, 4]),
    position=st.sampled_from(["learned", "rope"]),
)
def test_cache_equals_no_cache_property(splits, n_kv_head, position):
    """Feeding a sequence through the cache in arbitrary chunks gives the logits of one full forward."""
    model = _cached_model(n_kv_head, position)
    total = sum(splits)
    idx = torch.randint(0, 97, (2, total))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config, batch_size=2)
        pieces, start = [], 0
        for n in splits:
            pieces.append(model(idx[:, start : start + n], kv_cache=cache)[0])
            start += n
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("nh", "nkv"), [(6, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("mask_rows", [0, 1, 5])  # no mask, one shared by the rows, one per row
def test_one_query_attention_equals_grouped_attention_from_the_maths(dtype: torch.dtype, nh: int, nkv: int,
                                                                     mask_rows: int) -> None:
    """`attention.sdpa` with one query per row reads a kv head's group of query heads as positions of it: the
    same numbers as repeating each kv head for its group and attending (computed here in fp64), and as SDPA's own
    enable_gqa."""
    from gptlab.attention import sdpa

    torch.manual_seed(nh * 10 + nkv + mask_rows)
    B, hs, T_k = 5, 16, 23
    q, k, v = torch.randn(B, nh, 1, hs), torch.randn(B, nkv, T_k, hs), torch.randn(B, nkv, T_k, hs)
    lengths = torch.randint(1, T_k + 1, (max(mask_rows, 1),))
    mask = (torch.arange(T_k)[None] < lengths[:, None])[:, None, None, :] if mask_rows else None
    got = sdpa(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.25)
    kr, vr = (t.double().repeat_interleave(nh // nkv, dim=1) for t in (k, v))
    scores = (q.double() @ kr.transpose(-2, -1)) * 0.25
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    want = torch.softmax(scores, dim=-1) @ vr
    assert got.shape == (B, nh, 1, hs) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    theirs = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, scale=0.25,
                                            enable_gqa=nkv != nh)
    torch.testing.assert_close(got.float(), theirs.float(), rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_one_query_attention_takes_any_memory_order_sdpa_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's attention kernels may return their output in another memory order than the CPU's (H100, fp32,
    grouped heads: (B, g, nkv, hs) strides); the grouped one-query path still gives the same numbers."""
    from gptlab import attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 1, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    want = attention.sdpa(q, k, v, None, 0.25)
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    got = attention.sdpa(q, k, v, None, 0.25)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _round_trips(config: GPTConfig, tmp: Path) -> None:
    again = GPTConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.to_dict() == config.to_dict()
    config.save(tmp / "config.json")
    assert GPTConfig.load(tmp / "config.json").to_dict() == config.to_dict()
    assert config.replace().to_dict() == config.to_dict()


@pytest.mark.parametrize("name", GPTConfig.presets())
def test_every_preset_round_trips_through_json(name: str, tmp_path: Path) -> None:
    _round_trips(GPTConfig.preset(name), tmp_path)


@settings(max_examples=40, deadline=None)
@given(n_kv=st.sampled_from([None, 1, 2, 4]), head_dim=st.sampled_from([None, 8, 16]),
       position=st.sampled_from(["learned", "rope", "none"]), norm=st.sampled_from(["layernorm", "rmsnorm"]),
       bias=st.booleans(), qkv_bias=st.sampled_from([None, True, False]), mlp=st.sampled_from(["gelu", "swiglu"]),
       block=st.sampled_from(["pre", "post", "parallel", "sandwich"]), window=st.sampled_from([None, 4]),
       scaling=st.sampled_from([None, {"kind": "linear", "factor": 2.0}]), tie=st.booleans())
def test_any_config_round_trips_through_json(n_kv, head_dim, position, norm, bias, qkv_bias, mlp, block, window,
                                             scaling, tie) -> None:
    config = small(n_kv_head=n_kv, head_dim=head_dim, position=position, norm=norm, bias=bias, qkv_bias=qkv_bias,
                   mlp=mlp, block=block, sliding_window=window, tie_embeddings=tie,
                   rope_scaling=scaling if position == "rope" else None)
    with tempfile.TemporaryDirectory() as tmp:  # hypothesis runs each example again; a fixture's folder would not
        _round_trips(config, Path(tmp))
