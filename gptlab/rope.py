"""Rotary position embeddings (RoPE): the frequencies, their long-context scalings, and the rotation itself.

Each pair of dims (a, b) of a head is rotated by the angle pos * inv_freq[i]: a' = a cos - b sin, b' = b cos + a sin.
Two layouts pair the dims differently: "rotate half" (Llama, NeoX) pairs dim i with dim i + rotary_dim / 2;
"interleaved" (GPT-J, the original RoFormer) pairs dims 2i and 2i + 1. With partial rotary only the first
rotary_dim dims of each head turn; the rest pass through.

Scalings (`GPTConfig.rope_scaling`) change inv_freq, and yarn / longrope also multiply cos and sin by an
attention factor. Two of them depend on the forward's last position (dynamic NTK and longrope switch frequencies
once it passes the pretraining context), as transformers computes them per forward; so under those two, keys
cached before the switch keep their old rotation, exactly as in transformers. Rows of positions of their own (the
engine's batch of separate requests) each take their own last position, so no row depends on the others' lengths.
"""

from __future__ import annotations

import math

import torch

from gptlab.config import GPTConfig, RopeScaling

LENGTH_DEPENDENT = ("dynamic", "longrope")  # scalings whose frequencies change with the sequence's length


def length_dependent(config: GPTConfig) -> bool:
    """Whether the config's RoPE scaling changes its frequencies with the sequence's length (dynamic NTK, longrope):
    a forward's rotation then follows its last position."""
    return config.rope_scaling is not None and config.rope_scaling.kind in LENGTH_DEPENDENT


def past_original_context(config: GPTConfig, length: int) -> bool:
    """Whether a sequence of `length` tokens takes other frequencies than the pretraining context's (a
    `length_dependent` scaling past its `original_context`)."""
    return length_dependent(config) and length > config.rope_scaling.original_context


def inv_frequencies(config: GPTConfig, seq_len: int) -> tuple[torch.Tensor, float]:
    """(inv_freq (rotary_dim / 2,), attention factor) for a forward whose last position is seq_len - 1. Kept for
    the next forward of the same shape: a decoding step made them again every token (5-10 small ops). The tensor
    is shared: callers must not change it in place."""
    if torch.compiler.is_compiling():
        return _inv_frequencies(config, seq_len)
    key = (config.rotary_dim, config.rope_base, repr(config.rope_scaling), config.block_size, seq_len)
    found = _KEPT.get(key)
    if found is None:
        if len(_KEPT) >= 64:  # (length-dependent scalings make one per length)
            _KEPT.clear()
        with torch.inference_mode(False):  # usable in training too, whoever made it first
            found = _KEPT[key] = _inv_frequencies(config, seq_len)
    return found


_KEPT: dict[tuple, tuple[torch.Tensor, float]] = {}


def _inv_frequencies(config: GPTConfig, seq_len: int) -> tuple[torch.Tensor, float]:
    dim, base = config.rotary_dim, config.rope_base
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # 2i / d
    inv_freq = 1.0 / (base ** exponents)  # theta_i = base^(-2i/d)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.kind
    if kind == "linear":  # positions / factor, i.e. every frequency / factor
        return inv_freq / scaling.factor, 1.0
    if kind == "dynamic":  # NTK-aware: a larger base once the sequence outgrows the pretraining context
        original = scaling.original_context
        length = max(seq_len, original)
        base = base * ((scaling.factor * length / original) - (scaling.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, scaling, dim, base), _yarn_attention_factor(scaling)
    # longrope: a rescale factor per frequency, the long set once past the pretraining context
    factors = scaling.long_factor if seq_len > scaling.original_context else scaling.short_factor
    return inv_freq / torch.tensor(factors, dtype=torch.float32), longrope_attention_factor(scaling, config)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Wavelengths longer than original / low_freq_factor are divided by factor, shorter than original /
    high_freq_factor kept, and those between blended linearly in original / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > s.original_context / s.low_freq_factor, inv_freq / s.factor, blended)
    return torch.where(wavelen < s.original_context / s.high_freq_factor, inv_freq, out)


