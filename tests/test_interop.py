"""Hugging Face interop: tiny random transformers models -> gptlab -> transformers, logits compared both ways.

Every weight is perturbed off its init first (norm weights off 1, biases off 0), so a missed, transposed or
mis-ordered tensor shows up in the logits.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import gptlab
from gptlab import GPT, GPTConfig
from gptlab.checkpoint import load_gptlab_model, save_model
from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.interop import config_from_hf, config_to_hf, from_hf, save_hf
from gptlab.loading import load_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TOL = 1e-4
VOCAB = 160


# --- building small transformers models ---------------------------------------------------------------------
LLAMA_SHAPED = {name: (getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM"))
                for name, prefix in [("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"),
                                     ("mistral", "Mistral"), ("gemma2", "Gemma2"), ("phi3", "Phi3")]}


def _hf_model(arch: str, **kw) -> torch.nn.Module:
    common = dict(vocab_size=kw.pop("vocab_size", VOCAB), hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=kw.pop("max_position_embeddings", 64))
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=None, eos_token_id=None, **kw)
        cls = transformers.GPT2LMHeadModel
    elif arch == "gptj":
        kw.setdefault("rotary_dim", 8)
        cfg = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=None, eos_token_id=None, **kw)
        cls = transformers.GPTJForCausalLM
    elif arch in LLAMA_SHAPED:
        config_class, cls = LLAMA_SHAPED[arch]
        kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 5000.0})
        kw.setdefault("num_key_value_heads", 4)
        cfg = config_class(**common, intermediate_size=96, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                           **kw)
    else:
        cfg = transformers.GPTNeoXConfig(**common, intermediate_size=128, rotary_emb_base=5000.0, **kw)
        cls = transformers.GPTNeoXForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # off the init: norm weights away from 1, biases away from 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _save(model: torch.nn.Module, directory: Path, layout: str) -> Path:
    """Write `model` as transformers would: one safetensors file, safetensors shards, or (as 4.x did with
    safe_serialization=False, which 5.x no longer writes) one or two pytorch_model*.bin files."""
    if layout == "safetensors":
        model.save_pretrained(directory)
    elif layout == "sharded":
        model.save_pretrained(directory, max_shard_size="40KB")
        assert (directory / "model.safetensors.index.json").is_file()
    else:
        model.config.save_pretrained(directory)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        if layout == "bin":
            torch.save(state, directory / "pytorch_model.bin")
        else:  # bin-sharded
            names = sorted(state)
            halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
                      "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
            for file, keys in halves.items():
                torch.save({k: state[k] for k in keys}, directory / file)
            weight_map = {k: f for f, keys in halves.items() for k in keys}
            (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _max_diff(ours: GPT, theirs: torch.nn.Module) -> float:
    ids = _ids()
    return (ours(ids)[0] - theirs(ids).logits).abs().max().item()


CASES = {
    "gpt2": ("gpt2", {}, "safetensors"),
    "gpt2-exact-gelu-untied-bin": ("gpt2", dict(activation_function="gelu", tie_word_embeddings=False),
                                   "bin"),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True), "safetensors"),
    "llama-gqa-untied-sharded": ("llama", dict(num_key_value_heads=2), "sharded"),
    "llama-mqa-tied-bin-sharded": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True),
                                   "bin-sharded"),
    "llama-mqa-untied-bias": ("llama", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
                              "safetensors"),
    "neox-parallel-rot0.25": ("neox", dict(use_parallel_residual=True, rotary_pct=0.25), "safetensors"),
    "neox-sequential-rot1.0-sharded": ("neox", dict(use_parallel_residual=False, rotary_pct=1.0), "sharded"),
    "neox-parallel-rot1.0-tanh-tied": ("neox", dict(rotary_pct=1.0, hidden_act="gelu_new",
                                                    tie_word_embeddings=True), "safetensors"),
    "neox-dynamic": ("neox", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 2.0,
                                                   "partial_rotary_factor": 0.5}, max_position_embeddings=16),
                     "safetensors"),
    # RoPE scalings on Llama; the inputs run past the pretraining context
    "llama-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.5}),
                     "safetensors"),
    "llama-dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 2.0},
                                    max_position_embeddings=16), "safetensors"),
    # transformers' dynamic NTK starts at max_position_embeddings and ignores an original_max_position_embeddings
    "llama-dynamic-original-key": ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5000.0,
                                                                  "factor": 2.0, "original_max_position_embeddings": 8},
                                                 max_position_embeddings=16), "safetensors"),
    "llama-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 16}), "safetensors"),
    "llama-yarn-mscale": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 16, "mscale": 0.8,
                                                         "mscale_all_dim": 0.5, "beta_fast": 16.0}), "safetensors"),
    "llama3-scaling": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 16}), "safetensors"),
    "llama-head_dim": ("llama", dict(head_dim=24, num_key_value_heads=2), "safetensors"),
    "qwen2-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True), "safetensors"),
    "qwen2-untied-window": ("qwen2", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=7,
                                          max_window_layers=0), "sharded"),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32), "safetensors"),
    "qwen3-bias-tied": ("qwen3", dict(head_dim=8, attention_bias=True, tie_word_embeddings=True), "safetensors"),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=7), "safetensors"),
    "mistral-no-window": ("mistral", dict(num_key_value_heads=2, sliding_window=None, head_dim=8), "bin"),
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=24, sliding_window=7, query_pre_attn_scalar=20,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0), "safetensors"),
    "gemma2-untied-no-caps": ("gemma2", dict(head_dim=16, sliding_window=7, attn_logit_softcapping=None,
                                             final_logit_softcapping=None, tie_word_embeddings=False,
                                             hidden_activation="gelu"), "safetensors"),
    "phi3": ("phi3", dict(num_key_value_heads=2), "safetensors"),
    "phi3-partial-window": ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                          "partial_rotary_factor": 0.5}, sliding_window=7), "sharded"),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=16,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0,
                                                    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.2, 2.5, 3.0],
                                                    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 9.0, 10.0],
                                                    "original_max_position_embeddings": 16}), "safetensors"),
    "gptj": ("gptj", {}, "safetensors"),
    "gptj-full-rotary-exact-gelu-sharded": ("gptj", dict(rotary_dim=16, activation_function="gelu"), "sharded"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(case: str, tmp_path: Path) -> None:
    arch, kw, layout = CASES[case]
    hf = _hf_model(arch, **kw)
    src = _save(hf, tmp_path / "hf", layout)

    ours = from_hf(src)
    assert ours.num_parameters() == hf.num_parameters()
    assert ours.config.tie_embeddings == hf.config.tie_word_embeddings
    assert _max_diff(ours, hf) <= TOL

    save_hf(ours, tmp_path / "out")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back) is type(hf)
    assert back.num_parameters() == ours.num_parameters()
    assert _max_diff(ours, back.eval()) <= TOL


def test_export_then_import_gptlab_presets(tmp_path: Path) -> None:
    """Models born in gptlab (not from transformers) export and come back with the same config."""
    for preset in ("tiny", "pythia-70m", "gpt2"):
        cfg = GPTConfig.preset(preset, n_layer=1, n_embd=64, n_head=4, mlp_hidden=96, vocab_size=VOCAB,
                               block_size=32, dropout=0.0, n_kv_head=None if preset != "tiny" else 2)
        torch.manual_seed(0)
        model = GPT(cfg).eval()
        save_hf(model, tmp_path / preset)
        back = from_hf(tmp_path / preset)
        assert back.config == cfg
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / preset).eval()
        assert _max_diff(model, hf) <= TOL


@pytest.mark.parametrize("preset, architecture", [
    ("qwen2.5-0.5b", "Qwen2ForCausalLM"), ("qwen3-0.6b", "Qwen3ForCausalLM"), ("mistral-7b", "MistralForCausalLM"),
    ("gemma-2-2b", "Gemma2ForCausalLM"), ("phi-3-mini", "Phi3ForCausalLM"), ("gpt-j-6b", "GPTJForCausalLM"),
])
def test_family_presets_count_what_transformers_counts(preset: str, architecture: str) -> None:
    """The preset's config, written as config.json and built by transformers on the meta device (no download, no
    memory), has as many parameters as `gptlab info` reports."""
    from gptlab.flops import parameter_breakdown

    cfg = GPTConfig.preset(preset)
    hf_config = config_to_hf(cfg)
    assert hf_config["architectures"] == [architecture]
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.num_parameters() == parameter_breakdown(cfg)["total"]
    assert config_from_hf(hf_config).replace(name=cfg.name) == cfg


def test_gpt2_in_the_original_openai_layout(tmp_path: Path) -> None:
    """openai-community/gpt2's files: no `transformer.` prefix (saved from GPT2Model), causal-mask buffers."""
    hf = _hf_model("gpt2")
    hf.config.save_pretrained(tmp_path)
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(hf.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert _max_diff(from_hf(tmp_path), hf) <= TOL


def test_import_needs_no_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _save(_hf_model("neox"), tmp_path / "hf", "safetensors")
    monkeypatch.setitem(sys.modules, "transformers", None)  # any `import transformers` now fails
    model = gptlab.from_hf(src, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    gptlab.save_hf(model, tmp_path / "out")
    assert from_hf(tmp_path / "out").config == model.config


def test_a_device_or_dtype_that_cannot_be_is_named_before_the_weights_are_read(tmp_path: Path) -> None:
    gptlab.save_hf(GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16)), tmp_path)
    cases = [({"device": "foo"}, "device 'foo' is not a device"),
             ({"dtype": "int8"}, "dtype must be a floating-point torch.dtype"),  # weights cast to integers
             ({"dtype": torch.int64}, "dtype must be a floating-point torch.dtype"),
             ({"dtype": "float99"}, "dtype must be a floating-point torch.dtype")]
    if not torch.cuda.is_available():  # was an AssertionError from torch's CUDA
        cases.append(({"device": "cuda"}, "CUDA is not available here"))
    for kwargs, message in cases:
        with pytest.raises(GptlabError, match=message):
            from_hf(tmp_path, **kwargs)
    assert from_hf(tmp_path, dtype=torch.float16).lm_head.weight.dtype == torch.float16


