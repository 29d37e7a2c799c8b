"""GGUF export: written with the `gguf` package, read back with its reader (tensors, metadata and tokenizer equal
what gptlab holds), GPT-2's merges against OpenAI's own vocab.bpe, and (slow, with llama-cpp-python) llama.cpp's
greedy tokens against gptlab's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import gpt2_bpe_files, needs_tiktoken_gpt2

from gptlab import GPT, GPTConfig
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.tokenizer import CharTokenizer

gguf = pytest.importorskip("gguf")

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"


def _tensor(reader, name: str) -> np.ndarray:  # noqa: ANN001
    t = next(t for t in reader.tensors if t.name == name)
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(list(reversed(t.shape.tolist())))


def _char_gpt2(tmp_path: Path) -> tuple[GPT, CharTokenizer, Path]:
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=tok.vocab_size,
                                 block_size=32)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    save_model(tmp_path / "ckpt", model, tok)
    return model, tok, tmp_path / "ckpt"


def test_gpt2_round_trip_through_the_gguf_reader(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, tok, ckpt = _char_gpt2(tmp_path)
    assert main(["convert", str(ckpt), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", "f32"]) == 0
    assert "wrote GGUF" in capsys.readouterr().out
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["general.architecture"].contents() == "gpt2"
    cfg = model.config
    for key, value in [("gpt2.block_count", 2), ("gpt2.embedding_length", 64), ("gpt2.context_length", 32),
                       ("gpt2.attention.head_count", 4), ("gpt2.feed_forward_length", 256)]:
        assert r.fields[key].contents() == value, key
    assert r.fields["gpt2.attention.layer_norm_epsilon"].contents() == pytest.approx(cfg.norm_eps)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert np.array_equal(_tensor(r, "token_embd.weight"), state["transformer.wte.weight"])
    assert np.array_equal(_tensor(r, "output.weight"), state["transformer.wte.weight"])  # tied: written anyway
    assert np.array_equal(_tensor(r, "blk.1.attn_qkv.weight"), state["transformer.h.1.attn.c_attn.weight"])
    assert np.array_equal(_tensor(r, "blk.0.ffn_down.bias"), state["transformer.h.0.mlp.c_proj.bias"])
    assert np.array_equal(_tensor(r, "position_embd.weight"), state["transformer.wpe.weight"])
    assert len(r.tensors) == 2 * 12 + 5
    # the characters, spelled as byte-level BPE tokens (space is "Ġ", newline "Ċ")
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert tokens == [{" ": "Ġ", "\n": "Ċ"}.get(c, c) for c in tok.chars]


def test_llama_q8_0_and_rope_rows(tmp_path: Path) -> None:
    """Llama's q and k rows are interleaved per head for llama.cpp's RoPE; q8_0 keeps each row within half a
    quantization step; the Hugging Face BPE tokenizer's vocabulary, merges and special tokens come along."""
    from helpers import hf_llama_dir

    from gptlab.conversion import convert
    from gptlab.interop.gguf import interleave_rope_rows
    from gptlab.loading import load_model

    src = hf_llama_dir(tmp_path / "hf", TEXT * 20, vocab_size=300)
    model, tok = load_model(src)
    convert(src, tmp_path / "m.gguf", to="gguf", gguf_dtype="q8_0")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.attention.head_count_kv"].contents() == 1
    assert r.fields["llama.rope.dimension_count"].contents() == 16
    w = model.state_dict()["transformer.h.0.attn.c_attn.weight"].numpy()
    expected = interleave_rope_rows(w[:32], 2, 16)
    scale = np.abs(expected).max(axis=1, keepdims=True) / 127  # one q8_0 block per row of 32
    # half a step, plus the f16 rounding of the block scale times the largest code (127 * 2^-11 steps)
    assert np.all(np.abs(_tensor(r, "blk.0.attn_q.weight") - expected) <= scale * 0.57)
    # the permutation moves row d/2 + i of each head next to row i
    rows = interleave_rope_rows(np.arange(32)[:, None], 2, 16)[:, 0]
    assert rows[:4].tolist() == [0, 8, 1, 9] and rows[16:18].tolist() == [16, 24]
    assert _tensor(r, "blk.0.attn_norm.weight").dtype == np.float32
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[tok.eot_id] == "<|endoftext|>"
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == tok.eot_id
    assert r.fields["tokenizer.ggml.token_type"].contents()[tok.bos_id] == 3  # control
    assert len(r.fields["tokenizer.ggml.merges"].contents()) > 0


def test_q4_0_keeps_every_weight_within_one_step_of_its_block(tmp_path: Path) -> None:
    """q4_0: blocks of 32 values of a row, scale d = (the value of largest magnitude) / -8, codes 0..15 for
    x / d + 8; so every value is within one step |d| of the original (half a step, except the clipped top code)."""
    from gptlab.conversion import convert

    model, _, ckpt = _char_gpt2(tmp_path)
    convert(ckpt, tmp_path / "m.gguf", to="gguf", gguf_dtype="q4_0")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
    w = model.state_dict()["transformer.h.0.mlp.c_fc.weight"].numpy()  # (out, in): GGUF stores rows as they are
    blocks = w.reshape(w.shape[0], -1, 32)
    step = np.abs(blocks).max(axis=2, keepdims=True) / 8
    got = _tensor(r, "blk.0.ffn_up.weight").reshape(blocks.shape)
    assert np.all(np.abs(got - blocks) <= step * 1.01)  # 1% for the scale's f16 rounding
    assert np.abs(got - blocks).max() > 0  # it did quantize