def _yarn(inv_freq: torch.Tensor, s: RopeScaling, dim: int, base: float) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow times over the pretraining context are
    interpolated (divided by factor), those turning more than beta_fast times kept, a linear ramp between."""

    def dim_of(rotations: float) -> float:  # the dim index whose frequency turns `rotations` times in the context
        return dim * math.log(s.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's cos/sin factor for a context stretched `scale` times: 0.1 m ln(scale) + 1 (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def longrope_mscale(scale: float, original_context: int) -> float:
    """LongRoPE's cos/sin factor: sqrt(1 + ln(scale) / ln(original context)) (1 when not stretched)."""
    return 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original_context))


def _yarn_attention_factor(s: RopeScaling) -> float:
    return s.attention_factor if s.attention_factor is not None else yarn_mscale(s.factor)


def longrope_attention_factor(s: RopeScaling, config: GPTConfig) -> float:
    """Set, or the paper's rule on the context's stretch (block_size over the original context)."""
    if s.attention_factor is not None:
        return s.attention_factor
    return longrope_mscale(config.block_size / s.original_context, s.original_context)


def rope_tables(config: GPTConfig, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions `pos` (1 or B, T), shaped (1 or B, 1, T, rotary_dim / 2), in fp32.

    Computed per forward from the positions rather than cached in a buffer, so a bf16 model keeps fp32 angles and
    every row of a batch can sit at its own position.
    """
    # only dynamic and longrope scaling depend on the sequence's length: reading it stalls a GPU's queue
    if length_dependent(config) and pos.shape[0] > 1:
        return _rows_rope_tables(config, pos)
    seq_len = int(pos.max()) + 1 if length_dependent(config) else 0
    inv_freq, attention_factor = inv_frequencies(config, seq_len)
    if pos.is_cuda and not torch.compiler.is_compiling():
        # from pageable memory the copy would wait for the GPU's whole queue, on every forward
        inv_freq = inv_freq.pin_memory().to(pos.device, non_blocking=True)
    angles = pos.to(torch.float32)[..., None] * inv_freq.to(pos.device)  # (B, T, rot/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def _rows_rope_tables(config: GPTConfig, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables` of a length-dependent scaling for rows (B, T) of their own positions, each row's frequencies
    from its own last position: a batch's rows are separate sequences (the engine's requests), so a row's result
    must not depend on how long the others are."""
    ends = (pos.amax(dim=1) + 1).tolist()  # (read back, as one sequence's length is)
    found = {n: inv_frequencies(config, n) for n in set(ends)}  # one per distinct length, not per row
    inv_freq = torch.stack([found[n][0] for n in ends]).to(pos.device)  # (B, rot/2)
    factor = torch.tensor([found[n][1] for n in ends], device=pos.device)[:, None, None, None]
    angles = pos.to(torch.float32)[..., None] * inv_freq[:, None, :]  # (B, T, rot/2)
    return angles.cos()[:, None] * factor, angles.sin()[:, None] * factor


def rope_at(config: GPTConfig, pos: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables(config, pos)` for positions below `end`, looked up in a table of every position kept per
    config (a decode step made the angles, their cos and sin again every token: ~8 small ops). On a CPU, where
    the frequencies do not depend on the length; elsewhere it computes them as rope_tables does."""
    if pos.device.type != "cpu" or length_dependent(config):
        return rope_tables(config, pos)
    scaling = config.rope_scaling
    size = 1 << max(config.block_size, end - 1, 1).bit_length()  # room past the block size: a power of two
    key = (config.rotary_dim, config.rope_base, repr(scaling), config.block_size)
    found = _TABLES.get(key)
    if found is None or found[0].shape[0] < end:
        if len(_TABLES) >= 16:
            _TABLES.clear()
        with torch.inference_mode(False):
            cos, sin = rope_tables(config, torch.arange(size)[None])  # (1, 1, size, rot / 2)
        found = _TABLES[key] = (cos[0, 0], sin[0, 0])
    return found[0][pos][:, None], found[1][pos][:, None]  # (1 or B, 1, T, rot / 2)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head of x (B, n, T, hs); the rest pass through (partial rotary)."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleaved:  # pairs (0, 1), (2, 3), ...
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:  # pairs (i, i + half): x cos + rotate_half(x) sin over the whole width, the pairwise form's sums bit for
        # bit (a cos - b sin is a cos + (-b) sin exactly) in fewer, full-width ops
        a, b = rot[..., :half], rot[..., half:]
        rotated = rot * torch.cat((cos, cos), dim=-1) + torch.cat((-b, a), dim=-1) * torch.cat((sin, sin), dim=-1)
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)  # no copy without a rest
