"""Counting a model from its config alone (built on the meta device: free): its parameters (`parameter_breakdown`
by component, `parameter_counts` for the memory check) and the FLOPs it runs per token (`flops_per_token`: the
numerator of MFU, with `hardware.peak_flops` as its denominator)."""

from __future__ import annotations

import torch
import torch.nn as nn

from gptlab.config import GPTConfig
from gptlab.model import GPT, parameter_component


def flops_per_token(config: GPTConfig, seq_len: int, *, training: bool = True) -> float:
    """Model FLOPs per token of `config`'s GPT over sequences of `seq_len` tokens: what MFU divides by.

    Only matmuls count, and only those that run. A matmul with a weight of P entries costs 2P FLOPs per token
    forward and 4P backward (the input's and the weight's gradients): 6P to train, 2P to infer. Counted are
    - every nn.Linear weight in the blocks (q/k/v with their real head_dim and n_kv_head, the output projection,
      a gated MLP's double-width c_fc), from the model's own shapes on the meta device;
    - the LM head, n_embd x vocab_size, whether tied or not: its matmul runs either way;
    - attention's scores (q k^T) and weighted values (a v): 2 * hs FLOPs each per head per key a query sees,
      forward; backward twice that. Causal attention counts the keys a query sees on average, T / 2 (half the
      T x T score matrix, as FlashAttention's benchmarks count causal FLOPs; PaLM's 12 * L * H * hs * T counts
      all T), so training costs 12 * hs * H * T / 2 = 6 * L * H * hs * T. A sliding-window layer counts the
      window's band, w - w^2 / (2T) keys per query with w = min(window, T).
    Not counted: embedding and position-table lookups (no arithmetic), norms, biases, activations, softmax.
    """
    with torch.device("meta"):
        model = GPT(config)
    matmul_params = sum(m.weight.numel() for m in model.transformer.h.modules() if isinstance(m, nn.Linear))
    head = config.n_embd * config.vocab_size
    keys = sum(keys_per_query(config, layer, seq_len) for layer in range(config.n_layer))
    attention = 4 * config.n_head * config.head_size * keys  # forward: 2 * hs for q k^T and 2 * hs for a v
    return (3 if training else 1) * (2 * (matmul_params + head) + attention)


def keys_per_query(config: GPTConfig, layer: int, seq_len: int) -> float:
    """Keys a query of `layer` sees on average under the causal (or sliding-window) mask over `seq_len`
    positions: w - w^2 / (2T) with w = min(window, T)."""
    w = min(config.sliding_window, seq_len) if config.sliding_layer(layer) else seq_len
    return w - w * w / (2 * seq_len)


def parameter_counts(config: GPTConfig) -> tuple[int, int, int]:
    """(all parameters, the largest block's, those outside the blocks), tied ones once (the meta device: free)."""
    with torch.device("meta"):
        model = GPT(config)
    total = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in model.iter_blocks())
    return total, block, total - sum(p.numel() for b in model.iter_blocks() for p in b.parameters())


def parameter_breakdown(config: GPTConfig) -> dict[str, int]:
    """Parameter counts by component, computed on the meta device: no memory is allocated, so any preset works.

    Components: embeddings (token + position), attention, mlp, norms, head (0 when tied: counted once, with the
    embeddings), and total.
    """
    with torch.device("meta"):
        model = GPT(config)
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, p in model.named_parameters():
        counts[parameter_component(name)] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


COMPONENTS = ("embeddings", "attention", "mlp", "norms", "head")
