"""GGUF import: gptlab -> GGUF -> gptlab computes the same logits for every family export writes (exactly in f32;
q8_0 and q4_0 within their quantization's step, checked weight by weight against the blocks' maths; f16 and bf16
equal to torch's casts), with the tokenizer's ids and the chat template; and every damaged GGUF file (cut
anywhere, wrong magic or version, counts and lengths past the file, a tensor past the end, wrong shapes and types,
missing keys, an unknown architecture, a directory, an empty file, a symlink loop) answered in one line naming the
file, exit 2."""

from __future__ import annotations

import contextlib
import io
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_families import FAMILIES, hf_family_dir

from gptlab import GPT, GPTConfig
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.conversion import convert
from gptlab.loading import load_model
from gptlab.tokenizer import CharTokenizer
from gptlab.tokenizer.chat_template import chat_template_for

gguf = pytest.importorskip("gguf")

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer 1234\n"
PROBES = ["To be, or not 1234 we'll", "Whether 'tis nobler in the mind"]


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor([ids]))[0].float()


def _char_gpt2(root: Path, n_embd: int = 64) -> Path:
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2", n_layer=2, n_embd=n_embd, n_head=4, vocab_size=tok.vocab_size,
                                 block_size=32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return save_model(root / "ckpt", model, tok)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_comes_back_from_gguf_with_the_same_logits_tokens_and_template(tmp_path: Path,
                                                                                   family: str) -> None:
    src = hf_family_dir(tmp_path / "hf", family)
    done = convert(src, tmp_path / "m.gguf", to="gguf", gguf_dtype="f32")
    model, tok = load_model(tmp_path / "m.gguf")
    for text in PROBES:
        ids = done.tokenizer.encode(text)
        assert tok.encode(text) == ids, (family, text)
        torch.testing.assert_close(_logits(model, ids), _logits(done.model, ids), rtol=0, atol=1e-5)
    assert chat_template_for(tok).source == chat_template_for(done.tokenizer).source
    assert tok.eot_id == done.tokenizer.eot_id
    messages = [{"role": "user", "content": "Whether 'tis"}]
    rendered = chat_template_for(tok).render(messages, add_generation_prompt=True)
    assert tok.encode(rendered, allow_special=True) == done.tokenizer.encode(rendered, allow_special=True)



