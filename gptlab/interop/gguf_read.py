"""GGUF import: a GGUF file (gptlab's own export, llama.cpp's converter's, an ollama blob) as a gptlab model and its
tokenizer, for the architectures gptlab exports (`gguf_arch.ARCHES`).

One mechanism for every family: the file's metadata becomes the Hugging Face config its family reads
(`config_from_hf`, the import every family already has), and its tensors go back under gptlab's names through the
inverse of export's table (`gguf_arch.gptlab_tensors`). Weights are dequantized from any type `gguf`'s own
dequantizer knows (f32, f16, bf16, q8_0, q4_0, the k-quants) to float32, then to the dtype asked for. The
tokenizer (byte-level BPE, `tokenizer.ggml.model` "gpt2") and the chat template come from the file too.

The file is read through `gguf`'s reader with its reads bounded by the file's size: a file cut anywhere, a count or
length larger than the file could hold, a tensor past the end, an unknown type or a missing key is one
`GptlabError` naming the file and what is wrong, before anything large is allocated.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.checkpoint import assign_weights, plain_shapes
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop.gguf_arch import ARCHES, DEFAULT_SOFTCAPS, GgufArch, gptlab_tensors, score_scalar
from gptlab.interop.gguf_vocab import tokenizer_from_gguf
from gptlab.interop.registry import BY_ARCHITECTURE
from gptlab.model import GPT
from gptlab.tokenizer.huggingface import HFTokenizer

GGUF_MAGIC = b"GGUF"
_MIN_ENTRY_BYTES = 13  # the smallest key/value or tensor entry: an 8-byte length, a 1-byte name, a 4-byte type
# llama.cpp's architecture -> the family gptlab reads it as (the first that exports to it: llama is Llama)
_FAMILY = {}
for _architecture, _arch in ARCHES.items():
    _FAMILY.setdefault(_arch.name, _architecture)


def is_gguf_file(path: Path) -> bool:
    """A file named .gguf, or any file that starts with GGUF's magic bytes (ollama's blobs have no suffix)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GptlabError("reading GGUF needs the gguf package: pip install 'gptlab[gguf]' (or pip install gguf)") \
            from None
    return gguf


@functools.cache
def _checked_reader() -> type:
    """gguf's reader with every read bounded by the file: its own would loop over a count of 2**64 items or
    return short arrays past the end."""
    gguf = _gguf()

    class CheckedReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if int(count) < 0 or end > len(self.data):
                raise ValueError(f"it ends at byte {len(self.data)}, inside an entry that runs to byte {end} "
                                 "(truncated, or a size or offset is wrong)")
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, offset: int, raw_type: int) -> Any:
            if raw_type == gguf.GGUFValueType.ARRAY:
                length = int(self._get(offset + 4, np.uint64)[0])
                if length > len(self.data) - offset:
                    raise ValueError(f"an array at byte {offset} claims {length} items, more than the file holds")
            return super()._get_field_parts(offset, raw_type)

        def _build_fields(self, offset: int, count: int) -> int:
            _fits(self, offset, count, "metadata keys")
            return super()._build_fields(offset, count)

        def _build_tensor_info(self, offset: int, count: int) -> Any:
            _fits(self, offset, count, "tensors")
            return super()._build_tensor_info(offset, count)

    return CheckedReader


def _fits(reader: Any, offset: int, count: int, what: str) -> None:
    if int(count) * _MIN_ENTRY_BYTES > len(reader.data) - offset:
        raise ValueError(f"it claims {int(count)} {what}, more than its {len(reader.data)} bytes could hold")