# --- config schemas -----------------------------------------------------------------------------------------
_LLAMA_BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300, hidden_size=64,
                   intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True)
_NEOX_BASE = dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", vocab_size=300, hidden_size=64,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, hidden_act="gelu_fast", use_parallel_residual=True)


def test_config_schemas_4x_and_5x_agree() -> None:
    llama_4x = dict(_LLAMA_BASE, rope_theta=50000.0, rope_scaling=None)
    llama_5x = dict(_LLAMA_BASE, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    assert config_from_hf(llama_4x) == config_from_hf(llama_5x)
    assert config_from_hf(llama_5x).rope_base == 50000.0

    neox_4x = dict(_NEOX_BASE, rotary_pct=0.5, rotary_emb_base=20000)
    neox_5x = dict(_NEOX_BASE, rope_parameters={"rope_type": "default", "rope_theta": 20000.0,
                                                "partial_rotary_factor": 0.5})
    cfg = config_from_hf(neox_4x)
    assert cfg == config_from_hf(neox_5x)
    assert (cfg.rotary_fraction, cfg.rope_base, cfg.gelu_approximate, cfg.block) == (0.5, 20000.0, "tanh",
                                                                                     "parallel")
    assert config_from_hf(_NEOX_BASE).rotary_fraction == 0.25  # NeoX's default rotary_pct


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM"])
def test_keys_a_config_leaves_out_take_transformers_defaults(architecture: str) -> None:
    """A hand-written config.json may leave out keys whose transformers default changes the logits (Gemma 2's
    soft-caps and score scale, Mistral's and Gemma 2's window, Phi-3's norm epsilon); a null stays a null."""
    model_type = {"MistralForCausalLM": "mistral", "Gemma2ForCausalLM": "gemma2", "Phi3ForCausalLM": "phi3"}
    base = dict(architectures=[architecture], model_type=model_type[architecture], vocab_size=VOCAB, hidden_size=64,
                intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    for hf in (base, {**base, "sliding_window": None, "attn_logit_softcapping": None,
                      "final_logit_softcapping": None}):
        theirs = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
        ours = config_from_hf(hf)
        assert ours.norm_eps == theirs.rms_norm_eps
        assert ours.sliding_window == theirs.sliding_window
        layer_types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * 4
        assert [ours.sliding_layer(i) for i in range(4)] == [
            theirs.sliding_window is not None and t == "sliding_attention" for t in layer_types]
        assert ours.attn_softcap == getattr(theirs, "attn_logit_softcapping", None)
        assert ours.logit_softcap == getattr(theirs, "final_logit_softcapping", None)
        scalar = getattr(theirs, "query_pre_attn_scalar", None)
        assert ours.attn_scale == (None if scalar is None else pytest.approx(scalar ** -0.5))


def test_gptj_without_rotary_dim_rotates_what_transformers_rotates(tmp_path: Path) -> None:
    """GPTJConfig's rotary_dim defaults to 64: a config.json without the key rotates 64 dims of each head."""
    torch.manual_seed(0)  # heads of 128 dims, 64 of them rotating
    hf = transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=256, n_layer=1, n_head=2, n_positions=64, rotary_dim=64, bos_token_id=None,
        eos_token_id=None)).eval()
    src = _save(hf, tmp_path / "hf", "safetensors")
    config = json.loads((src / "config.json").read_text())
    del config["rotary_dim"]
    (src / "config.json").write_text(json.dumps(config))
    ours = from_hf(src)
    assert ours.config.rotary_dim == transformers.AutoConfig.from_pretrained(src).rotary_dim == 64
    assert _max_diff(ours, hf) <= TOL


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("max_window_layers", [None, 0, 2, 40])
def test_qwen_sliding_layers_are_transformers(family: str, max_window_layers: int | None) -> None:
    """use_sliding_window slides the layers from max_window_layers up, and without that key transformers takes
    28: a config.json that leaves it out slides no layer of a model of 28 layers or fewer."""
    hf = dict(_LLAMA_BASE, architectures=[f"{family.capitalize()}ForCausalLM"], model_type=family, head_dim=16,
              use_sliding_window=True, sliding_window=8)
    if max_window_layers is not None:
        hf["max_window_layers"] = max_window_layers
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    ours = config_from_hf(hf)
    assert [ours.sliding_layer(i) for i in range(ours.n_layer)] == [
        t == "sliding_attention" for t in theirs.layer_types]