@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_file_without_add_bos_token_starts_text_as_llama_cpp_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   family: str) -> None:
    """Where tokenizer.ggml.add_bos_token is absent (files of older converters), llama.cpp starts text with BOS
    under the llama-bpe split (Llama 3's), not under gpt-2's or qwen2's: gptlab reads the file as llama.cpp does."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_add_bos_token", lambda self, value: None)
    convert(hf_family_dir(tmp_path / "hf", family), tmp_path / "m.gguf", to="gguf", gguf_dtype="f32")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert "tokenizer.ggml.add_bos_token" not in fields
    tok = load_model(tmp_path / "m.gguf")[1]
    bos = fields["tokenizer.ggml.bos_token_id"].contents()
    assert (tok.adds_bos, tok.bos_id) == ((True, bos) if family == "llama" else (False, None))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_cpp_adds_bos_to_such_a_file_as_gptlab_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             family: str) -> None:
    from helpers import open_llama_cpp

    monkeypatch.setattr(gguf.GGUFWriter, "add_add_bos_token", lambda self, value: None)
    convert(hf_family_dir(tmp_path / "hf", family), tmp_path / "m.gguf", to="gguf", gguf_dtype="f32")
    tok = load_model(tmp_path / "m.gguf")[1]
    ids = open_llama_cpp(tmp_path / "m.gguf", vocab_only=True).tokenize(b"To be", add_bos=True)
    assert ids == ([tok.bos_id] if tok.adds_bos else []) + tok.encode("To be")


def test_gemma2_27bs_score_scale_is_llama_cpps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """llama.cpp scales a 46-layer gemma2's scores (Gemma 2 27B's) by 1/sqrt(embedding_length / head_count), not
    1/sqrt(key_length): such a model exports with that scale and comes back with it; one scaled by its head width
    is refused."""
    import json

    import transformers
    from test_gguf_families import _small, _tokenizer

    vocab, eos = _tokenizer(tmp_path / "hf", None)
    kwargs = _small(num_hidden_layers=46, head_dim=8, query_pre_attn_scalar=16, sliding_window=8,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0)  # 32 wide / 2 heads = 16
    cfg = transformers.Gemma2Config(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, **kwargs)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    done = convert(tmp_path / "hf", tmp_path / "m.gguf", to="gguf", gguf_dtype="f32")
    model, _ = load_model(tmp_path / "m.gguf")
    assert model.config.attn_scale == pytest.approx(16 ** -0.5)
    ids = done.tokenizer.encode(PROBES[0])
    torch.testing.assert_close(_logits(model, ids), _logits(done.model, ids), rtol=0, atol=1e-5)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "query_pre_attn_scalar": 8}))
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "w.gguf"), "--to", "gguf"]) == 2
    assert "1/sqrt(embedding_length / head_count) = 0.25" in capsys.readouterr().err

def test_a_character_gpt2_round_trips_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """gptlab -> GGUF -> gptlab checkpoint -> GGUF again, and `sample` / `eval`-style loading straight from the file."""
    ckpt = _char_gpt2(tmp_path)
    assert main(["convert", str(ckpt), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", "f32"]) == 0
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "back")]) == 0  # GGUF -> gptlab by default
    assert main(["sample", str(tmp_path / "m.gguf"), "--prompt", "To be", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    original, tok = load_model(ckpt)
    for source in (tmp_path / "m.gguf", tmp_path / "back"):
        model, tok2 = load_model(source)
        ids = tok.encode(TEXT[:30])
        assert tok2.encode(TEXT[:30]) == ids
        torch.testing.assert_close(_logits(model, ids), _logits(original, ids), rtol=0, atol=1e-5)
    assert main(["convert", str(tmp_path / "back"), str(tmp_path / "again.gguf"), "--to", "gguf"]) == 0


def _blocks(w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[0], -1, 32)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "f16", "bf16"])
def test_quantized_and_half_files_dequantize_within_their_step(tmp_path: Path, dtype: str) -> None:
    """Each weight against the format's maths: q8_0 stores round(w / d) with d = max|block| / 127, so it comes back
    within d / 2 (plus d's own f16 rounding, up to 127 * 2**-11 * d); q4_0 stores 16 levels of d = max-magnitude / -8,
    within one step d; f16 and bf16 are torch's casts exactly. 1-D tensors (norms, biases) stay f32, as export
    writes them."""
    ckpt = _char_gpt2(tmp_path, n_embd=64)
    original, tok = load_model(ckpt)
    convert(ckpt, tmp_path / "m.gguf", to="gguf", gguf_dtype=dtype)
    model, _ = load_model(tmp_path / "m.gguf", dtype=torch.float32)
    ours = dict(original.state_dict())
    for name, back in model.state_dict().items():
        w = ours[name].float().numpy()
        got = back.float().numpy()
        if w.ndim == 1:
            assert np.array_equal(got, w), name
        elif dtype in ("f16", "bf16"):
            cast = torch.from_numpy(w).to(getattr(torch, {"f16": "float16", "bf16": "bfloat16"}[dtype])).float()
            assert np.array_equal(got, cast.numpy()), name
        else:
            blocks, error = _blocks(w), np.abs(_blocks(got) - _blocks(w))
            step = np.abs(blocks).max(axis=-1, keepdims=True) / (127 if dtype == "q8_0" else 8)
            # the scale itself is stored as f16 (relative error 2**-11), which moves the largest level (127) too
            bound = step * (0.5 + 127 / 2048) if dtype == "q8_0" else step * (1 + 8 / 2048)
            assert (error <= bound * 1.0001 + 1e-7).all(), name
    ids = tok.encode(TEXT[:30])
    drift = (_logits(model, ids) - _logits(original, ids)).abs().max().item()
    assert drift < {"q8_0": 0.05, "q4_0": 0.5, "f16": 0.01, "bf16": 0.05}[dtype], drift


# --- damaged files ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf_damage")
    convert(_char_gpt2(root), root / "good.gguf", to="gguf", gguf_dtype="f32")
    return root / "good.gguf"


def _at(data: bytearray, key: bytes) -> int:
    """The byte just after a metadata key's name (where its value type starts)."""
    i = data.find(key)
    assert i > 0, key
    return i + len(key)


def _tensor_info(data: bytearray, name: bytes) -> int:
    """The byte where a tensor's n_dims starts."""
    return _at(data, struct.pack("<Q", len(name)) + name)


def _set(data: bytearray, at: int, fmt: str, value: object) -> bytearray:
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return data


def _edits() -> dict[str, object]:
    def tensor_offset(d: bytearray, value: int) -> bytearray:
        at = _tensor_info(d, b"token_embd.weight")
        n_dims = struct.unpack_from("<I", d, at)[0]
        return _set(d, at + 4 + 8 * n_dims + 4, "<Q", value)

    return {
        "bad-magic": lambda d: _set(d, 0, "<4s", b"GGML"),
        "version-9": lambda d: _set(d, 4, "<I", 9),
        "tensor-count-huge": lambda d: _set(d, 8, "<Q", 2**62),
        "key-count-huge": lambda d: _set(d, 16, "<Q", 2**62),
        "key-length-huge": lambda d: _set(d, 24, "<Q", 2**60),
        "array-length-huge": lambda d: _set(d, _at(d, b"tokenizer.ggml.tokens") + 8, "<Q", 2**40),
        "value-type-unknown": lambda d: _set(d, _at(d, b"gpt2.block_count"), "<I", 99),
        "value-type-wrong": lambda d: _set(d, _at(d, b"gpt2.block_count"), "<I", 6),  # float32 where uint32
        "key-missing": lambda d: _set(d, _at(d, b"gpt2.block_count") - 5, "<5s", b"couNt"),
        "architecture-unknown": lambda d: d.replace(b"\x04\x00\x00\x00\x00\x00\x00\x00gpt2",
                                                     b"\x04\x00\x00\x00\x00\x00\x00\x00gpx2", 1),
        "tensor-past-end": lambda d: tensor_offset(d, 2**40),
        "tensor-offset-odd": lambda d: tensor_offset(d, 3),
        "tensor-dims-huge": lambda d: _set(d, _tensor_info(d, b"token_embd.weight"), "<I", 2**31),
        "tensor-shape-wrong": lambda d: _set(d, _tensor_info(d, b"blk.0.attn_qkv.weight") + 4, "<Q", 32),
        "tensor-type-int": lambda d: _set(d, _tensor_info(d, b"blk.0.ffn_up.weight") + 4 + 16, "<I", 26),  # I32
        "tensor-type-unknown": lambda d: _set(d, _tensor_info(d, b"blk.0.ffn_up.weight") + 4 + 16, "<I", 999),
        "tensor-missing": lambda d: d.replace(b"blk.1.ffn_down.weight", b"blk.1.ffn_dowX.weight", 1),
        "tokenizer-unknown": lambda d: _set(d, _at(d, b"tokenizer.ggml.model") + 12, "<4s", b"t5x5"),
        "chat-template-not-text": lambda d: _set(d, _at(d, b"tokenizer.chat_template"), "<I", 4),  # int32
    }


def _cuts(size: int) -> list[int]:
    return [0, 3, 4, 7, 12, 20, 24, 30, 100, 1000, size // 3, size // 2, size - 100, size - 1]


def _cases() -> list[str]:
    return [*_edits(), *(f"cut-at-{i}" for i in range(len(_cuts(10_000)))), "empty", "directory", "symlink-loop",
            "dangling-symlink"]


def _damage(good: Path, tmp_path: Path, how: str) -> Path:
    path = tmp_path / "bad.gguf"
    data = bytearray(good.read_bytes())
    if how in _edits():
        path.write_bytes(bytes(_edits()[how](data)))
    elif how.startswith("cut-at-"):
        path.write_bytes(bytes(data[:_cuts(len(data))[int(how.removeprefix("cut-at-"))]]))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "directory":
        path.mkdir()
    elif how == "symlink-loop":
        os.symlink(path, path)
    elif how == "dangling-symlink":
        os.symlink(tmp_path / "gone.gguf", path)
    return path


@pytest.mark.parametrize("how", _cases())
def test_a_damaged_gguf_file_is_one_line_naming_it(good_gguf: Path, tmp_path: Path, how: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPTLAB_DEBUG", "1")  # an internal error raises here instead of printing one line
    path = _damage(good_gguf, tmp_path, how)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["sample", str(path), "--max-new-tokens", "2"])
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert rc == 2, (how, lines)
    assert len(lines) == 1 and str(path) in lines[0], (how, lines)


@pytest.mark.parametrize("scaled_by", ["metadata", "rope_freqs", "rope_factors_long"])
def test_a_scaled_rope_gguf_file_is_refused_not_run_as_plain_rope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 scaled_by: str) -> None:
    """llama.cpp's converter writes a scaled RoPE as rope.scaling.* keys (linear, yarn) or as a tensor of frequency
    factors (Llama 3.1's rope_freqs, Phi-3 128k's rope_factors_*): neither may be dropped, leaving plain RoPE."""
    import gptlab.interop.gguf as export

    write_hparams, gguf_tensors = export.write_hparams, export.gguf_tensors

    def hparams(w: object, cfg: GPTConfig, arch: object) -> None:
        write_hparams(w, cfg, arch)
        if scaled_by == "metadata":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(4.0)

    def tensors(cfg: GPTConfig, arch: object, s: dict) -> dict:
        out = gguf_tensors(cfg, arch, s)
        if scaled_by != "metadata":
            out[f"{scaled_by}.weight"] = np.full(cfg.rotary_dim // 2, 8.0, dtype=np.float32)
        return out

    monkeypatch.setattr(export, "write_hparams", hparams)
    monkeypatch.setattr(export, "gguf_tensors", tensors)
    tok = CharTokenizer.from_text(TEXT)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32, norm="rmsnorm",
                          bias=False, position="rope", mlp="swiglu", tie_embeddings=False))
    export.save_gguf(model, tmp_path / "scaled.gguf", tok, dtype="f32")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["sample", str(tmp_path / "scaled.gguf"), "--max-new-tokens", "2"]) == 2
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and str(tmp_path / "scaled.gguf") in lines[0], lines
    assert ("rope.scaling.type=linear" if scaled_by == "metadata" else f"{scaled_by}.weight") in lines[0], lines