def open_gguf(path: Path) -> Any:
    """gguf's reader over `path`; a one-line GptlabError for a file that is not whole, well-formed GGUF."""
    if path.is_symlink() and not path.exists():
        raise GptlabError(f"{path} is a symbolic link that leads nowhere (a loop, or its target is gone)")
    if path.is_dir():
        raise GptlabError(f"{path} is a directory, not a GGUF file")
    try:
        with open(path, "rb") as f:
            head, version = f.read(4), f.read(4)
    except OSError as e:
        raise GptlabError(f"cannot read {path}: {e.strerror or e}") from None
    if not head:
        raise GptlabError(f"{path} is empty, not a GGUF file")
    if head != GGUF_MAGIC:
        raise GptlabError(f"{path} is not a GGUF file: it starts with {head!r}, not GGUF's magic {GGUF_MAGIC!r}")
    if len(version) == 4 and int.from_bytes(version, "little") not in (2, 3):
        raise GptlabError(f"{path} is GGUF version {int.from_bytes(version, 'little')}; gptlab reads versions 2 and 3")
    try:
        return _checked_reader()(path)
    except OSError as e:
        raise GptlabError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, MemoryError) as e:
        raise GptlabError(f"{path} is a damaged GGUF file: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


class _Metadata:
    """Typed reads of a GGUF file's metadata; a missing key or a value of the wrong type names the key."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path, self.fields = path, reader.fields

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise GptlabError(f"{self.path}: the GGUF metadata key {key} is missing")
            return default
        try:
            value = field.contents()
        except (ValueError, IndexError, TypeError) as e:
            raise GptlabError(f"{self.path}: the GGUF metadata key {key} cannot be read ({_one_line(e)})") from None
        numeric = kind in (int, float) or kind == (int, float)
        if not isinstance(value, kind) or numeric and isinstance(value, bool):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise GptlabError(f"{self.path}: the GGUF metadata key {key} should be {names}, "
                              f"got {type(value).__name__}")
        return value


class _Tensors:
    """The file's tensors, dequantized to float32 on first use in (out, in) row-major layout."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path, self.by_name = path, {t.name: t for t in reader.tensors}
        self.taken: set[str] = set()  # the names `take` was asked for: what the model reads
        for t in reader.tensors:  # GGUF aligns every tensor's data: an offset off the grid is a damaged entry
            if (t.data_offset - reader.data_offset) % reader.alignment:
                raise GptlabError(f"{path}: tensor {t.name}'s data offset is not a multiple of the file's "
                                  f"alignment ({reader.alignment})")

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape, (out, in) as gptlab holds it, read from the file's index (nothing dequantized)."""
        t = self.by_name.get(name)
        return None if t is None else tuple(reversed([int(d) for d in t.shape]))

    def take(self, name: str, rows: int | None = None) -> np.ndarray | None:
        self.taken.add(name)
        t = self.by_name.get(name)
        if t is None:
            return None
        gguf = _gguf()
        shape = tuple(reversed([int(d) for d in t.shape]))
        if rows is not None and (not shape or shape[0] != rows):
            raise GptlabError(f"{self.path}: tensor {name} has shape {shape}, the metadata implies {rows} rows")
        if t.tensor_type.name.startswith("I"):
            raise GptlabError(f"{self.path}: tensor {name} holds integers ({t.tensor_type.name}), not weights")
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            return np.array(values, dtype=np.float32).reshape(shape)  # a copy: the file is mapped read-only
        except NotImplementedError:
            raise GptlabError(f"{self.path}: tensor {name} is {t.tensor_type.name}, which gguf's reader cannot "
                              "dequantize") from None
        except (ValueError, TypeError) as e:
            raise GptlabError(f"{self.path}: tensor {name} ({t.tensor_type.name}, shape {shape}) cannot be read: "
                              f"{_one_line(e)}") from None

    def same(self, a: str, b: str) -> bool:
        x, y = self.by_name[a], self.by_name[b]
        return x.tensor_type == y.tensor_type and x.data.shape == y.data.shape and np.array_equal(x.data, y.data)


def gguf_config(path: Path, meta: _Metadata, tensors: _Tensors) -> tuple[GPTConfig, GgufArch]:
    """The GPTConfig a GGUF file's metadata describes, read by its family's own Hugging Face import."""
    name = meta.get("general.architecture", str)
    if name not in _FAMILY:
        raise GptlabError(f"{path}: general.architecture {name!r} is not one gptlab reads: it reads "
                          f"{', '.join(sorted(_FAMILY))}")
    family, arch = BY_ARCHITECTURE[_FAMILY[name]], ARCHES[_FAMILY[name]]
    _refuse_rope_scaling(meta, name)
    _refuse_window_pattern(meta, name, arch)
    hf = _hf_config(name, arch, meta, tensors)
    hf["architectures"], hf["model_type"] = [family.ARCHITECTURE], family.MODEL_TYPE
    try:
        fields = family.config_from_hf(hf)
        config = GPTConfig(**fields, name=path.stem, hf_architecture=family.ARCHITECTURE)
    except (GptlabError, ValueError, TypeError) as e:
        raise GptlabError(f"{path}: its metadata does not describe a valid {name} model: "
                          f"{_one_line(e).replace('config.json', 'the metadata')}") from None
    return config, arch


def _refuse_rope_scaling(meta: _Metadata, arch: str) -> None:
    """llama.cpp's converter writes a scaled RoPE as `{arch}.rope.scaling.*` keys, which the config does not read:
    refused by name rather than run as plain RoPE (llama.cpp applies the factor whatever the type)."""
    kind = meta.get(f"{arch}.rope.scaling.type", str, "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", (int, float), 1.0)
    if kind not in ("none", "linear") or factor not in (0, 1):
        raise GptlabError(f"{meta.path}: its RoPE is scaled ({arch}.rope.scaling.type={kind}, factor {factor}), "
                          "which gptlab's GGUF import does not read yet: load the model's Hugging Face directory")


def _refuse_window_pattern(meta: _Metadata, name: str, arch: GgufArch) -> None:
    """llama.cpp reads gemma2's `attention.sliding_window_pattern` (one global layer every N, 2 where absent); gptlab
    reads Gemma 2's alternation only, so another pattern is refused rather than run as a different model."""
    key = f"{name}.attention.sliding_window_pattern"
    if arch.sliding == "alternate" and key in meta.fields and (pattern := meta.get(key, int)) != 2:
        raise GptlabError(f"{meta.path}: {key}={pattern}: gptlab reads {name}'s alternate sliding layers only "
                          "(a pattern of 2)")


def _refuse_unread(path: Path, tensors: _Tensors, tied: bool) -> None:
    """A tensor the model has no place for would be dropped (llama.cpp's rope_freqs and rope_factors_* scale RoPE:
    Llama 3.1's and Phi-3 128k's files): refused by name, as Hugging Face import refuses one. A tied head's
    output.weight is the embedding (checked equal when the config was read)."""
    unread = [name for name in tensors.by_name if name not in tensors.taken and not (tied and name == "output.weight")]
    if unread:
        why = " (it scales RoPE, which gptlab's GGUF import does not read yet)" if unread[0].startswith("rope_") else ""
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        raise GptlabError(f"{path}: tensor {unread[0]}{more} has no place in the model gptlab reads{why}")


def _hf_config(arch: str, reads: GgufArch, meta: _Metadata, tensors: _Tensors) -> dict[str, Any]:
    """The file's `{arch}.*` keys under every name the families' config readers look for; a key the file leaves
    out takes the value llama.cpp's loader gives it (Gemma 2's caps and window), so both run the same model."""
    def key(suffix: str, kind: type | tuple[type, ...] = int, default: Any = ...) -> Any:
        return meta.get(f"{arch}.{suffix}", kind, default)

    number = (int, float)
    n_embd, n_head = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", default=n_embd // n_head if n_head > 0 else n_embd)
    eps = key("attention.layer_norm_epsilon", number, None) or key("attention.layer_norm_rms_epsilon", number, None)
    rotary = key("rope.dimension_count", default=head_dim)
    window = key("attention.sliding_window", default=reads.default_window)
    caps = DEFAULT_SOFTCAPS if reads.softcaps else (None, None)
    ff, ctx, n_layer = key("feed_forward_length"), key("context_length"), key("block_count")
    embedding = tensors.shape("token_embd.weight")
    if embedding is None or len(embedding) != 2 or embedding[1] != n_embd:
        raise GptlabError(f"{meta.path}: tensor token_embd.weight is missing or not (vocab, {n_embd})")
    rotary_fraction = rotary / head_dim if head_dim else 1.0
    tied = "output.weight" not in tensors or tensors.same("output.weight", "token_embd.weight")
    return {
        "vocab_size": embedding[0], "hidden_size": n_embd, "n_embd": n_embd, "num_hidden_layers": n_layer,
        "n_layer": n_layer, "num_attention_heads": n_head, "n_head": n_head,
        "num_key_value_heads": key("attention.head_count_kv", default=n_head), "head_dim": head_dim,
        "intermediate_size": ff, "n_inner": ff, "max_position_embeddings": ctx, "n_positions": ctx,
        "layer_norm_epsilon": eps, "layer_norm_eps": eps, "rms_norm_eps": eps,
        "rope_theta": key("rope.freq_base", number, 10000.0),
        "partial_rotary_factor": rotary_fraction, "rotary_pct": rotary_fraction, "rotary_dim": rotary,
        "sliding_window": window, "use_sliding_window": window is not None, "max_window_layers": 0,
        "attn_logit_softcapping": key("attn_logit_softcapping", number, caps[0]),
        "final_logit_softcapping": key("final_logit_softcapping", number, caps[1]),
        "use_parallel_residual": key("use_parallel_residual", bool, True),
        "query_pre_attn_scalar": score_scalar(arch, n_layer, n_embd, n_head, head_dim) if n_head > 0 else head_dim,
        "attention_bias": "blk.0.attn_output.bias" in tensors, "mlp_bias": "blk.0.ffn_down.bias" in tensors,
        "tie_word_embeddings": tied,
        # llama.cpp runs GELU as its tanh approximation in every architecture, and SwiGLU with silu
        "hidden_act": "gelu_new" if arch == "gptneox" else "silu", "activation_function": "gelu_new",
        "hidden_activation": "gelu_pytorch_tanh",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "attention_dropout": 0.0, "hidden_dropout": 0.0,
    }


def load_gguf(path: str | Path, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None) -> tuple[GPT, HFTokenizer]:
    """(model, tokenizer) from a GGUF file; `dtype=None`: the embedding's (f16, bf16), else float32."""
    path = Path(path)
    reader = open_gguf(path)
    meta, tensors = _Metadata(path, reader), _Tensors(path, reader)
    config, arch = gguf_config(path, meta, tensors)
    tokenizer = tokenizer_from_gguf(meta, config.vocab_size)
    try:
        state = gptlab_tensors(config, arch, tensors.take)
    except GptlabError as e:
        message = str(e)
        raise GptlabError(message if message.startswith(str(path)) else f"{path}: {message}") from None
    _refuse_unread(path, tensors, config.tie_embeddings)
    expected = plain_shapes(config)
    dtype = dtype or {"F16": torch.float16, "BF16": torch.bfloat16}.get(
        tensors.by_name["token_embd.weight"].tensor_type.name, torch.float32)
    weights = {name: torch.from_numpy(a).to(device=device, dtype=dtype) for name, a in state.items()}
    del state, reader
    with torch.device("meta"):
        model = GPT(config)
    if config.tie_embeddings and "lm_head.weight" in expected:
        weights["lm_head.weight"] = weights["transformer.wte.weight"]
    return assign_weights(model, weights, where=f"{path} (against its metadata)"), tokenizer
