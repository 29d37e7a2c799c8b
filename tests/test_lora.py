"""LoRA: the layer against its formula, merged against unmerged, gptlab's adapters against peft's on the same
weights (logits and gradients), the peft export, activation checkpointing, and the target names."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.interop import from_hf, save_peft_adapter
from gptlab.lora import LoRALinear, LoRASpec, add_lora, has_lora, lora_state_dict, merge_lora, parse_targets
from gptlab.model import GPT

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

VOCAB = 96


def _config(**kw) -> GPTConfig:
    base = dict(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu",
                norm="rmsnorm", position="rope", bias=False)
    return GPTConfig(**{**base, **kw})


def _randomize_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """B starts at zero (the update is 0): give every adapter matrix random values so tests see the update."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _ids(n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


# --- the layer --------------------------------------------------------------------------------------------------------
def test_layer_is_the_base_plus_scaled_low_rank_updates_of_its_slices() -> None:
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 10, bias=True)
    W, b = base.weight.detach().clone(), base.bias.detach().clone()
    spec = LoRASpec(rank=3, alpha=6.0)
    layer = LoRALinear(base, {"q": (0, 4), "v": (7, 10)}, spec)  # rows 4..6 get no update
    _randomize_adapters(torch.nn.ModuleDict({"l": layer}))
    x = torch.randn(5, 8)
    expected = x @ W.T + b
    for t, (start, end) in layer.slices.items():  # y[:, slice] += (alpha / r) * x A^T B^T
        expected[:, start:end] += 2.0 * (x @ layer.lora_A[t].T @ layer.lora_B[t].T)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-6)
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    torch.testing.assert_close(layer.merged()(x), expected, rtol=0, atol=1e-6)


def test_adapters_start_at_zero_freeze_the_base_and_are_all_the_optimizer_sees() -> None:
    torch.manual_seed(0)
    model = GPT(_config())
    ids = _ids()
    with torch.no_grad():  # (in training a CPU's norms and heads run gptlab's kernels: equal within rounding)
        before = model(ids)[0]
    add_lora(model, LoRASpec(rank=4, targets=("q", "v", "down")))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], before)  # B = 0: exactly the base model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))
    assert {n.split(".")[-1] for n in trainable} == {"q", "v", "down"}
    grouped = {id(p) for g in model.optimizer_groups(0.1) for p in g["params"]}
    assert grouped == {id(p) for n, p in model.named_parameters() if p.requires_grad}


@settings(max_examples=12, deadline=None)
@given(rank=st.integers(1, 6), targets=st.sets(st.sampled_from(["q", "k", "v", "o", "gate", "up", "down"]),
                                                min_size=1), seed=st.integers(0, 1000))
def test_merged_equals_unmerged(rank: int, targets: set[str], seed: int) -> None:
    torch.manual_seed(seed)
    model = add_lora(GPT(_config()), LoRASpec(rank=rank, alpha=2.0 * rank + 1, targets=parse_targets(targets)))
    _randomize_adapters(model, seed)
    ids = _ids(seed=seed)
    merged = merge_lora(copy.deepcopy(model))
    assert not has_lora(merged)
    torch.testing.assert_close(merged(ids)[0], model(ids)[0], rtol=0, atol=2e-5)


@pytest.mark.parametrize("export", ["hf", "gguf"])
def test_exporting_unmerged_adapters_whole_is_a_one_line_error(export: str, tmp_path: Path) -> None:
    """save_hf and save_gguf write whole models: a model with adapters kept apart is refused naming the ways out,
    not a KeyError ('transformer.wte.weight': its saved state is the adapters alone)."""
    from gptlab.interop import save_hf
    from gptlab.interop.gguf import save_gguf
    from gptlab.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text("".join(chr(32 + i) for i in range(VOCAB)))
    model = add_lora(GPT(_config(vocab_size=tok.vocab_size)), LoRASpec(rank=2))
    with pytest.raises(GptlabError, match="unmerged LoRA adapters.*merge_lora.*save_peft_adapter"):
        save_hf(model, tmp_path / "out") if export == "hf" else save_gguf(model, tmp_path / "out.gguf", tok)
    assert not list(tmp_path.iterdir())
    merged = merge_lora(model)
    save_hf(merged, tmp_path / "out") if export == "hf" else save_gguf(merged, tmp_path / "out.gguf", tok)


