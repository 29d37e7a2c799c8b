"""Architecture switches of the modern families (Llama, Qwen2/3, Mistral, Gemma 2, Phi-3, GPT-J, scaled RoPE):
the KV cache against whole forwards, sliding windows against their definition, causality, RoPE scalings against
transformers, and the config's validation. Every model is tiny and fp32; the transformers comparisons come last
and skip without it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from families import BLOCK, FAMILIES, VOCAB, build, config
from helpers import attention_patterns
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import GPT, GPTConfig, KVCache
from gptlab.config import RopeScaling
from gptlab.generation import Engine, SamplingParams
from gptlab.rope import inv_frequencies

pytestmark = pytest.mark.usefixtures("one_thread")

SLIDING = ["mistral", "gemma2", "phi3"]


_MODELS: dict[str, GPT] = {}


def model_of(family: str) -> GPT:
    if family not in _MODELS:
        _MODELS[family] = build(family)
    return _MODELS[family]


def tokens(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_the_families_are_what_they_say():
    """The switches under test really are on (a config quietly normalized away would test nothing)."""
    g = config("gemma2")
    assert g.head_size == 16 and g.n_embd // g.n_head == 8
    assert [g.sliding_layer(i) for i in range(4)] == [True, False, True, False]
    assert config("qwen3").head_size == 16 and config("qwen2").has_bias("qkv") and not config("qwen2").bias
    j = config("gptj")
    assert j.rotary_dim == 4 and not j.has_bias("qkv") and not j.has_bias("attn_proj") and j.has_bias("mlp")
    assert config("phi3").rotary_dim == 8
    assert [config("mistral").sliding_layer(i) for i in range(3)] == [True, True, True]
    model = model_of("gptj")
    assert not hasattr(model.transformer.h[0], "ln_2") and model.lm_head.bias is not None


# ---------------------------------------------------------------------------------------------------------
# The KV cache: chunked feeding equals one whole forward, for every family
# ---------------------------------------------------------------------------------------------------------
@st.composite
def chunkings(draw, min_total: int = 14) -> list[int]:
    """Chunk sizes summing to at most BLOCK: a prefill, then a mix that always holds a 1-token decoding step and a
    multi-token chunk after a non-empty cache, then 1-token steps until the sequence is well past any window."""
    first = draw(st.integers(1, 12))
    rest = draw(st.lists(st.integers(1, 6), max_size=4))
    rest.insert(draw(st.integers(0, len(rest))), 1)
    rest.insert(draw(st.integers(0, len(rest))), draw(st.integers(2, 9)))
    chunks = [first, *rest]
    while sum(chunks) < min_total:
        chunks.append(1)
    assert sum(chunks) <= BLOCK
    return chunks


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=25, deadline=None)
@given(chunks=chunkings(), seed=st.integers(0, 2**16))
def test_cache_equals_no_cache(family, chunks, seed):
    model = model_of(family)
    idx = tokens(seed, (2, sum(chunks)))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config, batch_size=2)
        pieces, start = [], 0
        for n in chunks:
            pieces.append(model(idx[:, start : start + n], kv_cache=cache)[0])
            start += n
    assert cache.lengths.tolist() == [start, start]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@settings(max_examples=25, deadline=None)
@given(
    prompt_lengths=st.tuples(st.integers(1, 20), st.integers(1, 20)),
    steps=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_cache_rows_at_different_lengths_with_a_window(family, prompt_lengths, steps, seed):
    """Rows prefilled separately (cache.rows) to different lengths, then fed together: each row's logits are those
    of its own whole forward, also once the rows are past the window by different amounts."""
    model = model_of(family)
    la, lb = prompt_lengths
    steps = [1, *steps]  # at least one decoding step with rows at different lengths
    total = sum(steps)
    seqs = tokens(seed, (2, max(la, lb) + total))
    with torch.no_grad():
        cache = KVCache(model.config, batch_size=2)
        got = [[model(seqs[:1, :la], kv_cache=cache.rows(0, 1))[0][0]],
               [model(seqs[1:, :lb], kv_cache=cache.rows(1, 2))[0][0]]]
        assert cache.lengths.tolist() == [la, lb]
        ends = [la, lb]
        for n in steps:
            batch = torch.stack([seqs[r, ends[r] : ends[r] + n] for r in range(2)])
            logits, _ = model(batch, kv_cache=cache)
            for r in range(2):
                got[r].append(logits[r])
                ends[r] += n
        for r, length in enumerate((la, lb)):
            ref, _ = model(seqs[r : r + 1, : length + total])
            assert (torch.cat(got[r]) - ref[0]).abs().max() < 1e-4, f"row {r}"


_ENGINE_MODELS: dict[str, GPT] = {}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prefill_chunk", [None, 2])
def test_engine_greedy_decoding_equals_whole_forwards(family, prefill_chunk):
    """The batched engine (packed weights, prompts of different lengths, whole or chunked prefill) decodes, past
    any window, as whole forwards would: each step's argmax of a no-cache forward over the context so far."""
    if family not in _ENGINE_MODELS:  # a larger init and an untied head: greedy choices that are not all one token
        _ENGINE_MODELS[family] = build(family, seed=1, init_std=0.3, tie_embeddings=False)
    model = _ENGINE_MODELS[family]
    prompts = [tokens(1, (3,)).tolist(), tokens(2, (9,)).tolist()]
    params = SamplingParams(temperature=0, max_new_tokens=16)
    engine = Engine(model, max_batch=2, prefill_chunk=prefill_chunk)
    gens = engine.run([engine.prepare(p, params) for p in prompts])
    for prompt, gen in zip(prompts, gens, strict=True):
        context = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                context.append(int(model(torch.tensor([context]))[0][0, -1].argmax()))
        assert gen.token_ids == context[len(prompt) :]
        assert len(set(gen.token_ids)) > 1