def test_training_starts_from_a_gguf_file_and_lora_asks_for_a_checkpoint(tmp_path: Path, good_gguf: Path) -> None:
    from gptlab.loading import base_reference

    data = tmp_path / "data"
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 40)
    assert main(["prepare", str(text), "--tokenizer-from", str(good_gguf), "--out", str(data)]) == 2  # a file
    assert main(["convert", str(good_gguf), str(tmp_path / "ckpt")]) == 0
    assert main(["prepare", str(text), "--tokenizer-from", str(tmp_path / "ckpt"), "--out", str(data)]) == 0
    recipe = tmp_path / "finetune.toml"
    recipe.write_text("max_steps = 1\nbatch_size = 2\nwarmup_steps = 0\neval_interval = 1\neval_tokens = 64\n"
                      "log_interval = 1\n")
    assert main(["train", str(recipe), "--init-from", str(good_gguf), "--data", str(data), "--out",
                 str(tmp_path / "run"), "--quiet"]) == 0
    with pytest.raises(Exception, match="is a GGUF file: a LoRA run records"):
        base_reference(good_gguf)
    # through the command line too: the frozen base is read before base_reference is asked (it looked for
    # good.gguf/config.json: "Not a directory")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["train", str(recipe), "--init-from", str(good_gguf), "--lora-rank", "2", "--data", str(data),
                   "--out", str(tmp_path / "lora"), "--quiet"])
    assert rc == 2 and err.getvalue().startswith(f"error: {good_gguf} is a GGUF file: a LoRA run records"), \
        err.getvalue()