def test_targets_by_name() -> None:
    assert parse_targets("q_proj, v") == ("q", "v")
    assert parse_targets(["all-linear", "q"]) == ("all-linear",)
    with pytest.raises(GptlabError, match="unknown LoRA target 'qkv'"):
        parse_targets("qkv")
    for bad in ([1, 2], 7, ["q", None]):  # (a lora.json's targets = [1, 2]: an AttributeError on int.strip)
        with pytest.raises(GptlabError, match="lora_targets must be names"):
            parse_targets(bad)
    gpt2 = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(GptlabError, match="no gate projection"):
        add_lora(gpt2, LoRASpec(rank=2, targets=("gate",)))
    # add_lora itself reads names as parse_targets does: an unknown one was "has no gate projection", and a bare
    # string was iterated by character ("LoRA target 'c'")
    for targets, message in ((("nope",), "unknown LoRA target 'nope'"), ("c_attn", "unknown LoRA target 'c_attn'")):
        with pytest.raises(GptlabError, match=message):
            add_lora(gpt2, LoRASpec(rank=2, targets=targets))
        assert not has_lora(gpt2) and all(p.requires_grad for p in gpt2.parameters())
    aliased = add_lora(GPT(gpt2.config), LoRASpec(rank=2, targets=("q_proj", "v_proj")))
    assert {n.split(".")[-1] for n in lora_state_dict(aliased)} == {"q", "v"}
    add_lora(gpt2, LoRASpec(rank=2))  # all-linear on GPT-2: q, k, v, o, up, down
    assert {n.split(".")[-1] for n in lora_state_dict(gpt2)} == {"q", "k", "v", "o", "up", "down"}


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    model = add_lora(GPT(_config(dropout=0.1)), LoRASpec(rank=4, dropout=0.1)).train()
    _randomize_adapters(model)
    ids = _ids(16)
    grads = []
    for recompute in (False, True):
        model.activation_checkpointing = recompute
        torch.manual_seed(1)  # the same dropout masks: checkpoint replays the RNG in the recomputation
        model.zero_grad()
        model(ids[:, :-1], ids[:, 1:])[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6)


# --- against peft -----------------------------------------------------------------------------------------------------
def _hf(arch: str, directory: Path) -> Path:
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
        cls = transformers.GPT2LMHeadModel
    elif arch == "gptj":
        cfg = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, rotary_dim=4)
        cls = transformers.GPTJForCausalLM
    elif arch in ("qwen3", "gemma2", "phi3"):
        prefix = {"qwen3": "Qwen3", "gemma2": "Gemma2", "phi3": "Phi3"}[arch]
        extra = dict(head_dim=16) if arch != "phi3" else {}
        cfg = getattr(transformers, f"{prefix}Config")(**common, num_key_value_heads=2, intermediate_size=48,
                                                       pad_token_id=0, **extra)
        cls = getattr(transformers, f"{prefix}ForCausalLM")
    else:
        cfg = transformers.GPTNeoXConfig(**common, intermediate_size=64)
        cls = transformers.GPTNeoXForCausalLM
    torch.manual_seed(0)
    cls(cfg).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("arch, targets", [("llama", "all-linear"), ("llama", "q,v,up"), ("gpt2", "all-linear"),
                                           ("gpt2", "q,v"), ("neox", "all-linear"), ("qwen3", "all-linear"),
                                           ("gemma2", "q,v,gate"), ("phi3", "all-linear"), ("phi3", "k,up"),
                                           ("gptj", "all-linear")])
def test_peft_loads_the_exported_adapter_with_equal_logits(arch: str, targets: str, tmp_path: Path) -> None:
    base_dir = _hf(arch, tmp_path / "base")
    torch.manual_seed(0)
    ours = add_lora(from_hf(base_dir, dtype=torch.float32), LoRASpec(rank=4, alpha=8.0,
                                                                     targets=parse_targets(targets)))
    _randomize_adapters(ours)
    save_peft_adapter(ours, tmp_path / "adapter", base_model=str(base_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], theirs(ids).logits, rtol=0, atol=1e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0


def test_gradients_equal_peft_on_the_same_weights(tmp_path: Path) -> None:
    """The same loss gives the same adapter gradients: peft's q_proj adapter is gptlab's "q" slice of c_attn."""
    base_dir = _hf("llama", tmp_path / "base")
    torch.manual_seed(0)
    ours = add_lora(from_hf(base_dir, dtype=torch.float32), LoRASpec(rank=4, alpha=8.0))
    _randomize_adapters(ours)
    save_peft_adapter(ours, tmp_path / "adapter", base_model=str(base_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    ids = _ids(16)
    ours(ids[:, :-1], ids[:, 1:])[1].backward()
    logits = theirs(ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    hf_names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    theirs_grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    checked = 0
    for name, p in ours.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")  # transformer.h.{i}.attn.c_attn.lora_A.q
        i, which, target = int(parts[2]), parts[-2], parts[-1]
        hf_name = f"base_model.model.model.layers.{i}.{hf_names[target]}.{which}.default.weight"
        torch.testing.assert_close(p.grad, theirs_grads[hf_name], rtol=1e-4, atol=1e-6)
        checked += 1
    assert checked == len(theirs_grads) == 2 * 7 * 2
