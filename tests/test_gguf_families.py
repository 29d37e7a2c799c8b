"""GGUF export of every family llama.cpp runs, from tiny random models saved by `transformers`: the architecture,
hyperparameters, pre-tokenizer and chat template the file holds, and (slow, with llama-cpp-python) llama.cpp's
greedy tokens against gptlab's for 32 tokens, its tokenizer's ids against gptlab's (digits and contractions
included, where Llama 3's and Qwen2's splits differ from GPT-2's), and its chat completion rendering the
embedded template as gptlab does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptlab import GPT, GPTConfig
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.tokenizer import CharTokenizer

gguf = pytest.importorskip("gguf")

TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer 1234 slings\n"
        "And arrows of outrageous fortune, 56789 or to take arms; we'll see what you've got.\n")
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the splits llama.cpp knows as llama-bpe (Llama 3: digits in threes) and qwen2 (each digit alone)
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLITS = {"llama-bpe": _WORDS + r"\p{N}{1,3}" + _TAIL, "qwen2": _WORDS + r"\p{N}" + _TAIL}


def _tokenizer(directory: Path, split: str | None) -> tuple[int, int]:
    """A byte-level BPE trained on TEXT with ChatML's tokens, split as GPT-2 (None) or by a named regex (llama-bpe's
    taking words the vocabulary holds whole, as Llama 3's does)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[split]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 5], trainer)
    tok.model.ignore_merges = split == "llama-bpe"  # as Llama 3's tokenizer.json (llama.cpp's llama-bpe does)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": CHATML}))
    return tok.get_vocab_size(), tok.token_to_id("<|endoftext|>")


def _small(**kw: object) -> dict:
    return {**dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=64, max_position_embeddings=64, initializer_range=0.3), **kw}


# family -> (transformers config class, its arguments, the tokenizer's split, llama.cpp's architecture); GPT-J
# runs as phi2 (llama.cpp names gptj but does not load it)
FAMILIES = {
    "llama": ("LlamaConfig", _small(), "llama-bpe", "llama"),
    "mistral": ("MistralConfig", _small(sliding_window=None), None, "llama"),
    "qwen2": ("Qwen2Config", _small(use_sliding_window=False), "qwen2", "qwen2"),
    "qwen3": ("Qwen3Config", _small(num_attention_heads=4, num_key_value_heads=2, head_dim=16), "qwen2", "qwen3"),
    "gemma2": ("Gemma2Config", _small(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0), None, "gemma2"),
    "phi3": ("Phi3Config", _small(partial_rotary_factor=0.5, sliding_window=None), None, "phi3"),
    "gptneox": ("GPTNeoXConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=64, rotary_pct=0.5, hidden_act="gelu_new",
                                      initializer_range=0.6), None, "gptneox"),
    "gptj": ("GPTJConfig", dict(n_embd=32, n_layer=2, n_head=2, rotary_dim=8, n_positions=64,
                                activation_function="gelu_new", initializer_range=0.3), None, "phi2"),
}


def hf_family_dir(directory: Path, family: str) -> Path:
    """A random `family` model saved by transformers, with its tokenizer and a ChatML chat template."""
    import transformers

    config_class, kwargs, split, _ = FAMILIES[family]
    vocab, eos = _tokenizer(directory, split)
    cfg = getattr(transformers, config_class)(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                                   **kwargs)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_writes_its_llama_cpp_architecture(tmp_path: Path, family: str) -> None:
    from gptlab.conversion import convert

    src = hf_family_dir(tmp_path / "hf", family)
    done = convert(src, tmp_path / "m.gguf", to="gguf", gguf_dtype="f32")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    arch, split = FAMILIES[family][3], FAMILIES[family][2]
    assert r.fields["general.architecture"].contents() == arch
    assert r.fields["tokenizer.ggml.pre"].contents() == (split or "gpt-2")
    assert r.fields["tokenizer.chat_template"].contents() == CHATML
    tok = done.tokenizer
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == tok.eot_id
    # ChatML's replies end with <|im_end|>: llama.cpp stops at the end-of-turn token
    assert r.fields["tokenizer.ggml.eot_token_id"].contents() == tok.encode("<|im_end|>", allow_special=True)[0]
    cfg = done.model.config
    assert r.fields[f"{arch}.block_count"].contents() == cfg.n_layer
    assert r.fields[f"{arch}.attention.head_count_kv"].contents() == cfg.n_kv_head
    names = {t.name for t in r.tensors}
    assert ("output.weight" in names) == (family != "gemma2")  # Gemma 2's head is its embedding in llama.cpp
    assert "blk.1.attn_output.weight" in names
    if family == "gemma2":
        assert r.fields["gemma2.attention.sliding_window"].contents() == 8
        assert r.fields["gemma2.final_logit_softcapping"].contents() == pytest.approx(30.0)
        assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= names
    if family == "qwen3":
        assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= names
        assert r.fields["qwen3.attention.key_length"].contents() == 16  # 4 heads of 16 in width 32
    if family in ("phi3", "gptneox"):
        assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names