@needs_tiktoken_gpt2
def test_gpt2_merges_recovered_from_tiktoken_equal_openais_vocab_bpe() -> None:
    from gptlab.interop.gguf import gguf_vocabulary
    from gptlab.tokenizer import GPT2Tokenizer

    tokens, merges, types = gguf_vocabulary(GPT2Tokenizer(), 50257)
    reference = gpt2_bpe_files()[1].read_text(encoding="utf-8").splitlines()[1:]
    assert merges == [line for line in reference if line]
    assert tokens[50256] == "<|endoftext|>" and types[50256] == 3 and tokens[220] == "Ġ"


def test_a_tokenizer_without_end_of_text_names_a_spare_row_as_llama_cpps_end(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """llama.cpp takes token 11 as BOS and EOS where a BPE file names none, and ends generation there: for a
    character vocabulary (no end-of-text) a real character. A padded vocabulary's first spare row is named
    instead (and read back as no end-of-text); without one, the export says which character llama.cpp stops at."""
    from gptlab.loading import load_model

    tok = CharTokenizer.from_text(TEXT)
    for name, vocab_size in [("padded", tok.vocab_size + 3), ("exact", tok.vocab_size)]:
        model = GPT(GPTConfig.preset("tiny", n_layer=1, vocab_size=vocab_size, hf_architecture=None))
        save_model(tmp_path / name, model, tok)
        assert main(["convert", str(tmp_path / name), str(tmp_path / f"{name}.gguf"), "--to", "gguf"]) == 0
        fields = gguf.GGUFReader(tmp_path / f"{name}.gguf").fields
        err = capsys.readouterr().err
        if name == "padded":
            assert fields["tokenizer.ggml.eos_token_id"].contents() == tok.vocab_size
            assert fields["tokenizer.ggml.bos_token_id"].contents() == tok.vocab_size
            assert "note:" not in err
            back = load_model(tmp_path / f"{name}.gguf")[1]
            assert back.eot_id is None and back.bos_id is None and not back.adds_bos
        else:
            assert "tokenizer.ggml.eos_token_id" not in fields
            assert f"llama.cpp ends generation at its default, token 11 ({tok.decode([11])!r})" in err, err
    # a beginning-of-text token of its own stays the file's BOS
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from gptlab.interop.gguf import save_gguf
    from gptlab.tokenizer.huggingface import HFTokenizer

    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.add_special_tokens(["<s>"])
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    model = GPT(GPTConfig.preset("tiny", n_layer=1, vocab_size=260, hf_architecture=None))
    save_gguf(model, tmp_path / "bos.gguf", HFTokenizer(bpe, bos_id=256), dtype="f32")
    fields = gguf.GGUFReader(tmp_path / "bos.gguf").fields
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 256
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 257


@pytest.mark.slow
def test_llama_cpp_ends_a_character_models_text_at_no_character(tmp_path: Path) -> None:
    """The padded character model's file as llama.cpp reads it: no character ends generation, the spare row does."""
    from helpers import open_llama_cpp

    tok = CharTokenizer.from_text(TEXT)
    model = GPT(GPTConfig.preset("tiny", n_layer=1, vocab_size=tok.vocab_size + 3, hf_architecture=None))
    save_model(tmp_path / "ckpt", model, tok)
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 0
    llm = open_llama_cpp(tmp_path / "m.gguf")
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    assert [i for i in range(tok.vocab_size + 3) if llama_cpp.llama_vocab_is_eog(vocab, i)] == [tok.vocab_size]
    assert llm.tokenize(b"To be", add_bos=True) == tok.encode("To be")  # nor is a BOS added


def test_gguf_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, _, ckpt = _char_gpt2(tmp_path)
    (tmp_path / "dir").mkdir()
    (tmp_path / "notes.txt").write_text("keep me")
    cases = [
        (["convert", str(ckpt), str(tmp_path / "dir"), "--to", "gguf"], "is a directory"),
        (["convert", str(ckpt), str(tmp_path / "notes.txt"), "--to", "gguf"], "not a .gguf file"),
        (["convert", str(ckpt), str(tmp_path / "out"), "--dtype", "q8_0"], "--to gguf"),
    ]
    for argv, message in cases:
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    from gptlab.interop.gguf import gguf_vocabulary

    with pytest.raises(GptlabError, match="single-byte"):
        gguf_vocabulary(CharTokenizer.from_text("naïve"), 10)
    # a BPE that splits text otherwise than GPT-2 would tokenize differently in llama.cpp: refused
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from gptlab.tokenizer import HFTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=60, show_progress=False))
    with pytest.raises(GptlabError, match="this one's is 'Whitespace' llama.cpp does not know"):
        gguf_vocabulary(HFTokenizer(bpe, kind="bpe"), 60)


@pytest.mark.slow
def test_llama_cpp_runs_the_file_with_gptlabs_greedy_tokens(tmp_path: Path) -> None:
    from helpers import hf_llama_dir, llama_cpp_greedy, open_llama_cpp

    import gptlab
    from gptlab.conversion import convert
    from gptlab.loading import load_model

    _, _, gpt2_ckpt = _char_gpt2(tmp_path)
    for name, src in [("llama", hf_llama_dir(tmp_path / "hf", TEXT * 20, vocab_size=300)), ("gpt2", gpt2_ckpt)]:
        model, tok = load_model(src)
        convert(src, tmp_path / f"{name}.gguf", to="gguf", gguf_dtype="f32")
        llm = open_llama_cpp(tmp_path / f"{name}.gguf")
        prompt = tok.encode("To be, or")
        # the tokenizer came along: llama.cpp splits text into the same ids
        text = "Whether 'tis nobler in the mind"
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text), name
        ours = gptlab.generate(model, torch.tensor([prompt]), max_new_tokens=12, temperature=0.0)[0, len(prompt):]
        theirs = llama_cpp_greedy(llm, prompt, 12)
        assert theirs == ours.tolist(), name
