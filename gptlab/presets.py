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
    # --- GPT-J 6B (huggingface.co/EleutherAI/gpt-j-6b/config.json): one LayerNorm shared by the parallel attention
    # and MLP, interleaved RoPE on 64 of each head's 256 dims, no attention biases, an LM head with a bias, gelu_new.
    "gpt-j-6b": dict(_NEOX, n_layer=28, n_head=16, n_embd=4096, mlp_hidden=16384, vocab_size=50400,
                     gelu_approximate="tanh", shared_norm=True, rope_interleaved=True, qkv_bias=False,
                     attn_proj_bias=False, head_bias=True, hf_architecture="GPTJForCausalLM"),
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
    # --- Qwen, Mistral, Gemma 2, Phi-3 ----------------------------------------------------------------------------
    # huggingface.co/Qwen/Qwen2.5-0.5B/config.json: biases on q, k, v only
    "qwen2.5-0.5b": dict(_LLAMA, n_layer=24, n_head=14, n_kv_head=2, n_embd=896, mlp_hidden=4864, vocab_size=151936,
                         block_size=32768, rope_base=1000000.0, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
                         hf_architecture="Qwen2ForCausalLM"),
    # huggingface.co/Qwen/Qwen3-0.6B/config.json: learned q/k norms, heads of 128 (not 1024 / 16)
    "qwen3-0.6b": dict(_LLAMA, n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, head_dim=128, mlp_hidden=3072,
                       vocab_size=151936, block_size=40960, rope_base=1000000.0, norm_eps=1e-6, qk_norm=True,
                       qk_norm_weight=True, tie_embeddings=True, hf_architecture="Qwen3ForCausalLM"),
    # huggingface.co/mistralai/Mistral-7B-v0.1/config.json: a 4096-token sliding window
    "mistral-7b": dict(_LLAMA, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=32000,
                       block_size=32768, rope_base=10000.0, norm_eps=1e-5, sliding_window=4096,
                       tie_embeddings=False, hf_architecture="MistralForCausalLM"),
    # huggingface.co/google/gemma-2-2b/config.json: sqrt(d)-scaled embeddings, (1 + w) RMSNorms around both
    # sublayers, GeGLU, heads of 256, scores scaled by 256^-1/2 and capped at 50, logits capped at 30, a 4096-token
    # window on even layers
    "gemma-2-2b": dict(norm="rmsnorm", norm_unit_offset=True, scale_embeddings=True, bias=False, position="rope",
                       mlp="geglu", gelu_approximate="tanh", block="sandwich", n_layer=26, n_head=8, n_kv_head=4,
                       n_embd=2304, head_dim=256, mlp_hidden=9216, vocab_size=256000, block_size=8192,
                       rope_base=10000.0, norm_eps=1e-6, attn_scale=256 ** -0.5, attn_softcap=50.0,
                       logit_softcap=30.0, sliding_window=4096, global_layer_every=2, tie_embeddings=True,
                       hf_architecture="Gemma2ForCausalLM"),
    # huggingface.co/microsoft/Phi-3-mini-4k-instruct/config.json: fused qkv and gate_up, a 2047-token window
    "phi-3-mini": dict(_LLAMA, n_layer=32, n_head=32, n_embd=3072, mlp_hidden=8192, vocab_size=32064,
                       block_size=4096, rope_base=10000.0, norm_eps=1e-5, sliding_window=2047, tie_embeddings=False,
                       hf_architecture="Phi3ForCausalLM"),
    # --- gptlab's own ---------------------------------------------------------------------------------------------
    # "pocket": the pocket transformer exactly: 6 pre-norm layers, 6 query heads share 2 KV heads, width 384,
    # rotate-half RoPE, squared-ReLU FFN of 4 * d = 1536, no biases, RMSNorm without a learned weight (also on the
    # token embeddings before the first block), untied head, GPT-2 vocabulary: 48,034,560 parameters.
    "pocket": dict(norm="rmsnorm", norm_weight=False, embedding_norm=True, bias=False, position="rope",
                   mlp="relu2", mlp_hidden=1536, block="pre", n_layer=6, n_head=6, n_kv_head=2, n_embd=384,
                   block_size=256, vocab_size=50257, tie_embeddings=False),
    # "pocket-tied": the same with the head tied to the token embeddings: 50257 * 384 = 19,298,688 fewer
    # parameters (28,735,872).
    "pocket-tied": dict(norm="rmsnorm", norm_weight=False, embedding_norm=True, bias=False, position="rope",
                        mlp="relu2", mlp_hidden=1536, block="pre", n_layer=6, n_head=6, n_kv_head=2, n_embd=384,
                        block_size=256, vocab_size=50257, tie_embeddings=True),
    # "pocket-swiglu": the pocket shape with SwiGLU, 8/3 * d rounded to a multiple of 256 (Llama's rule), and
    # gptlab's earlier choices: weighted RMSNorm, no embedding norm, tied head.
    "pocket-swiglu": dict(norm="rmsnorm", bias=False, position="rope", mlp="swiglu", mlp_ratio=8 / 3,
                          mlp_multiple=256, block="pre", n_layer=6, n_head=6, n_kv_head=2, n_embd=384,
                          block_size=256, vocab_size=50257, tie_embeddings=True),
    # --- character-level models for tiny Shakespeare (vocab_size is set from the data by `gptlab train`) -----
    # nanoGPT's config/train_shakespeare_char.py (its GPU recipe).
    "shakespeare-char": dict(_GPT2, n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, vocab_size=65,
                             bias=False),
    # The CPU speedrun shape (a search on an AMX CPU found width 96 best; without AMX,
    # width 64 for 300 steps reaches the same loss in about 0.8x the time): 102,976 parameters at vocab 65.
    # Logits soft-capped at 15: about -0.02 whole-split val at 225-250 steps (4 seeds), so ~13% fewer steps.
    # Token shift (embeddings and MLP inputs): the same loss on about half the tokens (32 x 120 rows against 48 x
    # 180); of the embeddings alone, about -0.05 at 48 x 180 (1.820 against 1.869, 2 seeds).
    "speedrun-char": dict(norm="layernorm", bias=False, position="rope", qk_norm=True, mlp="gelu",
                          gelu_approximate="none", block="pre", n_layer=2, n_head=2, n_embd=64, block_size=64,
                          vocab_size=65, tie_embeddings=True, logit_softcap=15.0, token_shift=True),
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
