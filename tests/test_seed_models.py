"""The seed documents' own models, exactly: each is written again here from its maths with plain torch ops, given
its own random weights, those weights are loaded into gptlab's GPT (strictly: every tensor placed, none missing),
and the two must give the same fp32 logits (atol 1e-5).

The references share a few primitives written from their definitions (RMSNorm and LayerNorm by their formulas,
GELU by its tanh approximation or erf, causal attention as softmax(q k^T / sqrt(hs) + causal mask) v with query
head j reading key/value head j // (n_head / n_kv_head), RoPE as a per-position block rotation matrix). The models:

- pocket transformer: token embeddings -> parameter-free RMSNorm -> 6 pre-norm blocks (parameter-free RMSNorm,
  grouped-query attention (6 query heads, 2 KV heads) with rotate-half RoPE, squared-ReLU MLP of 4 * 384, no
  biases) -> parameter-free RMSNorm -> untied head (tied in `pocket-tied`).
- tinytorch GPT: token + learned position embeddings -> pre-norm blocks (LayerNorm with bias, multi-head
  attention and GELU MLP with biases) -> LayerNorm -> untied head; every Linear initialised N(0, 0.02) with no
  GPT-2 residual scaling. Both GELU forms (tanh, erf) are checked.
- LayerNorm bias without Linear bias (the GPT chapter's parameter-count formula): the same GPT-2 block with biases
  only in the LayerNorms, checked against a closed-form count as well.
- GPT-J: parallel block x + attn(ln(x)) + mlp(ln(x)) with ONE LayerNorm, interleaved ("rotate every two") RoPE on
  the first rotary_dim dims of q and k, attention without biases, MLP with biases, tanh GELU, final LayerNorm,
  untied LM head with a bias.

The references' weights are drawn off any init (norm scales around 1 but not 1, biases not 0) so that a tensor in
the wrong place changes the logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import attention_patterns

from gptlab import GPT, GPTConfig, parameter_breakdown
from gptlab.rope import apply_rope, rope_tables

EPS = 1e-5  # every norm's epsilon (GPTConfig's default norm_eps)
ATOL = 1e-5
BASE = 10000.0  # RoPE base

pytestmark = pytest.mark.usefixtures("one_thread")  # small forwards: fastest without thread hand-offs


# ---------------------------------------------------------------------------------------------------------------------
# Weights: drawn here, then mapped onto gptlab's parameter names
# ---------------------------------------------------------------------------------------------------------------------
def matrix(n_in: int, n_out: int) -> torch.Tensor:
    """A weight used as x @ W (n_in, n_out), std 1/sqrt(n_in) so activations stay O(1)."""
    return torch.randn(n_in, n_out) / math.sqrt(n_in)


def embedding(n: int, C: int) -> torch.Tensor:
    """A table of n rows, std 1/sqrt(C): a tied head then gives O(1) logits, where fp32 keeps 1e-5."""
    return torch.randn(n, C) / math.sqrt(C)


def scale(n: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(n)


def shift(n: int) -> torch.Tensor:
    return 0.1 * torch.randn(n)


def load(config: GPTConfig, state: dict[str, torch.Tensor]) -> GPT:
    """gptlab's model with exactly these tensors (strict: a missing or unexpected name fails)."""
    model = GPT(config).eval()
    model.load_state_dict(state, strict=True)
    return model


def logits_of(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx)[0]


# ---------------------------------------------------------------------------------------------------------------------
# Primitives, from their definitions
# ---------------------------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps), no learned scale."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(x - mean) / sqrt(biased variance + eps) * w (+ b)."""
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + EPS) * w
    return y if b is None else y + b


def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))  # x Phi(x)


def affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return x @ w if b is None else x @ w + b


def rotation_matrices(T: int, hs: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """(T, hs, hs): at position t, the i-th pair of dims (a, b) turns by t * BASE^(-2i / rotary_dim):
    a' = a cos - b sin, b' = a sin + b cos; dims past rotary_dim are left alone (identity rows).
    Pairs: (2i, 2i + 1) interleaved (GPT-J), (i, i + rotary_dim / 2) rotate-half (Llama, NeoX)."""
    R = torch.eye(hs).repeat(T, 1, 1)
    n_pairs = rotary_dim // 2
    for t in range(T):
        for i in range(n_pairs):
            angle = t * BASE ** (-2 * i / rotary_dim)
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + n_pairs)
            c, s = math.cos(angle), math.sin(angle)
            R[t, a, a], R[t, a, b] = c, -s
            R[t, b, a], R[t, b, b] = s, c
    return R