# ---------------------------------------------------------------------------------------------------------
# Sliding windows, from their definition
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "mistral-global"])
def test_sliding_window_attention_weights(family):
    """A sliding layer's query t weighs exactly keys t-W+1..t (W = sliding_window); a global layer weighs every
    key up to t; each row is a distribution."""
    if family == "mistral-global":  # no soft-cap: the fused path runs too
        model = build("mistral", n_layer=4, global_layer_every=2)
    else:
        model = model_of(family)
    cfg, T = model.config, 20
    W = cfg.sliding_window
    idx = tokens(0, (2, T))
    with torch.no_grad():
        _, weights = attention_patterns(model, idx)
    t = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    window = (k <= t) & (k > t - W)
    causal = k <= t
    assert len(weights) == cfg.n_layer
    for layer, w in enumerate(weights):
        assert w.shape == (2, cfg.n_head, T, T)
        assert torch.allclose(w.sum(-1), torch.ones(2, cfg.n_head, T), atol=1e-5)
        seen = window if cfg.sliding_layer(layer) else causal
        assert torch.all(w[..., ~seen] == 0), f"layer {layer} attends outside its keys"
        assert torch.all(w[..., seen] > 0), f"layer {layer} ignores a key it should see"
    assert [cfg.sliding_layer(i) for i in range(cfg.n_layer)] == [True, False, True, False]


def test_sdpa_equals_manual_with_sliding_and_global_layers():
    model = build("mistral", n_layer=4, global_layer_every=2)
    assert model.config.attention == "sdpa"
    idx = tokens(3, (2, 30))
    with torch.no_grad():
        fused, _ = model(idx)
        manual, _ = attention_patterns(model, idx)
        model.config.attention = "manual"
        switched, _ = model(idx)
        model.config.attention = "sdpa"
    assert (fused - manual).abs().max() < 1e-5
    assert torch.equal(manual, switched)
    with torch.no_grad():  # and the window matters: without it the logits past it differ
        unwindowed = build("mistral", n_layer=4, global_layer_every=None, sliding_window=None)(idx)[0]
    assert torch.allclose(fused[:, :5], unwindowed[:, :5], atol=1e-5)
    assert not torch.allclose(fused[:, 5:], unwindowed[:, 5:], atol=1e-3)


