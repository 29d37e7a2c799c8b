"""Named model presets, as data: each entry overrides `GPTConfig`'s defaults (which are GPT-2 small's).

Each preset says where its numbers come from. Hugging Face configs are quoted by repository; the field names there map
to ours as: n_embd/hidden_size -> n_embd, n_inner/intermediate_size -> mlp_hidden, n_positions/
max_position_embeddings -> block_size, rotary_pct -> rotary_fraction, rope_theta/rotary_emb_base -> rope_base.
"""

from __future__ import annotations

from typing import Any

_GPT2 = dict(norm="layernorm", bias=True, position="learned", mlp="gelu", gelu_approximate="tanh", block="pre",
             tie_embeddings=True, vocab_size=50257, block_size=1024, norm_eps=1e-5)

# GPT-NeoX / Pythia: parallel attention + MLP, partial rotary (25% of each head), untied head, biases everywhere.
_NEOX = dict(norm="layernorm", bias=True, position="rope", rotary_fraction=0.25, rope_base=10000.0, mlp="gelu",
             block="parallel", tie_embeddings=False, block_size=2048, norm_eps=1e-5)

# Llama family: RMSNorm, RoPE on the whole head, SwiGLU with an explicit hidden size, no biases.
_LLAMA = dict(norm="rmsnorm", bias=False, position="rope", mlp="swiglu", block="pre")

PRESETS: dict[str, dict[str, Any]] = {
    # --- GPT-2 (Radford et al. 2019; huggingface.co/openai-community/gpt2*/config.json) -------------------------
    "gpt2": dict(_GPT2, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(_GPT2, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(_GPT2, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(_GPT2, n_layer=48, n_head=25, n_embd=1600),
    # --- GPT-J 6B (huggingface.co/EleutherAI/gpt-j-6b/config.json): rotary_dim 64 of head 256, gelu_new.
    # Approximation: GPT-J has no q/k/v/out biases and one shared norm per parallel block; gptlab's `bias` and
    # parallel block put biases on every Linear and use two norms, so the count is ~0.1% above the original.
    "gpt-j-6b": dict(_NEOX, n_layer=28, n_head=16, n_embd=4096, mlp_hidden=16384, vocab_size=50400,
                     gelu_approximate="tanh"),
    # --- GPT-NeoX 20B (huggingface.co/EleutherAI/gpt-neox-20b/config.json): hidden_act gelu_fast (tanh approx.)
    "gpt-neox-20b": dict(_NEOX, n_layer=44, n_head=64, n_embd=6144, mlp_hidden=24576, vocab_size=50432,
                         gelu_approximate="tanh"),
    # --- Pythia (huggingface.co/EleutherAI/pythia-70m/config.json, pythia-160m): hidden_act gelu (exact)
    "pythia-70m": dict(_NEOX, n_layer=6, n_head=8, n_embd=512, mlp_hidden=2048, vocab_size=50304,
                       gelu_approximate="none"),
    "pythia-160m": dict(_NEOX, n_layer=12, n_head=12, n_embd=768, mlp_hidden=3072, vocab_size=50304,
                        gelu_approximate="none"),
    # --- Llama-style small models -------------------------------------------------------------------------------
    # huggingface.co/HuggingFaceTB/SmolLM2-135M/config.json
    "smollm2-135m": dict(_LLAMA, n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp_hidden=1536,
                         vocab_size=49152, block_size=8192, rope_base=100000.0, norm_eps=1e-5,
                         tie_embeddings=True),
    # huggingface.co/HuggingFaceTB/SmolLM2-360M/config.json
    "smollm2-360m": dict(_LLAMA, n_layer=32, n_head=15, n_kv_head=5, n_embd=960, mlp_hidden=2560,
                         vocab_size=49152, block_size=8192, rope_base=100000.0, norm_eps=1e-5,
                         tie_embeddings=True),
    # huggingface.co/TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T/config.json
    "tinyllama-1.1b": dict(_LLAMA, n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, mlp_hidden=5632,
                           vocab_size=32000, block_size=2048, rope_base=10000.0, norm_eps=1e-5,
                           tie_embeddings=False),
    # --- gptlab's own ---------------------------------------------------------------------------------------------
    # "pocket": a modern 6-layer model for a laptop: 6 query heads share 2 KV heads, squared-ReLU FFN of 4 * d
    # rounded to a multiple of 64, GPT-2 vocabulary.
    "pocket": dict(norm="rmsnorm", bias=False, position="rope", mlp="relu2", mlp_ratio=4.0, mlp_multiple=64,
                   block="pre", n_layer=6, n_head=6, n_kv_head=2, n_embd=384, block_size=256, vocab_size=50257,
                   tie_embeddings=True),
    # "pocket-swiglu": the same with SwiGLU, 8/3 * d rounded to a multiple of 256 (Llama's rule).
    "pocket-swiglu": dict(norm="rmsnorm", bias=False, position="rope", mlp="swiglu", mlp_ratio=8 / 3,
                          mlp_multiple=256, block="pre", n_layer=6, n_head=6, n_kv_head=2, n_embd=384,
                          block_size=256, vocab_size=50257, tie_embeddings=True),
    # --- character-level models for tiny Shakespeare (vocab_size is set from the data by `gptlab train`) -----
    # nanoGPT's config/train_shakespeare_char.py (its GPU recipe).
    "shakespeare-char": dict(_GPT2, n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, vocab_size=65,
                             bias=False),
    # The CPU speedrun shape (shared/notes/cpu-training-findings.md found width 96 on an AMX CPU; without AMX,
    # width 64 for 300 steps reaches the same loss in about 0.8x the time): 102,784 parameters at vocab 65.
    "speedrun-char": dict(norm="layernorm", bias=False, position="rope", qk_norm=True, mlp="gelu",
                          gelu_approximate="none", block="pre", n_layer=2, n_head=2, n_embd=64, block_size=64,
                          vocab_size=65, tie_embeddings=True),
    # One-minute and five-minute CPU budgets (same notes): narrow and shallow wins on 2 cores. Without AMX the
    # one-minute budget does best narrower still: 3 layers of width 96 (val 1.598) beat 4 of 128 (1.775).
    "char-1min": dict(norm="layernorm", bias=False, position="rope", qk_norm=True, mlp="gelu",
                      gelu_approximate="none", block="pre", n_layer=3, n_head=2, n_embd=96, block_size=128,
                      vocab_size=65, tie_embeddings=True),
    "char-5min": dict(norm="layernorm", bias=False, position="rope", qk_norm=True, mlp="gelu",
                      gelu_approximate="none", block="pre", n_layer=6, n_head=2, n_embd=128, block_size=128,
                      vocab_size=65, tie_embeddings=True),
    # A few-thousand-parameter model for tests and smoke runs.
    "tiny": dict(norm="rmsnorm", bias=False, position="rope", mlp="swiglu", mlp_hidden=64, block="pre", n_layer=2,
                 n_head=4, n_kv_head=2, n_embd=32, block_size=64, vocab_size=256, tie_embeddings=True),
}