@pytest.mark.parametrize("cfg", [
    GPTConfig.preset("tiny"), GPTConfig.preset("pythia-70m", n_layer=1), GPTConfig.preset("gpt2", n_layer=1),
    GPTConfig.preset("pythia-70m", rotary_fraction=0.3, n_head=4, block="pre"),  # 38 of 128 dims rotate
])
def test_written_config_reads_back_in_both(cfg: GPTConfig) -> None:
    hf = config_to_hf(cfg)
    assert config_from_hf(hf).replace(name=cfg.name) == cfg
    # transformers 5.x reads it, and also reads the 4.x (top-level) rope keys alone, as a 4.x reader would use
    for keys in (hf, {k: v for k, v in hf.items() if k != "rope_parameters"}):
        parsed = transformers.AutoConfig.for_model(**{k: v for k, v in keys.items() if k != "architectures"})
        rope = getattr(parsed, "rope_parameters", None) or {}
        if cfg.position == "rope":
            assert rope["rope_theta"] == cfg.rope_base
            if cfg.norm == "layernorm":
                assert int(cfg.head_size * rope["partial_rotary_factor"]) == cfg.rotary_dim


def test_odd_rotary_dims_export_as_the_even_count_both_use() -> None:
    cfg = GPTConfig.preset("pythia-70m", n_layer=1, rotary_fraction=0.36)  # int(64 * 0.36) = 23 -> 22
    back = config_from_hf(config_to_hf(cfg))
    assert back.rotary_dim == cfg.rotary_dim == 22


