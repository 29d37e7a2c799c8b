"""Counting a model from its config alone (built on the meta device: free): its parameters (`parameter_breakdown`
by component, `parameter_counts` for the memory check) and the FLOPs it runs per token (`flops_per_token`: the
numerator of MFU, with `hardware.peak_flops` as its denominator), of full training or of a frozen model under
LoRA adapters (`TrainedWeights`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gptlab.config import GPTConfig
from gptlab.model import GPT, parameter_component


@dataclass(frozen=True)
class TrainedWeights:
    """Which matmul weights a run trains: every one (the default, full training), or under LoRA / QLoRA none of
    the blocks' Linears (`blocks` False) nor the head (`head` False), and `adapters` adapter entries beside them
    (A r x in and B out x r per adapted slice, over all layers: each a matmul weight of its own)."""

    blocks: bool = True  # the blocks' Linear weights
    head: bool = True  # the LM head's weight (tied: the embedding table)
    adapters: int = 0  # LoRA's A and B entries, all layers together


FULL_TRAINING = TrainedWeights()


def flops_per_token(config: GPTConfig, seq_len: int, *, training: bool = True,
                    trained: TrainedWeights = FULL_TRAINING) -> float:
    """Model FLOPs per token of `config`'s GPT over sequences of `seq_len` tokens, training the weights `trained`
    says (all of them by default) or inferring: what MFU divides by.

    Only matmuls count, and only those that run. A matmul with a weight of P entries costs 2P FLOPs per token
    forward and 4P backward (the input's and the weight's gradients): 6P to train, 2P to infer. A frozen weight's
    gradient is never computed, so under LoRA / QLoRA the base's Linears and the frozen head cost 4P (forward and
    the input's gradient, which the adapters below need), and the adapters 6 * r * (in + out) per adapted slice
    (their A and B, `TrainedWeights.adapters`); counting 6P for every weight there overstated MFU up to ~1.5x.
    A QLoRA base counts as its dequantized weight: dequantizing is no matmul. Counted are
    - every nn.Linear weight in the blocks (q/k/v with their real head_dim and n_kv_head, the output projection,
      a gated MLP's double-width c_fc), from the model's own shapes on the meta device;
    - the LM head, n_embd x vocab_size, whether tied or not: its matmul runs either way;
    - the adapters' A and B, when any;
    - attention's scores (q k^T) and weighted values (a v): 2 * hs FLOPs each per head per key a query sees,
      forward; backward twice that. Causal attention counts the keys a query sees on average, T / 2 (half the
      T x T score matrix, as FlashAttention's benchmarks count causal FLOPs; PaLM's 12 * L * H * hs * T counts
      all T), so training costs 12 * hs * H * T / 2 = 6 * L * H * hs * T. A sliding-window layer counts the
      window's band, w - w^2 / (2T) keys per query with w = min(window, T).
    Not counted: embedding and position-table lookups (no arithmetic), norms, biases, activations, softmax. Under
    LoRA the products below the first adapter that autograd skips (that layer's input gradient, and with a
    deep first target the layers beneath it) are counted all the same: at most about one layer's backward.
    """
    with torch.device("meta"):
        model = GPT(config)
    blocks = sum(m.weight.numel() for m in model.transformer.h.modules() if isinstance(m, nn.Linear))
    head = config.n_embd * config.vocab_size
    keys = sum(keys_per_query(config, layer, seq_len) for layer in range(config.n_layer))
    attention = 4 * config.n_head * config.head_size * keys  # forward: 2 * hs for q k^T and 2 * hs for a v
    matmuls = blocks + head + trained.adapters
    forward = 2 * matmuls + attention
    if not training:
        return forward
    # backward: every input's gradient (attention's: twice its forward), and the gradients of the weights that train
    weights = (blocks if trained.blocks else 0) + (head if trained.head else 0) + trained.adapters
    return forward + 2 * matmuls + 2 * attention + 2 * weights


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