def attention(
    h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, n_head: int,
    n_kv_head: int, rotation: torch.Tensor | None = None, bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None, bv: torch.Tensor | None = None, bo: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal multi-head attention of h (B, T, C); query head j reads key/value head j // (n_head / n_kv_head);
    q and k turned by `rotation` (T, hs, hs) when given."""
    B, T, _ = h.shape
    hs = wq.shape[1] // n_head
    q = affine(h, wq, bq).view(B, T, n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
    k = affine(h, wk, bk).view(B, T, n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
    v = affine(h, wv, bv).view(B, T, n_kv_head, hs).transpose(1, 2)
    if rotation is not None:
        q = torch.einsum("tij,bhtj->bhti", rotation, q)
        k = torch.einsum("tij,bhtj->bhti", rotation, k)
    kv_of = torch.arange(n_head) // (n_head // n_kv_head)
    k, v = k[:, kv_of], v[:, kv_of]  # (B, nh, T, hs)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hs)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # key j > query i
    y = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    return affine(y.transpose(1, 2).reshape(B, T, n_head * hs), wo, bo)


# ---------------------------------------------------------------------------------------------------------------------
# The pocket transformer
# ---------------------------------------------------------------------------------------------------------------------
def pocket_weights(V: int, C: int, L: int, n_head: int, n_kv_head: int, hidden: int, tied: bool) -> dict:
    hs = C // n_head
    p = {"wte": embedding(V, C), "layers": []}
    for _ in range(L):
        p["layers"].append(dict(wq=matrix(C, n_head * hs), wk=matrix(C, n_kv_head * hs), wv=matrix(C, n_kv_head * hs),
                                wo=matrix(n_head * hs, C), w1=matrix(C, hidden), w2=matrix(hidden, C)))
    p["head"] = p["wte"].T if tied else matrix(C, V)
    return p


def pocket_state(p: dict) -> dict[str, torch.Tensor]:
    """gptlab names: no norm has a parameter, c_attn holds [q | k | v] as (out, in)."""
    state = {"transformer.wte.weight": p["wte"], "lm_head.weight": p["head"].T.contiguous()}
    for i, lp in enumerate(p["layers"]):
        pre = f"transformer.h.{i}."
        state[pre + "attn.c_attn.weight"] = torch.cat([lp["wq"], lp["wk"], lp["wv"]], dim=1).T.contiguous()
        state[pre + "attn.c_proj.weight"] = lp["wo"].T.contiguous()
        state[pre + "mlp.c_fc.weight"] = lp["w1"].T.contiguous()
        state[pre + "mlp.c_proj.weight"] = lp["w2"].T.contiguous()
    return state


def pocket_forward(p: dict, idx: torch.Tensor, n_head: int, n_kv_head: int) -> torch.Tensor:
    C = p["wte"].shape[1]
    hs = C // n_head
    R = rotation_matrices(idx.shape[1], hs, hs, interleaved=False)
    x = rms_norm(p["wte"][idx])  # the embeddings are normalized before the first block
    for lp in p["layers"]:
        x = x + attention(rms_norm(x), lp["wq"], lp["wk"], lp["wv"], lp["wo"], n_head, n_kv_head, R)
        x = x + torch.relu(rms_norm(x) @ lp["w1"]).square() @ lp["w2"]
    return rms_norm(x) @ p["head"]


def test_pocket_preset_parameter_counts():
    V, C, L, nh, nkv, hidden = 50257, 384, 6, 6, 2, 1536
    hs = C // nh
    per_layer = C * (nh + 2 * nkv) * hs + nh * hs * C + 2 * C * hidden  # no biases, no norm weights
    assert 2 * V * C + L * per_layer == 48_034_560
    assert parameter_breakdown(GPTConfig.preset("pocket"))["total"] == 48_034_560
    assert parameter_breakdown(GPTConfig.preset("pocket"))["norms"] == 0
    tied = parameter_breakdown(GPTConfig.preset("pocket-tied"))["total"]
    assert 48_034_560 - tied == V * C


@pytest.mark.parametrize("preset", ["pocket", "pocket-tied"])
def test_pocket_matches_reference(preset):
    torch.manual_seed(0)
    config = GPTConfig.preset(preset, vocab_size=101, block_size=16)  # the preset's own shape, a small vocab
    assert (config.n_layer, config.n_head, config.n_kv_head, config.n_embd, config.hidden_size) == (6, 6, 2, 384, 1536)
    p = pocket_weights(101, 384, 6, 6, 2, 1536, tied=config.tie_embeddings)
    model = load(config, pocket_state(p))
    idx = torch.randint(0, 101, (2, 16))
    expected = pocket_forward(p, idx, 6, 2)
    torch.testing.assert_close(logits_of(model, idx), expected, atol=ATOL, rtol=0)
    with torch.no_grad():  # the manual attention path too
        torch.testing.assert_close(attention_patterns(model, idx)[0], expected, atol=ATOL, rtol=0)
    if preset == "pocket":  # the switch matters: without the embedding norm (the old preset) the logits move
        without = load(config.replace(embedding_norm=False), pocket_state(p))
        assert (logits_of(without, idx) - expected).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------------------------
# GPT-2-shaped references: tinytorch's GPT, and LayerNorm biases without Linear biases
# ---------------------------------------------------------------------------------------------------------------------
def gpt2_weights(V: int, T: int, C: int, L: int, linear_bias: bool, norm_bias: bool, tied: bool) -> dict:
    def bias(n: int) -> torch.Tensor | None:
        return shift(n) if linear_bias else None

    def norm(prefix: str) -> dict:
        return {prefix + "w": scale(C), prefix + "b": shift(C) if norm_bias else None}

    p = {"wte": embedding(V, C), "wpe": embedding(T, C), "layers": [], **norm("lnf_")}
    for _ in range(L):
        p["layers"].append(dict(**norm("ln1_"), **norm("ln2_"),
                                wq=matrix(C, C), wk=matrix(C, C), wv=matrix(C, C), wo=matrix(C, C),
                                bq=bias(C), bk=bias(C), bv=bias(C), bo=bias(C),
                                w1=matrix(C, 4 * C), b1=bias(4 * C), w2=matrix(4 * C, C), b2=bias(C)))
    p["head"] = p["wte"].T if tied else matrix(C, V)
    return p


def gpt2_state(p: dict) -> dict[str, torch.Tensor]:
    state = {"transformer.wte.weight": p["wte"], "transformer.wpe.weight": p["wpe"],
             "transformer.ln_f.weight": p["lnf_w"], "transformer.ln_f.bias": p["lnf_b"],
             "lm_head.weight": p["head"].T.contiguous()}
    for i, lp in enumerate(p["layers"]):
        pre = f"transformer.h.{i}."
        biases = (lp["bq"], lp["bk"], lp["bv"])
        state.update({
            pre + "ln_1.weight": lp["ln1_w"], pre + "ln_1.bias": lp["ln1_b"],
            pre + "ln_2.weight": lp["ln2_w"], pre + "ln_2.bias": lp["ln2_b"],
            pre + "attn.c_attn.weight": torch.cat([lp["wq"], lp["wk"], lp["wv"]], dim=1).T.contiguous(),
            pre + "attn.c_attn.bias": None if biases[0] is None else torch.cat(biases),
            pre + "attn.c_proj.weight": lp["wo"].T.contiguous(), pre + "attn.c_proj.bias": lp["bo"],
            pre + "mlp.c_fc.weight": lp["w1"].T.contiguous(), pre + "mlp.c_fc.bias": lp["b1"],
            pre + "mlp.c_proj.weight": lp["w2"].T.contiguous(), pre + "mlp.c_proj.bias": lp["b2"],
        })
    return {k: v for k, v in state.items() if v is not None}


def gpt2_forward(p: dict, idx: torch.Tensor, n_head: int, approximate: str) -> torch.Tensor:
    """Pre-norm GPT: x = wte[idx] + wpe[t]; x += attn(LN1(x)); x += W2 gelu(W1 LN2(x)); logits = LNf(x) head."""
    x = p["wte"][idx] + p["wpe"][: idx.shape[1]]
    for lp in p["layers"]:
        h = layer_norm(x, lp["ln1_w"], lp["ln1_b"])
        x = x + attention(h, lp["wq"], lp["wk"], lp["wv"], lp["wo"], n_head, n_head,
                          bq=lp["bq"], bk=lp["bk"], bv=lp["bv"], bo=lp["bo"])
        h = layer_norm(x, lp["ln2_w"], lp["ln2_b"])
        x = x + affine(gelu(affine(h, lp["w1"], lp["b1"]), approximate), lp["w2"], lp["b2"])
    return layer_norm(x, p["lnf_w"], p["lnf_b"]) @ p["head"]


def linear_weights(model: GPT, suffix: str) -> torch.Tensor:
    return torch.cat([m.weight.flatten() for name, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and name.endswith(suffix)])


def test_tinytorch_init_has_no_residual_scaling():
    shape = dict(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**shape, scale_residual_init=False))
    for name, m in plain.named_modules():  # every Linear N(0, 0.02): c_attn, both c_proj, c_fc, lm_head
        if isinstance(m, torch.nn.Linear):
            assert abs(m.weight.std().item() - 0.02) < 0.02 * 0.05, name
            assert abs(m.weight.mean().item()) < 0.02 * 0.05, name
    ratio = linear_weights(plain, "c_proj").std() / linear_weights(plain, "c_fc").std()
    assert abs(ratio.item() - 1.0) < 0.02
    torch.manual_seed(0)
    gpt2 = GPT(GPTConfig(**shape))  # default: GPT-2's 1/sqrt(2 * n_layer) on the residual projections
    ratio = linear_weights(gpt2, "c_proj").std() / linear_weights(gpt2, "c_fc").std()
    assert abs(ratio.item() - 1 / math.sqrt(2 * 8)) < 0.02 / math.sqrt(2 * 8)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_tinytorch_gpt_matches_reference(approximate):
    torch.manual_seed(1)
    config = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=64, bias=True,
                       tie_embeddings=False, scale_residual_init=False, gelu_approximate=approximate)
    p = gpt2_weights(97, 16, 64, 2, linear_bias=True, norm_bias=True, tied=False)
    model = load(config, gpt2_state(p))
    idx = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(logits_of(model, idx), gpt2_forward(p, idx, 4, approximate), atol=ATOL, rtol=0)


def layernorm_bias_only_count(V: int, T: int, C: int, L: int) -> int:
    """Token and position tables, then per layer attention (q, k, v and output: 4 C^2), MLP (C -> 4C -> C: 8 C^2)
    and two LayerNorms with weight and bias (4 C), then the final LayerNorm (2 C); the head is tied."""
    return V * C + T * C + L * (4 * C * C + 8 * C * C + 4 * C) + 2 * C


def test_layernorm_bias_without_linear_bias():
    shape = dict(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=64)
    config = GPTConfig(**shape, bias=False, norm_bias=True, norm="layernorm")
    model = GPT(config)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert linears and all(m.bias is None for m in linears)
    assert len(norms) == 2 * 2 + 1 and all(m.bias is not None and m.weight is not None for m in norms)
    assert model.num_parameters() == layernorm_bias_only_count(97, 16, 64, 2)
    gpt2_small = GPTConfig(bias=False, norm_bias=True)  # GPT-2 small's shape, on the meta device
    assert parameter_breakdown(gpt2_small)["total"] == layernorm_bias_only_count(50257, 1024, 768, 12)

    torch.manual_seed(2)
    p = gpt2_weights(97, 16, 64, 2, linear_bias=False, norm_bias=True, tied=True)
    model = load(config, gpt2_state(p))
    idx = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(logits_of(model, idx), gpt2_forward(p, idx, 4, "tanh"), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# GPT-J
# ---------------------------------------------------------------------------------------------------------------------
GPTJ = dict(block="parallel", shared_norm=True, position="rope", rope_interleaved=True, rotary_fraction=0.25,
            bias=True, qkv_bias=False, attn_proj_bias=False, head_bias=True, tie_embeddings=False, mlp="gelu",
            gelu_approximate="tanh", norm="layernorm")


def gptj_weights(V: int, C: int, L: int, hidden: int) -> dict:
    p = {"wte": embedding(V, C), "lnf_w": scale(C), "lnf_b": shift(C), "head": matrix(C, V), "head_b": shift(V),
         "layers": []}
    for _ in range(L):
        p["layers"].append(dict(ln_w=scale(C), ln_b=shift(C), wq=matrix(C, C), wk=matrix(C, C), wv=matrix(C, C),
                                wo=matrix(C, C), w1=matrix(C, hidden), b1=shift(hidden), w2=matrix(hidden, C),
                                b2=shift(C)))
    return p


def gptj_state(p: dict) -> dict[str, torch.Tensor]:
    state = {"transformer.wte.weight": p["wte"], "transformer.ln_f.weight": p["lnf_w"],
             "transformer.ln_f.bias": p["lnf_b"], "lm_head.weight": p["head"].T.contiguous(),
             "lm_head.bias": p["head_b"]}
    for i, lp in enumerate(p["layers"]):
        pre = f"transformer.h.{i}."
        state.update({
            pre + "ln_1.weight": lp["ln_w"], pre + "ln_1.bias": lp["ln_b"],
            pre + "attn.c_attn.weight": torch.cat([lp["wq"], lp["wk"], lp["wv"]], dim=1).T.contiguous(),
            pre + "attn.c_proj.weight": lp["wo"].T.contiguous(),
            pre + "mlp.c_fc.weight": lp["w1"].T.contiguous(), pre + "mlp.c_fc.bias": lp["b1"],
            pre + "mlp.c_proj.weight": lp["w2"].T.contiguous(), pre + "mlp.c_proj.bias": lp["b2"],
        })
    return state


def gptj_forward(p: dict, idx: torch.Tensor, n_head: int, rotary_dim: int, interleaved: bool = True) -> torch.Tensor:
    """x += attn(LN(x)) + W2 gelu_tanh(W1 LN(x) + b1) + b2 with one LN per block; logits = LNf(x) head + b."""
    C = p["wte"].shape[1]
    R = rotation_matrices(idx.shape[1], C // n_head, rotary_dim, interleaved)
    x = p["wte"][idx]
    for lp in p["layers"]:
        h = layer_norm(x, lp["ln_w"], lp["ln_b"])
        a = attention(h, lp["wq"], lp["wk"], lp["wv"], lp["wo"], n_head, n_head, R)
        x = x + a + affine(gelu(affine(h, lp["w1"], lp["b1"]), "tanh"), lp["w2"], lp["b2"])
    return affine(layer_norm(x, p["lnf_w"], p["lnf_b"]), p["head"], p["head_b"])


def test_gptj_matches_reference():
    torch.manual_seed(3)
    config = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=128, mlp_hidden=256, **GPTJ)
    assert config.rotary_dim == 8  # a quarter of head size 32
    p = gptj_weights(97, 128, 2, 256)
    model = load(config, gptj_state(p))
    idx = torch.randint(0, 97, (2, 16))
    expected = gptj_forward(p, idx, 4, 8)
    torch.testing.assert_close(logits_of(model, idx), expected, atol=ATOL, rtol=0)
    # the layout matters: rotate-half pairs on the same weights give other logits
    assert (gptj_forward(p, idx, 4, 8, interleaved=False) - expected).abs().max() > 1e-3


def test_gptj_6b_parameter_count():
    """GPT-J 6B's published 6,050,882,784, from its config (not the preset, which has its own test)."""
    config = GPTConfig(vocab_size=50400, block_size=2048, n_layer=28, n_head=16, n_embd=4096, mlp_hidden=16384,
                       **GPTJ)
    V, C, L, hidden = 50400, 4096, 28, 16384
    per_layer = 4 * C * C + 2 * C * hidden + hidden + C + 2 * C  # attention (no bias), MLP with biases, one LN
    assert V * C + L * per_layer + 2 * C + C * V + V == 6_050_882_784
    assert parameter_breakdown(config)["total"] == 6_050_882_784


def test_interleaved_rope_is_complex_multiplication_of_adjacent_pairs():
    """Pairs (x[2i], x[2i+1]) as complex numbers times e^(i t theta_i), theta_i = base^(-2i / rotary_dim); the
    dims past rotary_dim pass through."""
    config = GPTConfig(n_embd=64, n_head=2, position="rope", rope_interleaved=True, rotary_fraction=0.5)
    hs, rd, T = 32, config.rotary_dim, 7
    assert rd == 16
    pos = torch.arange(T)[None]
    cos, sin = rope_tables(config, pos)
    theta = BASE ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * theta  # (T, rd / 2)
    torch.testing.assert_close(cos[0, 0].double(), angles.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[0, 0].double(), angles.sin(), atol=1e-6, rtol=0)

    x = torch.randn(2, 3, T, hs)
    out = apply_rope(x, cos, sin, interleaved=True)
    pairs = torch.view_as_complex(x[..., :rd].double().reshape(2, 3, T, rd // 2, 2).contiguous())
    turned = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).reshape(2, 3, T, rd)
    torch.testing.assert_close(out[..., :rd].double(), turned, atol=1e-5, rtol=0)
    assert torch.equal(out[..., rd:], x[..., rd:])