def test_added_tokens_that_are_not_special_go_in_as_user_defined(tmp_path: Path) -> None:
    """A tokenizer.json's added token with special=false (Qwen2.5's <tool_call>) is matched whole in any text, by
    `tokenizers` and by llama.cpp for a user-defined token (type 4); written as a normal token, llama.cpp (and the
    file read back) would split it into pieces."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from gptlab.conversion import convert
    from gptlab.loading import load_model

    src = tmp_path / "hf"
    _tokenizer(src, "qwen2")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    tok.save(str(src / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    cfg = transformers.Qwen2Config(vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos,
                                   **FAMILIES["qwen2"][1])
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    done = convert(src, tmp_path / "m.gguf", to="gguf", gguf_dtype="f32")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    tokens, types = r.fields["tokenizer.ggml.tokens"].contents(), r.fields["tokenizer.ggml.token_type"].contents()
    assert types[tokens.index("<tool_call>")] == 4 and types[tokens.index("<|im_end|>")] == 3
    text = "call <tool_call> now"
    assert tok.token_to_id("<tool_call>") in done.tokenizer.encode(text)
    assert load_model(tmp_path / "m.gguf")[1].encode(text) == done.tokenizer.encode(text)

def _merge_test_dir(directory: Path, ignore_merges: bool) -> Path:
    """A Llama whose byte-level BPE under Llama 3's split holds "abc" whole, though merging "abc" gives a + bc
    (b c merges first, and nothing joins a and bc): ignore_merges decides which."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    for text in ["<|endoftext|>", "bc", "ab", "abc"]:
        vocab[text] = len(vocab)
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLITS["llama-bpe"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    eos = vocab["<|endoftext|>"]
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), bos_token_id=eos, eos_token_id=eos, **_small())
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


def test_llama_3s_split_keeps_the_tokenizers_ignore_merges(tmp_path: Path) -> None:
    """llama.cpp's llama-bpe takes a word its vocabulary holds whole (ignore_merges, as Llama 3's tokenizer.json
    says); a BPE under the same split that merges every word goes in as smaug-bpe, and each reads back so."""
    from tokenizers import Tokenizer

    from gptlab.conversion import convert
    from gptlab.loading import load_model

    for ignore, name, ids in [(True, "llama-bpe", ["abc"]), (False, "smaug-bpe", ["a", "bc"])]:
        src = _merge_test_dir(tmp_path / name, ignore)
        hf = Tokenizer.from_file(str(src / "tokenizer.json"))
        assert hf.encode("abc").tokens == ids
        convert(src, tmp_path / f"{name}.gguf", to="gguf", gguf_dtype="f32")
        assert gguf.GGUFReader(tmp_path / f"{name}.gguf").fields["tokenizer.ggml.pre"].contents() == name
        back = load_model(tmp_path / f"{name}.gguf")[1]
        assert back.encode("abc xabc") == hf.encode("abc xabc").ids, name


@pytest.mark.slow
def test_llama_cpp_splits_words_as_the_tokenizers_ignore_merges_says(tmp_path: Path) -> None:
    from helpers import open_llama_cpp
    from tokenizers import Tokenizer

    from gptlab.conversion import convert

    for ignore, name in [(True, "llama-bpe"), (False, "smaug-bpe")]:
        src = _merge_test_dir(tmp_path / name, ignore)
        convert(src, tmp_path / f"{name}.gguf", to="gguf", gguf_dtype="f32")
        llm = open_llama_cpp(tmp_path / f"{name}.gguf", vocab_only=True)
        ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode("abc xabc").ids
        assert llm.tokenize(b"abc xabc", add_bos=False, special=False) == ids, name


