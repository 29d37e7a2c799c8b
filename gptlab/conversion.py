"""`convert`: a model moved between gptlab's formats and the others: a Hugging Face directory <-> a gptlab checkpoint,
either -> one GGUF file for llama.cpp, a LoRA run -> merged, or its adapters alone as a peft directory. Reading the
source is `gptlab.loading`'s (any model path in); writing is each format's own (`checkpoint`, `interop`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.checkpoint import CONFIG_FILE, LORA_FILE, read_lora_config, save_model
from gptlab.errors import GptlabError
from gptlab.fileio import MARKER, atomic_write_dir, is_gptlab_output
from gptlab.interop import save_hf, save_peft_adapter
from gptlab.loading import is_hf_dir, load_model, resolve_checkpoint
from gptlab.model import GPT
from gptlab.tokenizer import Tokenizer, optional_tokenizer


@dataclass
class Conversion:
    """What `convert` wrote: the format, the model, its tokenizer (None, and why, when the source had none)."""

    to: str  # "hf", "gptlab", "gguf", "ollama" or "peft" (a LoRA run's adapters alone)
    destination: Path
    model: GPT
    tokenizer: Tokenizer | None
    no_tokenizer_reason: str = ""
    base: str | None = None  # peft: the base model the adapters go on

    @property
    def architecture(self) -> str:
        """The Hugging Face class name written (hf), else what was written."""
        if self.to == "peft":
            return "peft LoRA adapter"
        if self.to != "hf":
            return "gptlab checkpoint"
        return json.loads((self.destination / CONFIG_FILE).read_text())["architectures"][0]


def convert(
    src: str | Path, dst: str | Path, to: str | None = None, dtype: torch.dtype | None = None,
    adapter_only: bool = False, gguf_dtype: str = "f16",
) -> Conversion:
    """A Hugging Face directory or a GGUF file -> a gptlab checkpoint, or a gptlab checkpoint / run -> a Hugging
    Face directory (`to` overrides the direction, which otherwise follows from `src`), or any -> one GGUF file for
    llama.cpp (`to="gguf"`, its tensors in `gguf_dtype`: f32, f16, bf16, q8_0 or q4_0). DST is replaced as a whole,
    atomically; the tokenizer comes along when SRC has one.

    A LoRA run converts merged (its base with the adapters folded in), or with `adapter_only` into a peft
    adapter directory for the Hugging Face form of its base."""
    if to not in (None, "hf", "gptlab", "gguf", "ollama"):
        raise GptlabError(f"cannot convert to {to!r}: choose hf, gptlab, gguf or ollama")
    if not str(dst).strip():
        raise GptlabError("DST is empty: name the directory (or .gguf file) to write")
    src = resolve_checkpoint(src)
    dst = Path(dst)
    if to == "gguf":
        return _convert_gguf(src, dst, gguf_dtype, adapter_only)
    if to == "ollama":
        return _convert_ollama(src, dst, gguf_dtype, adapter_only)
    _check_destination(src, dst)
    is_lora = (src / LORA_FILE).is_file()
    if adapter_only:
        if not is_lora:
            raise GptlabError(f"--adapter-only needs a LoRA run or checkpoint; {src} holds a whole model")
        if to == "gptlab":
            raise GptlabError("--adapter-only writes a peft adapter (Hugging Face format): drop --to gptlab")
        return _convert_adapter(src, dst)
    src_is_foreign = is_hf_dir(src) or src.is_file()  # a Hugging Face directory or a GGUF file
    to = to or ("gptlab" if src_is_foreign else "hf")
    model, tokenizer = load_model(src, dtype=dtype)
    why_not = "" if tokenizer is not None else optional_tokenizer(src)[1]
    if to == "hf":
        save_hf(model, dst, tokenizer)
    else:
        save_model(dst, model, tokenizer)
    return Conversion(to, dst, model, tokenizer, why_not)


def _convert_adapter(src: Path, dst: Path) -> Conversion:
    """A LoRA checkpoint's adapters -> a peft directory naming its base (the base's own path when that is a
    Hugging Face directory; a gptlab base must be converted too, and the note says so)."""
    model, tokenizer = load_model(src, merge_adapters=False)
    base = read_lora_config(src)[1]["path"]
    save_peft_adapter(model, dst, base_model=base)
    note = "" if is_hf_dir(Path(base)) else (f"the base {base} is a gptlab checkpoint: convert it too (`gptlab "
                                             f"convert {base} BASE_HF --to hf`) and load the adapter onto that")
    return Conversion("peft", dst, model, tokenizer, no_tokenizer_reason=note, base=base)


def _convert_gguf(src: Path, dst: Path, gguf_dtype: str, adapter_only: bool) -> Conversion:
    from gptlab.interop.gguf import save_gguf

    if adapter_only:
        raise GptlabError("--adapter-only writes a peft directory; GGUF holds whole (merged) models")
    if dst.is_dir():
        raise GptlabError(f"DST {dst} is a directory: GGUF is one file (e.g. {dst / 'model.gguf'})")
    if dst.exists() and dst.suffix != ".gguf":
        raise GptlabError(f"DST {dst} exists and is not a .gguf file; refusing to replace it")
    model, tokenizer = load_model(src, dtype=torch.float32)
    save_gguf(model, dst, tokenizer, dtype=gguf_dtype)
    return Conversion("gguf", dst, model, tokenizer)


def _convert_ollama(src: Path, dst: Path, gguf_dtype: str, adapter_only: bool) -> Conversion:
    """DST: a directory with the GGUF file and a Modelfile for `ollama create NAME -f DST/Modelfile`."""
    from gptlab.interop.gguf import save_gguf
    from gptlab.interop.ollama import GGUF_NAME, MODELFILE, modelfile

    if adapter_only:
        raise GptlabError("--adapter-only writes a peft directory; ollama runs whole (merged) models")
    _check_destination(src, dst)
    model, tokenizer = load_model(src, dtype=torch.float32)
    if tokenizer is None:
        raise GptlabError(f"ollama needs the model's tokenizer, and {src} has none")
    text, note = modelfile(tokenizer)

    def write(tmp: Path) -> None:
        save_gguf(model, tmp / GGUF_NAME, tokenizer, dtype=gguf_dtype)
        (tmp / MODELFILE).write_text(text, encoding="utf-8")

    atomic_write_dir(dst, write)
    return Conversion("ollama", dst, model, tokenizer, no_tokenizer_reason=note)


def _check_destination(src: Path, dst: Path) -> None:
    """DST is replaced as a whole (atomically), so refuse anything that could lose unrelated files."""
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise GptlabError(f"DST {dst} overlaps SRC {src}: write the converted model somewhere else")
    if dst.exists() and not dst.is_dir():
        raise GptlabError(f"DST {dst} is a file: pass a directory to create")
    if dst.is_dir() and any(dst.iterdir()) and not is_gptlab_output(dst):
        raise GptlabError(f"DST {dst} is a non-empty directory gptlab did not write (no {MARKER} file); refusing to "
                          "replace it: remove it yourself or choose another DST")


@dataclass
class Upload:
    """What `upload` sent (or, with dry_run, would send): the files and the repository's URL (None: dry run)."""

    repo_id: str
    files: list[str]
    url: str | None


