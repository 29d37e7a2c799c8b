"""GGUF export: a gptlab model and its tokenizer as one file llama.cpp runs (`gptlab convert SRC OUT.gguf --to gguf`).

GGUF holds key/value metadata (architecture sizes, the tokenizer's tokens and merges) and named tensors, written
with the `gguf` package (an optional dependency: the `gguf` extra). Two llama.cpp architectures are written:

* `gpt2` (gptlab's GPT-2 family): fused qkv as gptlab has it, learned positions, LayerNorms with biases;
* `llama` (gptlab's Llama family): separate q, k, v, and q / k rows permuted per head, because llama.cpp's
  `llama` RoPE rotates adjacent pairs (2i, 2i + 1) where Hugging Face's and gptlab's layout rotates (i, i + d/2).

Weights are written in f32, f16, bf16, q8_0 (blocks of 32 int8 values with one f16 scale) or q4_0 (blocks of 32
4-bit values with one f16 scale, the format llama.cpp's q4_0 benchmarks use); 1-D tensors (norms,
biases) stay f32, as llama.cpp's own converter writes them. The tokenizer goes in as byte-level BPE: GPT-2's
(merges recovered from tiktoken's ranks), a Hugging Face BPE tokenizer's vocabulary and merges, or a character
tokenizer whose characters are single bytes (no merges needed).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gptlab.checkpoint import model_state_dict, unwrap_model
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_file
from gptlab.interop.hf import export_family

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GptlabError("GGUF export needs the gguf package: pip install 'gptlab[gguf]' (or pip install gguf)") \
            from None
    return gguf


def save_gguf(model: torch.nn.Module, path: str | Path, tokenizer: TextTokenizer, dtype: str = "f16") -> Path:
    """Write `model` and `tokenizer` as a GGUF file llama.cpp loads; GptlabError for what GGUF cannot hold."""
    gguf = _gguf()
    if dtype not in GGUF_DTYPES:
        raise GptlabError(f"unknown GGUF dtype {dtype!r}: choose {', '.join(GGUF_DTYPES)}")
    plain = unwrap_model(model)
    cfg: GPTConfig = plain.config
    arch = _architecture(cfg)
    if tokenizer is None:
        raise GptlabError("GGUF export needs the model's tokenizer (llama.cpp keeps it in the file), and SRC has none")
    tokens, merges, types = gguf_vocabulary(tokenizer, cfg.vocab_size)
    state = {name: t.detach().float().cpu().numpy() for name, t in model_state_dict(plain).items()}
    tensors = _tensors(cfg, arch, state)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        _write_metadata(gguf, writer, cfg, arch, dtype, cfg.name)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")  # GPT-2's split regex: the one pre-tokenizer gptlab writes (see below)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        if tokenizer.eot_id is not None:
            writer.add_eos_token_id(tokenizer.eot_id)
            writer.add_bos_token_id(tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eot_id)
        writer.add_add_bos_token(bool(tokenizer.adds_bos))
        for name, array in tensors.items():
            data, qtype = _encode(gguf, array, dtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return atomic_write_file(path, write)


def _architecture(cfg: GPTConfig) -> str:
    """llama.cpp's name for the config's family, or a one-line error naming what stands in the way."""
    family = export_family(cfg)  # refuses switches no Hugging Face family has, by name
    arch = ARCHITECTURES.get(family.ARCHITECTURE)
    if arch is None:
        raise GptlabError(f"GGUF export writes the GPT-2 and Llama families; this model is {family.NAME}")
    if cfg.rope_scaling is not None or cfg.head_dim is not None:
        what = "rope_scaling" if cfg.rope_scaling is not None else "head_dim"
        raise GptlabError(f"GGUF export does not write {what} yet: export to Hugging Face (--to hf) instead")
    return arch


def _write_metadata(gguf: Any, w: Any, cfg: GPTConfig, arch: str, dtype: str, name: str) -> None:
    w.add_name(name)
    w.add_context_length(cfg.block_size)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.hidden_size)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "gpt2":
        w.add_layer_norm_eps(cfg.norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_freq_base(cfg.rope_base)
        w.add_rope_dimension_count(cfg.rotary_dim)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                  "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    w.add_file_type(file_types[dtype])


def _tensors(cfg: GPTConfig, arch: str, s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gptlab's tensors under llama.cpp's names, in (out, in) row-major layout (GGUF lists dims reversed)."""
    out = {"token_embd.weight": s["transformer.wte.weight"]}
    q, kv, hs = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size, cfg.head_size
    for i in range(cfg.n_layer):
        p, b = f"transformer.h.{i}.", f"blk.{i}."
        if arch == "gpt2":
            for kind in ("weight", "bias"):
                out.update({b + f"attn_norm.{kind}": s[p + f"ln_1.{kind}"],
                            b + f"attn_qkv.{kind}": s[p + f"attn.c_attn.{kind}"],
                            b + f"attn_output.{kind}": s[p + f"attn.c_proj.{kind}"],
                            b + f"ffn_norm.{kind}": s[p + f"ln_2.{kind}"],
                            b + f"ffn_up.{kind}": s[p + f"mlp.c_fc.{kind}"],
                            b + f"ffn_down.{kind}": s[p + f"mlp.c_proj.{kind}"]})
        else:
            w = s[p + "attn.c_attn.weight"]
            gate, up = np.split(s[p + "mlp.c_fc.weight"], 2, axis=0)
            out.update({b + "attn_norm.weight": s[p + "ln_1.weight"],
                        b + "attn_q.weight": interleave_rope_rows(w[:q], cfg.n_head, hs),
                        b + "attn_k.weight": interleave_rope_rows(w[q:q + kv], cfg.n_kv_head, hs),
                        b + "attn_v.weight": w[q + kv:],
                        b + "attn_output.weight": s[p + "attn.c_proj.weight"],
                        b + "ffn_norm.weight": s[p + "ln_2.weight"],
                        b + "ffn_gate.weight": gate, b + "ffn_up.weight": up,
                        b + "ffn_down.weight": s[p + "mlp.c_proj.weight"]})
    out["output_norm.weight"] = s["transformer.ln_f.weight"]
    if arch == "gpt2":
        out["position_embd.weight"] = s["transformer.wpe.weight"]
        out["output_norm.bias"] = s["transformer.ln_f.bias"]
    # written even when tied (the state dict then holds only the embedding): llama.cpp looks for it first
    out["output.weight"] = s.get("lm_head.weight", s["transformer.wte.weight"])
    return {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in out.items()}