@settings(max_examples=20, deadline=None)
@given(t=st.integers(0, 29), seed=st.integers(0, 2**16))
def test_one_sliding_layer_sees_exactly_its_window(t, seed):
    """With one sliding layer, position t's logits depend on tokens t-W+1..t only: changing every token before the
    window changes nothing, changing the window's oldest token does change them."""
    if "mistral-1" not in _MODELS:
        _MODELS["mistral-1"] = build("mistral", n_layer=1)
    model = _MODELS["mistral-1"]
    W = model.config.sliding_window
    idx = tokens(seed, (1, 30))
    before = idx.clone()
    before[0, : max(t - W + 1, 0)] = (before[0, : max(t - W + 1, 0)] + 1) % VOCAB
    oldest = idx.clone()
    oldest[0, max(t - W + 1, 0)] = (oldest[0, max(t - W + 1, 0)] + 1) % VOCAB
    with torch.no_grad():
        a = model(idx)[0][0, t]
        b = model(before)[0][0, t]
        c = model(oldest)[0][0, t]
    assert (a - b).abs().max() < 1e-5
    assert (a - c).abs().max() > 1e-4


def reference_gemma2(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Gemma 2's forward written out from its definition, reading the model's weights: embeddings times sqrt(C),
    RMSNorms scaling by (1 + w), sandwich blocks, GeGLU, rotate-half RoPE, scores scaled by attn_scale and
    soft-capped, even layers local (the last `sliding_window` keys) and odd ones global, soft-capped logits."""
    cfg = model.config
    B, T = idx.shape
    nh, nkv, hs = cfg.n_head, cfg.n_kv_head, cfg.head_size

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * (1 + w)

    pos = torch.arange(T)
    angles = pos[:, None] * cfg.rope_base ** (-torch.arange(0, hs, 2).float() / hs)
    cos, sin = angles.cos(), angles.sin()

    def rope(t: torch.Tensor) -> torch.Tensor:
        a, b = t[..., : hs // 2], t[..., hs // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    wte = model.transformer.wte.weight
    x = wte[idx] * math.sqrt(cfg.n_embd)
    for i, blk in enumerate(model.transformer.h):
        q, k, v = (norm(x, blk.ln_1.weight) @ blk.attn.c_attn.weight.T).split([nh * hs, nkv * hs, nkv * hs], -1)
        q = rope(q.view(B, T, nh, hs).transpose(1, 2))
        k = rope(k.view(B, T, nkv, hs).transpose(1, 2)).repeat_interleave(nh // nkv, dim=1)
        v = v.view(B, T, nkv, hs).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        scores = q @ k.transpose(-1, -2) * cfg.attn_scale
        scores = cfg.attn_softcap * torch.tanh(scores / cfg.attn_softcap)
        seen = pos[None, :] <= pos[:, None]
        if i % 2 == 0:
            seen &= pos[None, :] > pos[:, None] - cfg.sliding_window
        a = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v
        a = a.transpose(1, 2).reshape(B, T, nh * hs) @ blk.attn.c_proj.weight.T
        x = x + norm(a, blk.ln_attn_out.weight)
        gate, up = (norm(x, blk.ln_2.weight) @ blk.mlp.c_fc.weight.T).chunk(2, dim=-1)
        m = (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ blk.mlp.c_proj.weight.T
        x = x + norm(m, blk.ln_mlp_out.weight)
    logits = norm(x, model.transformer.ln_f.weight) @ wte.T
    return cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)


def test_gemma2_forward_equals_its_definition():
    """Small caps so both soft-caps bend the values they see; long enough for the local layers' window to cut."""
    model = build("gemma2", attn_softcap=2.0, logit_softcap=3.0)
    idx = tokens(5, (2, 24))
    with torch.no_grad():
        ours, _ = model(idx)
        ref = reference_gemma2(model, idx)
        cache = KVCache(model.config, batch_size=2)
        cached = torch.cat([model(idx[:, :7], kv_cache=cache)[0], *(model(idx[:, t : t + 1], kv_cache=cache)[0]
                                                                    for t in range(7, 24))], dim=1)
    assert ours.abs().max() > 1.5  # the logit cap is not idle
    assert (ours - ref).abs().max() < 1e-4
    assert (cached - ref).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------------------
# Causality
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "mistral"])
@settings(max_examples=15, deadline=None)
@given(t=st.integers(0, 22), seed=st.integers(0, 2**16))
def test_future_tokens_never_change_earlier_logits(family, t, seed):
    model = model_of(family)
    idx = tokens(seed, (2, 24))
    changed = idx.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + tokens(seed + 1, (2, 23 - t)) % (VOCAB - 1)) % VOCAB
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