def test_gpt2_ids_only_for_the_gpt2_vocabulary() -> None:
    assert config_to_hf(GPTConfig.preset("gpt2", n_layer=1))["eos_token_id"] == 50256
    small = config_to_hf(GPTConfig.preset("gpt2", n_layer=1, vocab_size=VOCAB))
    assert small["bos_token_id"] is None and small["eos_token_id"] is None


# --- errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters={"rope_type": "mrope", "rope_theta": 5e5}), "mrope"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {}}), "per-layer"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 4.0,
                           "high_freq_factor": 1.0, "original_max_position_embeddings": 64}), "low_freq_factor"),
    (dict(rope_scaling={"type": "linear", "factor": 0.5}), "factor"),
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", original_max_position_embeddings=64,
          rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}), "short_factor"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16, sliding_window=8,
          layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True, sliding_window=8,
          layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    # a rope parameter that is not a number is named, not a bare "could not convert string to float"
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "5e5"}), "'rope_theta' should be a number"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "mscale": "1",
                           "mscale_all_dim": 1}), "'mscale' should be a number, got '1'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "beta_fast": [32]}),
     "'beta_fast' should be a number"),
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", original_max_position_embeddings=64,
          rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "factor": "x"}),
     "'factor' should be a number"),
    (dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", rotary_pct=True), "'rotary_pct' should be"),
    # transformers refuses these too: without a factor the scaling would silently be none
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5}), "rope_type 'linear' but no 'factor'"),
    (dict(rope_scaling={"type": "dynamic"}), "rope_type 'dynamic' but no 'factor'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "original_max_position_embeddings": 64}),
     "rope_type 'llama3' but no 'factor'"),
    # a 4.x Qwen config has no layer_types: the error names the key it does have
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True, sliding_window=8,
          max_window_layers=1), r"max_window_layers=1 \(full attention on the first 1 of 2 layers"),
    # YaRN added as a model card says (rope_scaling) to a config that transformers 5.x saved (rope_parameters):
    # transformers takes rope_scaling (and loses rope_parameters' theta), gptlab would take rope_parameters
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
          rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
     "rope_scaling and rope_parameters disagree on 'rope_type' .'yarn' against 'default'."),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(architectures=["FalconForCausalLM"], model_type="falcon"), "FalconForCausalLM"),
    (dict(hidden_size="64"), "LlamaForCausalLM"),
    (dict(tie_word_embeddings="false"), "'tie_word_embeddings' should be true or false"),  # bool("false") is True
    (dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", use_parallel_residual=0),
     "use_parallel_residual"),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window="no"), "use_sliding_window"),
])
def test_config_errors(change: dict, message: str) -> None:
    with pytest.raises(GptlabError, match=message):
        config_from_hf(dict(_LLAMA_BASE, **change))


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"]}))
    with pytest.raises(GptlabError) as e:
        from_hf(tmp_path)
    for name in ("T5ForConditionalGeneration", "GPT2LMHeadModel", "LlamaForCausalLM", "GPTNeoXForCausalLM"):
        assert name in str(e.value)