def upload(src: str | Path, repo_id: str, dry_run: bool = False, token: str | None = None,
           private: bool = False) -> Upload:
    """A run or checkpoint on the Hugging Face Hub: safetensors weights, config.json, the tokenizer and a model card
    (the recipe and metrics.jsonl of the run SRC names), written as `--to hf` writes them, then pushed."""
    import tempfile

    from gptlab.interop.upload import CARD_FILE, model_card, push_folder, read_run
    from gptlab.interop.upload import METRICS_FILE as RUN_LOG

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise GptlabError(f"REPO_ID {repo_id!r} must be owner/name (e.g. alice/shakespeare-char)")
    checkpoint = resolve_checkpoint(src)
    model, tokenizer = load_model(checkpoint)
    # the run: SRC itself, or the run a checkpoint (RUN/checkpoints/step-N) belongs to
    runs = [p for p in (Path(src), checkpoint.parent.parent) if (p / RUN_LOG).is_file()]
    rows, recipe = read_run(runs[0] if runs else None)
    with tempfile.TemporaryDirectory(prefix="gptlab-upload-") as tmp:
        folder = Path(tmp) / "model"
        save_hf(model, folder, tokenizer)
        architecture = json.loads((folder / CONFIG_FILE).read_text())["architectures"][0]
        card = model_card(repo_id, model.config, architecture, model.num_parameters(), rows, recipe)
        (folder / CARD_FILE).write_text(card, encoding="utf-8")
        (folder / MARKER).unlink(missing_ok=True)  # gptlab's own marker means nothing on the Hub
        files = sorted(p.name for p in folder.iterdir())
        url = None if dry_run else push_folder(folder, repo_id, token=token, private=private)
    return Upload(repo_id, files, url)