class _Omitting:
    """A GGUF writer that leaves out the metadata the given `add_*` calls would write, and can add some."""

    def __init__(self, writer: object, omit: tuple[str, ...], extra: dict[str, object]) -> None:
        self._writer, self._omit, self._extra = writer, omit, extra

    def __getattr__(self, name: str) -> object:
        if name in self._omit:
            return lambda *args, **kwargs: None
        return getattr(self._writer, name)

    def add_extra(self) -> None:
        for name, value in self._extra.items():
            getattr(self._writer, name)(value)


def _gemma2_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, omit: tuple[str, ...] = (),
                 **extra: object) -> tuple[Path, object]:
    """A gemma2 GGUF of a random Gemma 2 (caps 50 and 30, a window as long as the context), written without the
    metadata `omit` names and with the `extra` add_* calls."""
    import transformers
    from test_gguf_families import _small, _tokenizer

    import gptlab.interop.gguf as export

    vocab, eos = _tokenizer(tmp_path / "hf", None)
    cfg = transformers.Gemma2Config(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, **_small(
        num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=64, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, initializer_range=1.0))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    write_hparams = export.write_hparams

    def hparams(w: object, config: GPTConfig, arch: object) -> None:
        writer = _Omitting(w, omit, extra)
        write_hparams(writer, config, arch)
        writer.add_extra()

    monkeypatch.setattr(export, "write_hparams", hparams)
    done = convert(tmp_path / "hf", tmp_path / "m.gguf", to="gguf", gguf_dtype="f32")
    return tmp_path / "m.gguf", done