def interleave_rope_rows(w: np.ndarray, n_head: int, head_size: int) -> np.ndarray:
    """Per head, rows [0..d/2) and [d/2..d) (rotate-half pairs i, i + d/2) -> rows 0, d/2, 1, d/2 + 1, ...
    (llama.cpp's adjacent pairs), so its RoPE computes what gptlab's does."""
    return w.reshape(n_head, 2, head_size // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _encode(gguf: Any, array: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """The array in the file's dtype; 1-D tensors (norms, biases) stay f32, rows q8_0/q4_0 cannot block go f16."""
    types = gguf.GGMLQuantizationType
    if array.ndim == 1 or dtype == "f32":
        return array, types.F32
    if dtype == "f16":
        return array.astype(np.float16), types.F16
    if dtype in ("q8_0", "q4_0") and array.shape[-1] % 32 != 0:
        return array.astype(np.float16), types.F16  # both block 32 values of a row
    qtype = {"bf16": types.BF16, "q8_0": types.Q8_0, "q4_0": types.Q4_0}[dtype]
    return gguf.quants.quantize(array, qtype), qtype


# ------------------------------------------------------------------------------------------------------------
# The tokenizer as byte-level BPE
# ------------------------------------------------------------------------------------------------------------
@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies spell their tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _spell(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def gguf_vocabulary(tokenizer: TextTokenizer, vocab_size: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a tokenizer as byte-level BPE, padded to the model's vocab_size."""
    kind = getattr(tokenizer, "kind", None)
    if kind == "gpt2":
        tokens, merges, special = _tiktoken_vocabulary(tokenizer)
    elif kind in ("hf", "bpe"):  # a Hugging Face tokenizer.json (loaded, or trained by `gptlab prepare`)
        tokens, merges, special = _hf_vocabulary(tokenizer)
    elif kind == "char":
        tokens, merges, special = _char_vocabulary(tokenizer)
    else:
        raise GptlabError(f"GGUF export cannot write a {kind!r} tokenizer")
    if len(tokens) > vocab_size:
        raise GptlabError(f"the tokenizer has {len(tokens)} tokens but the model only {vocab_size} embeddings")
    normal, control, unused = 1, 3, 5  # llama.cpp's token types
    types = [control if i in special else normal for i in range(len(tokens))]
    for i in range(len(tokens), vocab_size):  # rows the model has beyond the tokenizer (padded vocabularies)
        tokens.append(f"[PAD{i}]")
        types.append(unused)
    return tokens, merges, types


def _tiktoken_vocabulary(tokenizer: TextTokenizer) -> tuple[list[str], list[str], set[int]]:
    """GPT-2's tokens from tiktoken's ranks; each merge is recovered by running BPE on the token's bytes with
    only the ranks below its own, which leaves exactly the two parts it was merged from."""
    encoding = tokenizer._enc  # tiktoken.Encoding
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    tokens = [""] * encoding.n_vocab
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        tokens[rank] = _spell(token)
        if len(token) > 1:
            left, right = _split_by_rank(ranks, token, rank)
            merges.append(f"{_spell(left)} {_spell(right)}")
    for text, i in encoding._special_tokens.items():
        tokens[i] = text
    return tokens, merges, set(encoding._special_tokens.values())


def _split_by_rank(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], rank))
        if ranks.get(parts[best] + parts[best + 1], rank) >= rank:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise GptlabError(f"cannot recover the BPE merge of token {token!r} from tiktoken's ranks")
    return parts[0], parts[1]


def _hf_vocabulary(tokenizer: TextTokenizer) -> tuple[list[str], list[str], set[int]]:
    """A tokenizer.json's BPE. llama.cpp splits text by a pre-tokenizer it knows by name; the file says "gpt-2",
    which is exact for a ByteLevel pre-tokenizer with GPT-2's regex. Other splits (Llama 3's, Qwen's regexes) would
    tokenize differently there, so they are refused rather than written under a wrong name."""
    data = json.loads(tokenizer._json)
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise GptlabError(f"GGUF export writes BPE tokenizers; this one is {model.get('type')!r}")
    pre = data.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise GptlabError(f"GGUF export writes tokenizers that split text as GPT-2 does (a ByteLevel pre-tokenizer); "
                          f"this one's is {pre.get('type')!r}: export --to hf instead")
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, merges, special


# llama.cpp refuses a BPE vocabulary without merges, and `gguf` writes no empty array: a character vocabulary gets
# this one merge, which never fires (its parts are two-symbol strings, and no other merge ever forms one)
NEVER_MERGES = "ĠĠ ĠĠ"


def _char_vocabulary(tokenizer: TextTokenizer) -> tuple[list[str], list[str], set[int]]:
    """Single-byte characters spelled as byte-level BPE tokens: each character its own token, nothing merged."""
    chars = tokenizer.chars
    wide = [c for c in chars if len(c.encode("utf-8")) != 1]
    if wide:
        raise GptlabError(f"GGUF export of a character tokenizer needs single-byte characters; {wide[0]!r} is not")
    return [_spell(c.encode("utf-8")) for c in chars], [NEVER_MERGES], set()