# ---------------------------------------------------------------------------------------------------------
# Config validation and serialization
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,needle", [
    (dict(shared_norm=True), "shared_norm"),
    (dict(shared_norm=True, block="sandwich"), "shared_norm"),
    (dict(norm="layernorm", norm_unit_offset=True), "norm_unit_offset"),
    (dict(norm="rmsnorm", norm_weight=False, norm_unit_offset=True), "norm_unit_offset"),
    (dict(global_layer_every=2), "global_layer_every"),
    (dict(sliding_window=4, global_layer_every=1), "global_layer_every"),
    (dict(position="learned", rope_scaling=RopeScaling("linear", factor=2.0)), "rope_scaling"),
    (dict(position="rope", rope_scaling=RopeScaling("longrope", original_context=16, short_factor=(1.0,) * 3,
                                                    long_factor=(2.0,) * 4)), "short_factor"),
    (dict(position="rope", rope_scaling=RopeScaling("longrope", original_context=16, short_factor=(1.0,) * 4,
                                                    long_factor=(2.0,) * 5)), "long_factor"),
    (dict(position="rope", rope_scaling={"kind": "yarn", "factor": 2.0, "original_context": 16, "mscale": 1.0}),
     "mscale"),
    (dict(position="rope", rope_scaling={"kind": "linear", "factor": 2.0, "original_context": 16}),
     "original_context"),
    (dict(position="rope", rope_scaling={"kind": "ntk", "factor": 2.0}), "kind"),
    (dict(position="rope", rope_interleaved=True, qk_norm_weight=True), "qk_norm_weight"),
])
def test_config_errors_are_one_line_naming_the_field(fields, needle):
    # n_embd 32 / 4 heads: head 8, so 4 rotary frequencies
    with pytest.raises(ValueError) as err:
        GPTConfig.from_dict({"vocab_size": VOCAB, "n_layer": 1, "n_head": 4, "n_embd": 32, **fields})
    message = str(err.value)
    assert needle in message and "\n" not in message, message


@pytest.mark.parametrize("scaling,needle", [
    ({"factor": 2.0}, "kind"),
    ("linear", "rope_scaling"),
    ({"kind": "longrope", "original_context": 16, "short_factor": [1.0] * 4, "long_factor": 2.0}, "long_factor"),
    ({"kind": "llama3", "factor": 2.0, "original_context": 16, "low_freq_factor": None}, "low_freq_factor"),
])
def test_malformed_rope_scaling_is_a_value_error(scaling, needle):
    """A hand-edited config.json: the one-line ValueError the CLI reports, not a TypeError traceback."""
    with pytest.raises(ValueError) as err:
        GPTConfig.from_dict({"n_layer": 1, "n_head": 4, "n_embd": 32, "position": "rope", "rope_scaling": scaling})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_residual_and_unit_offset_init():
    """c_proj weights start at std / sqrt(2 n_layer) unless scale_residual_init is off; unit-offset norm weights
    start at 0 (a scale of 1)."""
    for scaled in (True, False):
        torch.manual_seed(0)
        model = GPT(config("gemma2", n_layer=8, n_embd=64, init_std=0.02, scale_residual_init=scaled))
        proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
        fc = torch.cat([b.attn.c_attn.weight.flatten() for b in model.transformer.h])
        assert fc.std().item() == pytest.approx(0.02, rel=0.05)
        assert proj.std().item() == pytest.approx(0.02 / 4 if scaled else 0.02, rel=0.05)
        assert all(torch.all(b.ln_attn_out.weight == 0) for b in model.transformer.h)