def test_a_tokenizer_that_adds_a_prefix_space_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """ByteLevel's add_prefix_space makes "hello" "Ġhello" in `tokenizers`; llama.cpp's BPE has no such step and
    would split every text's first word differently, so the export is refused in one line."""
    from tokenizers import Tokenizer, pre_tokenizers

    src = hf_family_dir(tmp_path / "hf", "mistral")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.save(str(src / "tokenizer.json"))
    assert main(["convert", str(src), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "puts a space before the text (add_prefix_space)" in err and "Traceback" not in err, err
    assert not (tmp_path / "m.gguf").exists()


def test_models_llama_cpp_cannot_run_are_refused_in_gguf_terms(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """The CPU speedrun's model (LayerNorm, RoPE, q/k norms, capped logits) has no llama.cpp architecture: the
    error names the nearest one and what it lacks, in GGUF's keys and tensors."""
    tok = CharTokenizer.from_text(TEXT)
    model = GPT(GPTConfig.preset("speedrun-char", vocab_size=tok.vocab_size))
    save_model(tmp_path / "run", model, tok)
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "m.gguf"), "--to", "gguf"]) != 0
    err = capsys.readouterr().err
    assert "llama.cpp has no architecture for this model: the nearest, gptneox" in err, err
    assert "final_logit_softcapping (logit_softcap=15.0)" in err and "attn_q_norm" in err
    assert "Traceback" not in err and not (tmp_path / "m.gguf").exists()
    # a window llama.cpp's llama would ignore is refused, not silently widened
    windowed = GPT(GPTConfig.preset("tiny", sliding_window=8, vocab_size=tok.vocab_size, hf_architecture=None))
    save_model(tmp_path / "windowed", windowed, tok)
    assert main(["convert", str(tmp_path / "windowed"), str(tmp_path / "w.gguf"), "--to", "gguf"]) != 0
    assert "reads no attention.sliding_window" in capsys.readouterr().err