def test_missing_and_broken_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_LLAMA_BASE))
    with pytest.raises(GptlabError, match="no weights"):
        from_hf(tmp_path)
    with pytest.raises(GptlabError, match="not a directory"):
        from_hf(tmp_path / "missing")
    src = _save(_hf_model("llama"), tmp_path / "hf", "safetensors")
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GptlabError, match="up_proj"):
        from_hf(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    (src / "model.safetensors").unlink()
    _hf_model("llama").save_pretrained(src / "other")
    (src / "other" / "model.safetensors").rename(src / "model.safetensors")
    with pytest.raises(GptlabError, match="shape"):
        from_hf(src)
    (src / "config.json").write_text("{not json")
    with pytest.raises(GptlabError, match="cannot read"):
        from_hf(src)


class _Payload:
    def __reduce__(self) -> tuple:
        return (Path.touch, (Path("ran"),))


def test_a_pickled_bin_with_code_or_junk_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .bin holding more than tensors is refused in one line naming what it holds, never run, and without torch's
    paragraphs (which suggest loading it again with weights_only=False); a file that is no torch file says why."""
    monkeypatch.chdir(tmp_path)
    src = _save(_hf_model("llama"), tmp_path / "hf", "bin")
    torch.save({"model.embed_tokens.weight": torch.zeros(1), "x": _Payload()}, src / "pytorch_model.bin")
    with pytest.raises(GptlabError) as e:
        from_hf(src)
    message = str(e.value)
    assert "\n" not in message and "pytorch_model.bin" in message and "weights_only" not in message, message
    assert "GLOBAL getattr" in message, message  # what torch refused: Path.touch is pickled as getattr(Path, ...)
    assert not (tmp_path / "ran").exists()
    (src / "pytorch_model.bin").write_bytes(b"hello")
    with pytest.raises(GptlabError, match=r"pytorch_model.bin as a weights-only torch file \(KeyError"):
        from_hf(src)


def test_unknown_weights_are_refused(tmp_path: Path) -> None:
    src = _save(_hf_model("llama"), tmp_path / "hf", "safetensors")
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GptlabError, match="q_norm"):
        from_hf(src)


@pytest.mark.parametrize("change, switch", [
    (dict(qk_norm=True), "qk_norm"),
    (dict(mlp="relu2"), "relu2"),
    (dict(logit_softcap=30.0), "logit_softcap"),
    (dict(block="post"), "block=post"),
    (dict(position="learned"), "position=learned"),
    (dict(mlp="gelu"), "mlp=gelu"),
    (dict(position="none"), "position=none"),
    (dict(n_kv_head=2, position="learned", norm="layernorm", mlp="gelu", bias=True), "n_kv_head=2"),
    (dict(rotary_fraction=0.5, qkv_bias=True), "rotary_fraction"),  # Phi-3 takes partial rotary, not biases
    (dict(norm="layernorm", mlp="gelu", bias=False), "bias=False"),
])
def test_export_refuses_switches_without_equivalent(change: dict, switch: str, tmp_path: Path) -> None:
    model = GPT(GPTConfig.preset("tiny", **change))
    with pytest.raises(GptlabError, match=switch):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("preset", ["gemma-2-2b", "qwen3-0.6b"])
def test_one_attention_bias_flag_refuses_biases_on_qkv_alone(preset: str, tmp_path: Path) -> None:
    """Gemma 2, Qwen3 and Llama have one attention_bias flag for q, k, v and o: q/k/v biases without an output
    bias are refused (written as attention_bias=true, transformers would add a random o_proj bias). A Llama's go
    to Qwen2, which has exactly those (test_a_config_the_first_fitting_family_refuses_goes_to_the_next)."""
    cfg = GPTConfig.preset(preset, n_layer=1, n_embd=64, n_head=4, n_kv_head=2, head_dim=16, mlp_hidden=96,
                           vocab_size=VOCAB, block_size=32, qkv_bias=True, attn_proj_bias=False)
    with pytest.raises(GptlabError, match="attention_bias covers q, k, v and o together"):
        save_hf(GPT(cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_config_the_first_fitting_family_refuses_goes_to_the_next(tmp_path: Path) -> None:
    """Llama's switches fit partial rotary but Llama rotates whole heads; Phi-3 takes it (partial_rotary_factor),
    so a model born in gptlab with it exports as a Phi-3 with transformers' logits."""
    cfg = GPTConfig.preset("tiny", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, mlp_hidden=96, vocab_size=VOCAB,
                           block_size=32, rotary_fraction=0.5, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    save_hf(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "Phi3ForCausalLM"
    assert _max_diff(model, hf) <= TOL

    # Llama's one attention_bias flag cannot bias q, k, v without o; Qwen2's q, k, v biases are exactly that
    cfg = GPTConfig.preset("tinyllama-1.1b", n_layer=1, n_embd=64, n_head=4, n_kv_head=2, mlp_hidden=96,
                           vocab_size=VOCAB, block_size=32, qkv_bias=True, attn_proj_bias=False)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # biases off zero
    save_hf(model, tmp_path / "qkv-bias")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qkv-bias").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    assert _max_diff(model, hf) <= TOL


def test_phi3_exports_only_the_scaling_transformers_runs_for_it(tmp_path: Path) -> None:
    """transformers' Phi3 refuses every rope_type but longrope: a Phi-3 with linear scaling (full rotary) is
    written as the Llama it equals; with partial rotary, which Llama lacks, it is refused naming the scaling."""
    hf = _hf_model("phi3", num_key_value_heads=2)
    ours = from_hf(_save(hf, tmp_path / "hf", "safetensors"))
    linear = GPT(ours.config.replace(rope_scaling={"kind": "linear", "factor": 2.0})).eval()
    linear.load_state_dict(ours.state_dict())
    save_hf(linear, tmp_path / "linear")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "linear").eval()
    assert type(back).__name__ == "LlamaForCausalLM"
    assert _max_diff(linear, back) <= TOL
    partial = GPT(ours.config.replace(rotary_fraction=0.5, rope_scaling={"kind": "linear", "factor": 2.0}))
    with pytest.raises(GptlabError, match=r"rope_scaling kind linear has no equivalent in Phi-3"):
        save_hf(partial, tmp_path / "partial")


def test_a_switch_no_family_lists_is_refused_until_one_does(tmp_path: Path) -> None:
    """The seam for new switches: a GPTConfig field that no family's EXPRESSES names exports only at its
    default, so a model gptlab can build but no family can hold is never written as a different model."""

    @dataclasses.dataclass
    class WithAlibi(GPTConfig):  # a position scheme gptlab might add later
        alibi: bool = False

    fields = GPTConfig.preset("tiny").to_dict()
    assert config_to_hf(WithAlibi(**fields))["architectures"] == ["LlamaForCausalLM"]  # at its default: fine
    with pytest.raises(GptlabError, match="alibi=True has no equivalent in any family"):
        config_to_hf(WithAlibi(**fields, alibi=True))


def test_the_registry_is_the_one_list_of_families() -> None:
    from gptlab.interop import SUPPORTED_ARCHITECTURES
    from gptlab.interop.registry import FAMILIES

    assert SUPPORTED_ARCHITECTURES == tuple(f.ARCHITECTURE for f in FAMILIES)
    for family in FAMILIES:  # what export and import read from each family module
        for name in ("NAME", "ARCHITECTURE", "MODEL_TYPE", "EXPRESSES", "IGNORE", "config_from_hf", "config_to_hf",
                     "check_export", "normalize", "rules"):
            assert hasattr(family, name), (family.__name__, name)


# --- gptlab convert -----------------------------------------------------------------------------------------
def test_convert_cli_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    hf = _hf_model("llama", num_key_value_heads=2)
    src = _save(hf, tmp_path / "hf", "safetensors")

    assert main(["convert", str(src), str(tmp_path / "ckpt")]) == 0
    assert "gptlab checkpoint" in capsys.readouterr().out
    ours = load_gptlab_model(tmp_path / "ckpt")
    assert _max_diff(ours, hf) <= TOL
    assert _max_diff(load_model(src)[0], hf) <= TOL  # everything that loads checkpoints reads HF dirs too

    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "bfloat16"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert back.dtype == torch.bfloat16
    assert _max_diff(ours, back.float().eval()) <= 0.05  # bf16 weights

    # a run directory resolves to its latest checkpoint
    save_model(tmp_path / "run" / "checkpoints" / "step-0000010", ours)
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "from-run")]) == 0
    assert _max_diff(ours, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "from-run")) <= TOL