def test_longrope_factor_lists_follow_partial_rotary():
    scaling = dict(kind="longrope", original_context=16, short_factor=[1.0] * 2, long_factor=[2.0] * 2)
    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=32, position="rope", rotary_fraction=0.5, rope_scaling=scaling)
    assert cfg.rope_scaling.short_factor == (1.0, 1.0)  # JSON lists become tuples
    with pytest.raises(ValueError, match="short_factor"):
        GPTConfig(n_layer=1, n_head=4, n_embd=32, position="rope", rope_scaling=scaling)


@pytest.mark.parametrize("scaling", [
    RopeScaling("yarn", factor=4.0, original_context=16, attention_factor=1.5, beta_fast=16.0, truncate=False),
    RopeScaling("longrope", original_context=16, short_factor=(1.0, 1.5, 2.0, 3.0), long_factor=(4.0,) * 4),
    RopeScaling("llama3", factor=8.0, original_context=16, low_freq_factor=2.0, high_freq_factor=8.0),
])
def test_json_round_trip_with_rope_scaling(scaling, tmp_path):
    cfg = config("gemma2", rope_scaling=scaling, n_embd=32, head_dim=None)
    back = GPTConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and isinstance(back.rope_scaling, RopeScaling)
    cfg.save(tmp_path / "config.json")
    assert GPTConfig.load(tmp_path / "config.json") == cfg
    assert back.replace(rope_scaling=None) != cfg


def test_unknown_rope_scaling_field_through_from_dict():
    with pytest.raises(ValueError, match=r"unknown rope_scaling field\(s\): rope_type") as err:
        GPTConfig.from_dict({"position": "rope", "rope_scaling": {"kind": "linear", "factor": 2.0,
                                                                 "rope_type": "linear"}})
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# RoPE scalings against transformers (skipped without it)
# ---------------------------------------------------------------------------------------------------------
def _rope_config(scaling: RopeScaling, *, head: int = 64, base: float = 10000.0, fraction: float = 1.0,
                 block_size: int = 4096) -> GPTConfig:
    return GPTConfig(n_layer=1, n_head=4, n_embd=4 * head, block_size=block_size, position="rope", rope_base=base,
                     rotary_fraction=fraction, rope_scaling=scaling)


def _hf_config(cfg: GPTConfig, max_position_embeddings: int, **extra):  # noqa: ANN202
    from transformers import LlamaConfig

    s = cfg.rope_scaling
    params = {"rope_type": s.kind, "rope_theta": cfg.rope_base, **extra}
    if cfg.rotary_fraction != 1.0:
        params["partial_rotary_factor"] = cfg.rotary_fraction
    return LlamaConfig(hidden_size=cfg.n_embd, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
                       max_position_embeddings=max_position_embeddings, rope_parameters=params)


def _same(ours: tuple[torch.Tensor, float], theirs: tuple[torch.Tensor, float]) -> None:
    (inv, factor), (hf_inv, hf_factor) = ours, theirs
    assert inv.shape == hf_inv.shape
    assert torch.allclose(inv, hf_inv.float(), rtol=1e-5, atol=0), (inv - hf_inv).abs().max()
    assert float(factor) == pytest.approx(float(hf_factor), rel=1e-6)


def test_rope_linear_matches_transformers():
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _rope_config(RopeScaling("linear", factor=4.0))
    hf = _hf_config(cfg, 4096, factor=4.0)
    _same(inv_frequencies(cfg, 100), ROPE_INIT_FUNCTIONS["linear"](hf, "cpu", seq_len=100))


@pytest.mark.parametrize("seq_len", [10, 1024, 1025, 3000, 9000])
def test_rope_dynamic_matches_transformers_below_and_above_the_original_context(seq_len):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _rope_config(RopeScaling("dynamic", factor=2.0, original_context=1024))
    hf = _hf_config(cfg, 1024, factor=2.0)  # transformers' dynamic NTK reads the original from max_position
    ours = inv_frequencies(cfg, seq_len)
    _same(ours, ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=seq_len))
    unscaled = inv_frequencies(cfg.replace(rope_scaling=None), seq_len)[0]
    assert torch.equal(ours[0], unscaled) == (seq_len <= 1024)


