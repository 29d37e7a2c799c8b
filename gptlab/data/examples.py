"""Records -> training examples with a loss mask, placed in fixed windows: `gptlab prepare` for record inputs.

Each record (see :mod:`gptlab.data.records`) becomes one example, token ids plus a mask (1 = a training target):

* text: the tokens of the text, then the end-of-text id (as between .txt documents); every token a target.
* chat and prompt/completion: rendered with the chat template (``--chat-template chatml|plain``, else the
  tokenizer's own, else "plain"), piece by piece (`ChatTemplate.segments`); each piece is encoded on its own
  and the ids concatenated, which is exactly what inference sees: the prompt's tokens, then the generated
  ones. Special-token strings become their ids (``allow_special=True``) except under "plain", which has none
  of its own and whose text `gptlab chat` and `gptlab serve` encode as plain text (so a "<|endoftext|>" in a
  message stays text there, as here). The assistant's pieces (its reply and end-of-turn marker) are targets,
  the rest not; ``--train-on-prompt`` makes every token a target.

Examples go into windows of ``--block-size N`` + 1 tokens, the rows the trainer samples (inputs [:-1], targets
[1:]), so no row ever starts mid-example. Packed (the default), examples are laid whole and in order into the
current window; one that does not fit in what is left of it starts the next, and the rest is padded. Padded
(``--no-pack``), each example has a window of its own. Padding is the end-of-text id (0 without one) with mask
0, and so is a window's first token (no row position predicts it). An example longer than a window is cut to
it (counted as ``truncated``); one left without any target after its first token (nothing to learn: no
assistant turn, empty text) is skipped (counted as ``dropped``).
Preference pairs (layout ``pairs``, for ``train --objective dpo``) are always padded: prompt + chosen in one
window, prompt + rejected in the next, targets on the reply's tokens only; a pair whose reply the window cuts to
nothing is dropped whole (``examples`` counts pairs).
The last ``--val-fraction`` of the records, in input order, is the val split (at least one record).

Written beside the usual files: ``train.mask.bin`` / ``val.mask.bin`` (uint8, one byte per token of
``train.bin`` / ``val.bin``), and meta.json gains ``mask``, ``window_tokens``, ``layout``, ``examples``,
``truncated``, ``dropped``, ``pad_id``, ``chat_template`` and ``train_on_prompt``. Memory holds one record and
one window per split; records are read twice (once to count and check them, once to encode them), or three
times when a bpe tokenizer is trained on them (from the train split only).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gptlab.data.common import base_meta, dtype_for, early_tokenizer, progress, show_progress, write_output
from gptlab.data.dataset import META, SPLITS
from gptlab.data.records import RecordFile
from gptlab.data.shapes import Record
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_json
from gptlab.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from gptlab.tokenizer.chat_template import ChatTemplate, ChatTemplateError, chat_template_for


@dataclass(frozen=True)
class RecordOptions:
    """The `gptlab prepare` options that only records have (see the module docstring)."""

    block_size: int | None = None
    pack: bool = True
    chat_template: str | None = None
    train_on_prompt: bool = False
    text_field: str | None = None
    split_name: str | None = None

    def given(self) -> list[str]:
        """The flags set away from their defaults (an error for text inputs, which would ignore them)."""
        flag = {"pack": "--no-pack"}
        return [flag.get(f.name, "--" + f.name.replace("_", "-")) for f in fields(self)
                if getattr(self, f.name) != f.default]


# --- one example ------------------------------------------------------------------------------------------------


def record_text(record: Record, template: ChatTemplate) -> str:
    """The whole text of a record as its tokens will spell it (a char vocabulary and bpe training read this)."""
    if record.shape == "text":
        return record.text
    try:
        if record.shape == "preference":
            return template.render(record.messages + record.chosen) + template.render(record.messages + record.rejected)
        return template.render(record.messages)
    except ChatTemplateError as e:
        raise GptlabError(f"{record.where}: {e}") from None


def encode_record(
    record: Record, tok: Tokenizer, template: ChatTemplate, train_on_prompt: bool = False
) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids int64, mask uint8, characters) of one example; see the module docstring."""
    try:
        if record.shape == "text":
            if not record.text:
                return np.zeros(0, np.int64), np.zeros(0, np.uint8), 0
            ids = tok.encode_np(record.text).astype(np.int64, copy=False)
            if tok.eot_id is not None:
                ids = np.append(ids, tok.eot_id)
            return ids, np.ones(len(ids), np.uint8), len(record.text)
        try:
            pieces = template.segments(record.messages)
        except ChatTemplateError as e:
            raise GptlabError(str(e)) from None
        return _encode_pieces(pieces, tok, template, train_on_prompt)
    except GptlabError as e:
        raise GptlabError(f"{record.where}: {e}") from None


