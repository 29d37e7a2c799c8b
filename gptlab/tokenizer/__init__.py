"""Tokenizers behind one small interface: char, GPT-2 (tiktoken), byte-level BPE and Hugging Face.

Every tokenizer has ``kind``, ``vocab_size``, ``eot_id`` (end-of-text id or None), ``bos_id``,
``chat_template`` (Jinja text or None), ``encode``, ``decode``, ``decode_bytes``, ``encode_batch`` and
``save``; :func:`load_tokenizer` reads back what ``save`` wrote, or a plain Hugging Face model directory.

Plain text in, plain text out: ``encode(text)`` never turns the *text* ``<|endoftext|>`` (or any other
special-token string) into a special id, so user data can't inject control tokens or crash the encoder.
Pass ``allow_special=True`` (e.g. for a rendered chat template) to map special-token strings to their ids.
``decode`` keeps special tokens (``decode(encode(s)) == s`` for every string the tokenizer can encode).
Ids at or above ``vocab_size`` (a model's padded vocabulary, e.g. 50304 for GPT-2) decode to U+FFFD.

On-disk format (one directory; written with every checkpoint and data directory):

* ``tokenizer_meta.json`` -- always: ``{"format": "gptlab-tokenizer", "version": 1, "kind": ...,
  "vocab_size": int, "eot_id": int | null, "bos_id": int | null, "chat_template": str | null}`` plus, for
  ``char``, ``"chars"``: the vocabulary as a list of one-character strings, id = index (sorted); for
  ``gpt2``, ``"encoding": "gpt2"`` (the BPE tables come from tiktoken, not from the directory).
* ``tokenizer.json`` -- for ``bpe`` and ``hf`` only: the Hugging Face ``tokenizers`` file, so the directory
  also loads with ``tokenizers.Tokenizer.from_file`` (and in transformers).

:func:`load_tokenizer` reads ``tokenizer_meta.json`` when present; otherwise it treats the directory as a
Hugging Face model directory: ``tokenizer.json`` (+ ``tokenizer_config.json`` / ``chat_template.jinja`` /
``generation_config.json`` for eos, bos and the chat template), or GPT-2 style ``vocab.json`` +
``merges.txt``.
"""

from gptlab.tokenizer.base import (
    EOT_TEXT,
    HF_FILE,
    KINDS,
    MAX_BPE_VOCAB,
    META_FILE,
    MIN_BPE_VOCAB,
    CharTokenizer,
    DamagedTokenizer,
    GPT2Tokenizer,
    TextTokenizer,
    Tokenizer,
    UnknownCharacters,
    fingerprint,
    token_text,
)
from gptlab.tokenizer.huggingface import HFTokenizer
from gptlab.tokenizer.loading import load_tokenizer, optional_tokenizer

__all__ = ["EOT_TEXT", "HF_FILE", "KINDS", "META_FILE", "MAX_BPE_VOCAB", "MIN_BPE_VOCAB", "CharTokenizer",
           "DamagedTokenizer", "GPT2Tokenizer", "HFTokenizer", "TextTokenizer", "Tokenizer", "UnknownCharacters",
           "fingerprint", "load_tokenizer", "optional_tokenizer", "token_text"]
