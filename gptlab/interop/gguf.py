"""GGUF export: a gptlab model and its tokenizer as one file llama.cpp runs (`gptlab convert SRC OUT.gguf --to gguf`).

GGUF holds key/value metadata (architecture sizes, the tokenizer, its chat template) and named tensors, written
with the `gguf` package (an optional dependency: the `gguf` extra). Which of llama.cpp's architectures runs the
model and under which names its tensors go is `gguf_arch`'s; the tokenizer as byte-level BPE is `gguf_vocab`'s.
The chat template gptlab's own chat uses (the tokenizer's, else the built-in "plain") goes in as
`tokenizer.chat_template`, so llama.cpp and ollama format conversations as the model was fine-tuned to read
them; a template that ends the assistant's turn with one special token names it as `tokenizer.ggml.eot_token_id`,
where llama.cpp stops.

Weights are written in f32, f16, bf16, q8_0 (blocks of 32 int8 values with one f16 scale) or q4_0 (blocks of 32
4-bit values with one f16 scale, the format llama.cpp's q4_0 benchmarks use); 1-D tensors (norms,
biases) stay f32, as llama.cpp's own converter writes them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gptlab.checkpoint import unwrap_model
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_file
from gptlab.interop.gguf_arch import gguf_architecture, gguf_tensors, interleave_rope_rows, write_hparams
from gptlab.interop.gguf_vocab import UNUSED, gguf_vocabulary, pre_tokenizer_name
from gptlab.interop.hf import whole_model_state
from gptlab.tokenizer.chat_template import chat_template_for, reply_stops

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

__all__ = ["GGUF_DTYPES", "gguf_vocabulary", "interleave_rope_rows", "save_gguf"]
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


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
    arch = gguf_architecture(cfg)
    if tokenizer is None:
        raise GptlabError("GGUF export needs the model's tokenizer (llama.cpp keeps it in the file), and SRC has none")
    tokens, merges, types = gguf_vocabulary(tokenizer, cfg.vocab_size)
    state = {name: t.detach().float().cpu().numpy() for name, t in whole_model_state(plain).items()}
    tensors = gguf_tensors(cfg, arch, state)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch.name)
        writer.add_name(cfg.name)
        write_hparams(writer, cfg, arch)
        writer.add_file_type(_FILE_TYPES[dtype](gguf.LlamaFileType))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        _write_special_tokens(writer, tokenizer, types)
        for name, array in tensors.items():
            data, qtype = _encode(gguf, array, dtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    written = atomic_write_file(path, write)
    if tokenizer.eot_id is None and UNUSED not in types and LLAMA_CPP_DEFAULT_EOS < len(types):
        print(f"note: the tokenizer has no end-of-text token and the model no spare vocabulary row to name as one: "
              f"llama.cpp ends generation at its default, token {LLAMA_CPP_DEFAULT_EOS} "
              f"({tokenizer.decode([LLAMA_CPP_DEFAULT_EOS])!r}); a model whose vocab_size is larger than the "
              "tokenizer's gets a spare row", file=sys.stderr)
    return written


_FILE_TYPES = {"f32": lambda t: t.ALL_F32, "f16": lambda t: t.MOSTLY_F16, "bf16": lambda t: t.MOSTLY_BF16,
               "q8_0": lambda t: t.MOSTLY_Q8_0, "q4_0": lambda t: t.MOSTLY_Q4_0}


def _write_special_tokens(writer: Any, tokenizer: TextTokenizer, types: list[int]) -> None:
    """End of text, beginning of text, the chat template and the token that ends an assistant's turn."""
    if tokenizer.eot_id is not None:
        writer.add_eos_token_id(tokenizer.eot_id)
        writer.add_bos_token_id(tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eot_id)
    else:
        _write_no_end_of_text(writer, tokenizer, types)
    writer.add_add_bos_token(bool(tokenizer.adds_bos))
    template = chat_template_for(tokenizer)
    writer.add_chat_template(template.source)
    turn_end = turn_end_token(tokenizer)
    if turn_end is not None and turn_end != tokenizer.eot_id:
        writer.add_eot_token_id(turn_end)


def _write_no_end_of_text(writer: Any, tokenizer: TextTokenizer, types: list[int]) -> None:
    """A tokenizer without end-of-text (a character vocabulary): llama.cpp, given no eos_token_id, ends generation
    at token 11, a real character there. A padded vocabulary's first spare row, which no text spells, is named as
    the end instead; without one, any id names a token, so `save_gguf` says which one llama.cpp stops at."""
    spare = next((i for i, kind in enumerate(types) if kind == UNUSED), None)
    if tokenizer.bos_id is not None or spare is not None:
        writer.add_bos_token_id(tokenizer.bos_id if tokenizer.bos_id is not None else spare)
    if spare is not None:
        writer.add_eos_token_id(spare)


LLAMA_CPP_DEFAULT_EOS = 11  # llama.cpp's BOS and EOS for a BPE vocabulary whose file names none


def turn_end_token(tokenizer: TextTokenizer) -> int | None:
    """The one token the chat template's replies end with (ChatML's <|im_end|>, Llama 3's <|eot_id|>), if any."""
    for stop in reply_stops(chat_template_for(tokenizer)):
        try:
            ids = tokenizer.encode(stop, allow_special=True)
            plain = tokenizer.encode(stop)
        except (GptlabError, ValueError, KeyError):  # text a character vocabulary cannot spell
            continue
        if len(ids) == 1 and plain != ids:  # a special token, not text that happens to be one token
            return ids[0]
    return None


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