def _encode_pieces(pieces: list[tuple[str, bool]], tok: Tokenizer, template: ChatTemplate, train_on_prompt: bool
                   ) -> tuple[np.ndarray, np.ndarray, int]:
    """Each (text, is_target) piece encoded on its own, the ids concatenated: what inference sees."""
    special = template.name != "plain"  # as inference encodes it (generation.chat, serve): see the docstring
    parts = [(np.asarray(tok.encode(text, allow_special=special), np.int64), target) for text, target in pieces]
    ids = np.concatenate([p for p, _ in parts]) if parts else np.zeros(0, np.int64)
    mask = np.concatenate([np.full(len(p), target or train_on_prompt, np.uint8) for p, target in parts]) if parts \
        else np.zeros(0, np.uint8)
    return ids, mask, sum(len(text) for text, _ in pieces)


def encode_pair(record: Record, tok: Tokenizer, template: ChatTemplate
                ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], int]:
    """A preference pair as two examples, (ids, mask) of prompt + chosen and of prompt + rejected, and its
    characters. Only the reply's own tokens are targets (an assistant turn inside the prompt is not), and both
    share the prompt's tokens: the pieces before the reply are the same text, encoded alike."""
    try:
        prompt = template.render(record.messages, add_generation_prompt=True)
        out, chars = [], 0
        for reply in (record.chosen, record.rejected):
            pieces = template.segments(record.messages + reply)
            if not "".join(t for t, _ in pieces).startswith(prompt):
                raise ChatTemplateError(f"{template.label} renders the prompt differently before a reply than on its "
                                        "own, so the reply's tokens cannot be located")
            ids, mask, n = _encode_pieces(_reply_only(pieces, len(prompt)), tok, template, False)
            out.append((ids, mask))
            chars += n
    except (GptlabError, ChatTemplateError) as e:
        raise GptlabError(f"{record.where}: {e}") from None
    return out[0], out[1], chars


def _reply_only(pieces: list[tuple[str, bool]], start: int) -> list[tuple[str, bool]]:
    """`pieces` with targets only from character `start` on (a piece across it split there)."""
    out, at = [], 0
    for text, target in pieces:
        cut = min(max(start - at, 0), len(text))
        if cut:
            out.append((text[:cut], False))
        if cut < len(text):
            out.append((text[cut:], target))
        at += len(text)
    return out


# --- windows ----------------------------------------------------------------------------------------------------


class WindowWriter:
    """Lays examples into windows of `window` tokens and appends each full window to two files: the ids (as
    `dtype`) and the mask (uint8). Holds one window in memory."""

    def __init__(self, ids: BinaryIO, mask: BinaryIO, window: int, pack: bool, pad_id: int, dtype: np.dtype):
        self.files, self.window, self.pack, self.pad_id = (ids, mask), window, pack, pad_id
        self.ids = np.full(window, pad_id, dtype=dtype)
        self.mask = np.zeros(window, np.uint8)
        self.fill = self.windows = self.examples = self.truncated = self.dropped = 0
        self.cut_off = 0  # of the dropped: targets only past the window's end

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        cut = len(ids) > self.window
        if not mask[1 : self.window].any():  # no target a window row could train on
            self.dropped += 1
            self.cut_off += bool(mask[self.window :].any())
            return
        ids, mask = ids[: self.window], mask[: self.window]
        if self.fill and (not self.pack or self.fill + len(ids) > self.window):
            self.flush()
        self.ids[self.fill : self.fill + len(ids)] = ids
        self.mask[self.fill : self.fill + len(ids)] = mask
        self.fill += len(ids)
        self.examples += 1
        self.truncated += cut

    def add_pair(self, chosen: tuple[np.ndarray, np.ndarray], rejected: tuple[np.ndarray, np.ndarray]) -> None:
        """A preference pair: chosen in a window of its own and rejected in the next, so that a pair is always
        two consecutive windows; dropped whole when either reply keeps no target (cut by the window)."""
        cut = [(ids[: self.window], mask[: self.window]) for ids, mask in (chosen, rejected)]
        if not all(mask[1:].any() for _, mask in cut):
            self.dropped += 1
            self.cut_off += any(mask[self.window :].any() for _, mask in (chosen, rejected))
            return
        self.flush()
        for ids, mask in cut:
            self.ids[: len(ids)], self.mask[: len(ids)] = ids, mask
            self.fill = len(ids)
            self.flush()
        self.examples += 1
        self.truncated += len(chosen[0]) > self.window or len(rejected[0]) > self.window

    def flush(self) -> None:
        """Pad the current window (pad id, mask 0) and write it."""
        if not self.fill:
            return
        self.ids[self.fill :] = self.pad_id
        self.mask[self.fill :] = 0
        self.mask[0] = 0  # no row position predicts a window's first token
        self.files[0].write(self.ids.tobytes())
        self.files[1].write(self.mask.tobytes())
        self.windows += 1
        self.fill = 0