def test_a_gemma2_without_soft_caps_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """llama.cpp's gemma2 soft-caps scores and logits whatever the file says, at 50 and 30 where it names no cap:
    a Gemma 2 without them would run there as a different model."""
    src = hf_family_dir(tmp_path / "hf", "gemma2")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": None}))
    assert main(["convert", str(src), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "llama.cpp's gemma2 always soft-caps" in err and "logit_softcap=None" in err, err
    assert "attn_softcap" not in err and not (tmp_path / "m.gguf").exists()


def test_gemma2s_sliding_layers_are_llama_cpps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """llama.cpp's gemma2 slides its even layers, at 4096 where the file names no window: a Gemma 2 without a
    window gets its whole context as the window, and one whose every layer slides is refused."""
    src = hf_family_dir(tmp_path / "hf", "gemma2")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "sliding_window": None, "layer_types": None,
                                                 "max_position_embeddings": 8192}))
    assert main(["convert", str(src), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", "f32"]) == 0
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["gemma2.attention.sliding_window"].contents() == 8192
    (src / "config.json").write_text(json.dumps({**config, "layer_types": ["sliding_attention"] * 4}))
    assert main(["convert", str(src), str(tmp_path / "s.gguf"), "--to", "gguf"]) == 2
    assert "slides even layers only" in capsys.readouterr().err and not (tmp_path / "s.gguf").exists()


def test_a_gemma2_with_biases_is_refused(tmp_path: Path) -> None:
    """llama.cpp's gemma2 reads no bias tensor (its graph has plain matmuls): a Gemma 2 with attention_bias would
    not load there."""
    from gptlab.errors import GptlabError
    from gptlab.interop.gguf_arch import gguf_architecture
    from gptlab.interop.hf import config_from_hf

    config = json.loads((hf_family_dir(tmp_path / "hf", "gemma2") / "config.json").read_text())
    gguf_architecture(config_from_hf(config))  # as transformers made it: no biases
    with pytest.raises(GptlabError, match="llama.cpp.s gemma2 reads no bias tensors: qkv_bias=True"):
        gguf_architecture(config_from_hf({**config, "attention_bias": True}))


def test_phi3s_window_is_written_as_llama_cpps_converter_writes_it(tmp_path: Path) -> None:
    """Phi-3-mini-4k's window (2,047 of 4,096) goes in the file as llama.cpp's converter writes it (llama.cpp's phi3
    then attends to the whole context: the same logits up to the window); the export is not refused."""
    src = hf_family_dir(tmp_path / "hf", "phi3")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "sliding_window": 15, "max_position_embeddings": 64}))
    assert main(["convert", str(src), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", "f32"]) == 0
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["phi3.attention.sliding_window"].contents() == 15

@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_greedy_tokens_and_chat_equal_gptlabs(tmp_path: Path, family: str) -> None:
    from helpers import llama_cpp_greedy, open_llama_cpp

    import gptlab
    from gptlab.conversion import convert
    from gptlab.tokenizer.chat_template import chat_template_for

    src = hf_family_dir(tmp_path / "hf", family)
    done = convert(src, tmp_path / "m.gguf", to="gguf", gguf_dtype="f32")
    model, tok = done.model, done.tokenizer
    # swa_full: the whole context cached for sliding-window layers too (generate() resets and re-reads the prompt)
    llm = open_llama_cpp(tmp_path / "m.gguf", swa_full=True)
    for text in ["Whether 'tis nobler in the mind", "we'll see 1234567 or 56789, you've got"]:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text), (family, text)
    prompt = tok.encode("To be, or")
    ours = gptlab.generate(model, torch.tensor([prompt]), max_new_tokens=32, temperature=0.0)[0, len(prompt):]
    assert llama_cpp_greedy(llm, prompt, 32) == ours.tolist(), family
    if family == "gemma2":  # llama-cpp-python 0.3.36's chat completion finds no KV slot in gemma2's sliding-window
        return  # cache (llama_decode returns 1, swa_full or not); the tokens above are llama.cpp's own decode
    # llama.cpp's chat completion renders the embedded template: its reply is gptlab's greedy reply to that text
    messages = [{"role": "user", "content": "Whether 'tis nobler"}]
    llm = open_llama_cpp(tmp_path / "m.gguf", swa_full=True)
    reply = llm.create_chat_completion(messages, temperature=0.0, top_k=1, max_tokens=6)
    rendered = chat_template_for(tok).render(messages, add_generation_prompt=True)
    ids = tok.encode(rendered, allow_special=True)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    n = reply["usage"]["completion_tokens"]  # llama-cpp-python may count one past max_tokens: compare as many
    expected = gptlab.generate(model, torch.tensor([ids]), max_new_tokens=n, temperature=0.0)[0, len(ids):].tolist()
    stop = expected.index(tok.eot_id) if tok.eot_id in expected else len(expected)
    # (llama-cpp-python drops the bytes of a character cut off at max_tokens)
    assert reply["choices"][0]["message"]["content"] == tok.decode_bytes(expected[:stop]).decode(errors="ignore")


def test_ollama_directory_holds_the_gguf_and_a_modelfile(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A ChatML template is written as ollama's Go template of the same text, with its stop and gptlab's
    temperature; a character model gets the built-in "plain" template, whose stop holds a newline."""
    from gptlab.interop.ollama import GO_TEMPLATES

    src = hf_family_dir(tmp_path / "hf", "qwen2")
    assert main(["convert", str(src), str(tmp_path / "ollama"), "--to", "ollama", "--dtype", "q8_0"]) == 0
    assert "ollama create NAME -f" in capsys.readouterr().out
    text = (tmp_path / "ollama" / "Modelfile").read_text()
    assert text.splitlines()[0] == "FROM ./model.gguf"
    assert f'TEMPLATE """{GO_TEMPLATES["chatml"]}"""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text and "PARAMETER temperature 1" in text
    r = gguf.GGUFReader(tmp_path / "ollama" / "model.gguf")
    assert r.fields["general.architecture"].contents() == "qwen2"
    tok = CharTokenizer.from_text(TEXT)
    save_model(tmp_path / "char", GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size)), tok)
    assert main(["convert", str(tmp_path / "char"), str(tmp_path / "o2"), "--to", "ollama"]) == 0
    text = (tmp_path / "o2" / "Modelfile").read_text()
    assert 'PARAMETER stop """\nUser:"""' in text and f'TEMPLATE """{GO_TEMPLATES["plain"]}"""' in text


def test_ollama_go_templates_render_what_the_jinja_ones_do() -> None:
    """The Go templates, expanded by hand for one conversation (range over messages, then the generation
    prompt), give the Jinja template's text with the generation prompt."""
    from gptlab.interop.ollama import GO_TEMPLATES
    from gptlab.tokenizer.chat_template import BUILTIN_TEMPLATES, ChatTemplate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    go = {"plain": "".join(f"{names[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:",
          "chatml": "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
          + "<|im_start|>assistant\n"}
    for name, expected in go.items():
        assert ChatTemplate(BUILTIN_TEMPLATES[name]).render(messages, add_generation_prompt=True) == expected
        assert GO_TEMPLATES[name].startswith("{{- range .Messages }}")