def test_convert_carries_the_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gptlab.tokenizer import HFTokenizer

    tok = HFTokenizer.train(["the quick brown fox jumps over the lazy dog. "] * 20, vocab_size=VOCAB + 140)
    hf = _hf_model("neox", vocab_size=tok.vocab_size, bos_token_id=tok.eot_id, eos_token_id=tok.eot_id)
    src = _save(hf, tmp_path / "hf", "safetensors")
    tok.save(src)
    (src / "tokenizer_meta.json").unlink()  # a plain transformers directory: tokenizer.json + its config
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))

    assert main(["convert", str(src), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    assert "tokenizer" in capsys.readouterr().out
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    text = "the lazy fox"
    assert hf_tok(text)["input_ids"] == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eot_id
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == tok.eot_id


def test_convert_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err

    save_model(tmp_path / "ckpt", GPT(GPTConfig.preset("pocket", n_layer=1)))  # relu2: no HF equivalent
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "mlp=relu2" in capsys.readouterr().err

    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    save_model(tmp_path / "tiny", GPT(GPTConfig.preset("tiny")))
    assert main(["convert", str(tmp_path / "tiny"), str(tmp_path / "precious")]) == 2
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    assert main(["convert", str(tmp_path / "tiny"), str(tmp_path / "tiny" / "hf")]) == 2


def test_convert_help_names_every_family_the_registry_lists() -> None:
    """`gptlab convert --help` names its families without importing torch: the list it names is the registry's."""
    from gptlab.cli.convert import HF_ARCHITECTURES
    from gptlab.interop.registry import SUPPORTED_ARCHITECTURES

    assert HF_ARCHITECTURES == SUPPORTED_ARCHITECTURES