# --- prepare ----------------------------------------------------------------------------------------------------


def _val_count(n: int, val_fraction: float, files: Sequence[RecordFile]) -> int:
    if n == 0:
        raise GptlabError(f"the input is empty ({', '.join(str(f.path) for f in files[:3])} has no records)")
    if n < 2:
        raise GptlabError(f"only 1 record in {', '.join(str(f.path) for f in files[:3])}: need at least 2 (the last "
                          "--val-fraction of them become the val split)")
    return min(n - 1, max(1, int(n * val_fraction + 1e-6)))


def _all_records(files: Sequence[RecordFile]) -> Iterator[Record]:
    for f in files:
        yield from f.records()


def prepare_records(
    inputs: Sequence[str | os.PathLike[str]],
    out: Path,
    options: RecordOptions,
    *,
    tokenizer: str | None,
    vocab_size: int | None,
    val_fraction: float,
    tokenizer_from: str | os.PathLike[str] | None,
) -> dict[str, Any]:
    """Records -> DATA_DIR with loss masks, as the module docstring says; options were checked by `prepare`."""
    if options.block_size is None:
        raise GptlabError("record inputs need --block-size N, the block_size of the model to train: examples are "
                          "packed into windows of N+1 tokens")
    if options.block_size < 1:
        raise GptlabError(f"--block-size must be at least 1, got {options.block_size}")
    window = options.block_size + 1
    tok = early_tokenizer(tokenizer, tokenizer_from)
    with ExitStack() as stack:
        files = []
        for i in inputs:
            files.append(RecordFile(Path(i).expanduser(), options.text_field, options.split_name))
            stack.callback(files[-1].close)
        # pass 1: check every record before any long work; count them (the split), and the characters for char
        # (built-in templates use no special tokens, so a template made before the tokenizer renders the same)
        draft = chat_template_for(tok, options.chat_template)
        draft.compile()  # a template that is not valid Jinja fails now, not after the pass over every record
        collect = tok is None and tokenizer == "char"
        charset: set[str] = set()
        counts, shapes = [], []
        with progress(None, "check records", "rec") as bar:
            for f in files:
                n, shape = 0, None
                for record in f.records():
                    n, shape = n + 1, record.shape
                    if collect:
                        charset.update(record_text(record, draft))
                    bar.update(1)
                counts.append(n)
                shapes.append(shape)
        total = sum(counts)
        n_train = total - _val_count(total, val_fraction, files)
        if collect:
            if not charset:
                raise GptlabError("the records have no text to build a char vocabulary from")
            tok = CharTokenizer(charset)
        elif tok is None:  # bpe, from the train split's records only (as for text: val stays unseen)
            assert vocab_size is not None
            texts = (record_text(r, draft) for _, r in zip(range(n_train), _all_records(files), strict=False))
            tok = HFTokenizer.train((t for t in texts if t), vocab_size, show_progress())
            if tok.vocab_size < vocab_size:
                print(f"note: the records only support {tok.vocab_size} bpe tokens, not {vocab_size}",
                      file=sys.stderr)
        template = chat_template_for(tok, options.chat_template)
        chat = any(s != "text" for s in shapes)
        if "preference" in shapes and len(set(shapes)) > 1:
            other = next(f for f, s in zip(files, shapes, strict=True) if s != "preference")
            raise GptlabError(f"{other.path} holds {shapes[files.index(other)]} records and the other inputs "
                              "preference pairs: a DATA_DIR of pairs (for --objective dpo) holds pairs only")
        meta: dict[str, Any] = {}

        def write(tmp: Path) -> None:
            tok.save(tmp)
            writers, chars = _write_windows(tmp, tok, template, files, options, window, n_train, total)
            sources = [{"path": str(f.path), "format": f.format, "shape": shape, "records": n}
                       for f, shape, n in zip(files, shapes, counts, strict=True)]
            for src, f in zip(sources, files, strict=True):
                src["bytes"], src["sha256"] = f.fingerprint()
            meta.update({
                # only text examples end with end-of-text; a chat's eos may end every turn (document_mask reads this)
                **base_meta(tok, {split: writers[split].windows * window for split in SPLITS}, chars, val_fraction,
                            tok.eot_id is not None and not chat),
                "sources": sources,
                "mask": True,
                "window_tokens": window,
                "layout": "pairs" if "preference" in shapes else "packed" if options.pack else "padded",
                "examples": {s: writers[s].examples for s in SPLITS},
                "truncated": sum(w.truncated for w in writers.values()),
                "dropped": sum(w.dropped for w in writers.values()),
                "pad_id": writers["train"].pad_id,
                "chat_template": template.name if chat else None,
                "train_on_prompt": options.train_on_prompt,
            })
            atomic_write_json(tmp / META, meta)

        write_output(out, write)  # built beside `out`, swapped in whole
    return meta