@pytest.mark.parametrize("scaling,extra", [
    (RopeScaling("yarn", factor=4.0, original_context=1024), {}),  # the paper's attention factor, no mscale
    (RopeScaling("yarn", factor=16.0, original_context=4096, attention_factor=1.25), {"attention_factor": 1.25}),
    (RopeScaling("yarn", factor=8.0, original_context=2048, beta_fast=16.0, beta_slow=2.0),
     {"beta_fast": 16.0, "beta_slow": 2.0}),
    (RopeScaling("yarn", factor=4.0, original_context=1024, truncate=False), {"truncate": False}),
])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_yarn_matches_transformers(scaling, extra, fraction):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _rope_config(scaling, fraction=fraction)
    hf = _hf_config(cfg, 4 * scaling.original_context, factor=scaling.factor,
                    original_max_position_embeddings=scaling.original_context, **extra)
    ours = inv_frequencies(cfg, 50)
    _same(ours, ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu", seq_len=50))
    if scaling.attention_factor is None:
        assert ours[1] == pytest.approx(0.1 * math.log(scaling.factor) + 1)
    base = inv_frequencies(cfg.replace(rope_scaling=None), 50)[0]  # high frequencies kept, low ones / factor
    assert ours[0][0] == base[0] and ours[0][-1] == pytest.approx(float(base[-1]) / scaling.factor, rel=1e-6)


@pytest.mark.parametrize("scaling,base", [
    (RopeScaling("llama3", factor=8.0, original_context=8192, low_freq_factor=1.0, high_freq_factor=4.0), 500000.0),
    (RopeScaling("llama3", factor=32.0, original_context=8192, low_freq_factor=1.0, high_freq_factor=4.0), 500000.0),
    (RopeScaling("llama3", factor=4.0, original_context=512, low_freq_factor=2.0, high_freq_factor=8.0), 10000.0),
])
def test_rope_llama3_matches_transformers(scaling, base):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _rope_config(scaling, base=base)
    hf = _hf_config(cfg, 131072, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                    high_freq_factor=scaling.high_freq_factor,
                    original_max_position_embeddings=scaling.original_context)
    ours = inv_frequencies(cfg, 100)
    _same(ours, ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu", seq_len=100))
    unscaled = inv_frequencies(cfg.replace(rope_scaling=None), 100)[0]
    kept, divided = ours[0] == unscaled, torch.isclose(ours[0], unscaled / scaling.factor)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three regimes are exercised


@pytest.mark.parametrize("seq_len", [5, 1024, 1025, 4096])
@pytest.mark.parametrize("attention_factor", [None, 1.3])
@pytest.mark.parametrize("block_size", [4096, 1024])
def test_rope_longrope_matches_transformers(seq_len, attention_factor, block_size):
    pytest.importorskip("transformers")
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    n = 16  # head 32: 16 frequencies
    short = tuple(1.0 + 0.05 * i for i in range(n))
    long = tuple(1.0 + 0.7 * i for i in range(n))
    scaling = RopeScaling("longrope", original_context=1024, attention_factor=attention_factor, short_factor=short,
                          long_factor=long)
    cfg = _rope_config(scaling, head=32, block_size=block_size)
    params = {"rope_type": "longrope", "rope_theta": cfg.rope_base, "short_factor": list(short),
              "long_factor": list(long)}
    if attention_factor is not None:
        params["attention_factor"] = attention_factor
    hf = Phi3Config(hidden_size=cfg.n_embd, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
                    max_position_embeddings=block_size, original_max_position_embeddings=1024,
                    rope_parameters=params)
    ours = inv_frequencies(cfg, seq_len)
    _same(ours, ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len))
    unscaled = inv_frequencies(cfg.replace(rope_scaling=None), seq_len)[0]
    used = long if seq_len > 1024 else short
    assert torch.allclose(ours[0], unscaled / torch.tensor(used), rtol=1e-6)