def test_a_gemma2_file_without_caps_or_window_reads_them_as_llama_cpp_does(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's gemma2 soft-caps at 50 and 30 and slides at 4096 where the file names no cap or window (files
    from older converters): gptlab reads the same model, not an uncapped one."""
    path, done = _gemma2_gguf(tmp_path, monkeypatch, omit=("add_attn_logit_softcapping",
                                                           "add_final_logit_softcapping", "add_sliding_window"))
    fields = gguf.GGUFReader(path).fields
    assert not any(k.endswith(("softcapping", "sliding_window")) for k in fields), list(fields)
    model, tok = load_model(path)
    assert (model.config.attn_softcap, model.config.logit_softcap) == (50.0, 30.0)
    assert model.config.sliding_window in (4096, None)  # 4096 covers this model's 64 positions
    ids = tok.encode(TEXT)[:60]
    torch.testing.assert_close(_logits(model, ids), _logits(done.model, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pattern", [2, 3])
def test_only_gemma2s_own_sliding_window_pattern_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture, pattern: int) -> None:
    """llama.cpp reads gemma2.attention.sliding_window_pattern (2 where absent); another pattern is refused by name
    rather than run as Gemma 2's alternation."""
    path, _ = _gemma2_gguf(tmp_path, monkeypatch, add_sliding_window_pattern=pattern)
    capsys.readouterr()  # the export's progress
    code = main(["sample", str(path), "--max-new-tokens", "1", "--temperature", "0"])
    err = capsys.readouterr().err
    if pattern == 2:
        assert code == 0, err
    else:
        assert code == 2 and "gemma2.attention.sliding_window_pattern=3" in err and str(path) in err, err
        assert len(err.strip().splitlines()) == 1, err