def _write_windows(
    out: Path, tok: Tokenizer, template: ChatTemplate, files: Sequence[RecordFile], options: RecordOptions,
    window: int, n_train: int, total: int,
) -> tuple[dict[str, WindowWriter], dict[str, int]]:
    """Pass 2: encode every record into hidden .partial files, renamed into place only when both splits are good."""
    names = {s: (f"{s}.bin", f"{s}.mask.bin") for s in SPLITS}
    partial = {name: out / f".{name}.partial" for pair in names.values() for name in pair}
    pad_id = tok.eot_id if tok.eot_id is not None else 0
    chars = dict.fromkeys(SPLITS, 0)
    try:
        with ExitStack() as stack:
            writers = {}
            for s, (ids_name, mask_name) in names.items():
                ids_file = stack.enter_context(open(partial[ids_name], "wb", buffering=1 << 20))
                mask_file = stack.enter_context(open(partial[mask_name], "wb", buffering=1 << 20))
                writers[s] = WindowWriter(ids_file, mask_file, window, options.pack, pad_id, dtype_for(tok.vocab_size))
            bar = stack.enter_context(progress(total, f"tokenize ({tok.kind})", "rec"))
            for i, record in enumerate(_all_records(files)):
                split = "train" if i < n_train else "val"
                if record.shape == "preference":
                    chosen, rejected, n_chars = encode_pair(record, tok, template)
                    writers[split].add_pair(chosen, rejected)
                else:
                    ids, mask, n_chars = encode_record(record, tok, template, options.train_on_prompt)
                    writers[split].add(ids, mask)
                chars[split] += n_chars
                bar.update(1)
            for w in writers.values():
                w.flush()
        for s in SPLITS:
            if not writers[s].windows:
                w = writers[s]
                if w.cut_off:  # the records are fine: the window is too short for them
                    raise GptlabError(
                        f"the {s} split has no example left: {w.cut_off} of its {w.dropped} record(s) have their "
                        f"target tokens only past --block-size {window - 1}, which cuts them off; raise --block-size"
                    )
                raise GptlabError(
                    f"the {s} split has no example left: its {w.dropped} record(s) have no target token (no "
                    "assistant reply, or empty text); "
                    + ("use a larger --val-fraction" if s == "val" else "check the records, or --train-on-prompt")
                )
        for name in partial:
            os.replace(partial[name], out / name)
    finally:
        for p in partial.values():
            p.unlink(missing_ok=True)
    return writers, chars
