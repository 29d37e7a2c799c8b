"""Loading weights: the one rule (a checkpoint holds exactly the plain GPT's tensors), models with modules added on
top (adapters) taking a plain checkpoint only when asked, and every model path kind resolving to a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from gptlab import GPT, GPTConfig
from gptlab.checkpoint import load_gptlab_model, load_weights, save_model
from gptlab.errors import GptlabError
from gptlab.loading import load_model, resolve_checkpoint


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", tie_embeddings=False))


def test_extra_modules_keep_their_values_only_when_asked(tmp_path: Path) -> None:
    plain = _model(0)
    save_model(tmp_path / "ckpt", plain)
    state = load_file(tmp_path / "ckpt" / "model.safetensors")

    other = _model(1)
    other.transformer.h[0].attn.adapter = nn.Linear(32, 4)  # a module added on top of the plain GPT
    adapter = other.transformer.h[0].attn.adapter.weight.detach().clone()
    with pytest.raises(GptlabError, match="adapter"):
        load_weights(other, state)  # by default the rule is strict: nothing is left unloaded by accident

    extra = load_weights(other, state, keep_extra=True)
    assert extra == ["transformer.h.0.attn.adapter.bias", "transformer.h.0.attn.adapter.weight"]
    assert torch.equal(other.transformer.h[0].attn.adapter.weight, adapter)  # untouched
    loaded = other.state_dict()
    for name, tensor in plain.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_checkpoints_that_do_not_fit_the_plain_gpt_are_refused(tmp_path: Path) -> None:
    model = _model(0)
    save_model(tmp_path / "ckpt", model)
    path = tmp_path / "ckpt" / "model.safetensors"
    good = load_file(path)

    missing = {k: v for k, v in good.items() if k != "transformer.h.1.mlp.c_fc.weight"}
    save_file(missing, path)
    with pytest.raises(GptlabError, match="lacks the weight 'transformer.h.1.mlp.c_fc.weight'"):
        load_gptlab_model(tmp_path / "ckpt")

    save_file({**good, "transformer.h.0.attn.lora_a": torch.zeros(4, 32)}, path)  # saved from an adapted model
    with pytest.raises(GptlabError, match="no place for: 'transformer.h.0.attn.lora_a'"):
        load_gptlab_model(tmp_path / "ckpt")

    save_file({**good, "transformer.ln_f.weight": torch.ones(31)}, path)
    with pytest.raises(GptlabError, match=r"transformer.ln_f.weight has shape \(31,\)"):
        load_gptlab_model(tmp_path / "ckpt")


def test_a_tied_head_is_stored_once_and_loads_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))  # tied
    save_model(tmp_path / "ckpt", model)
    assert "lm_head.weight" not in load_file(tmp_path / "ckpt" / "model.safetensors")
    back = load_gptlab_model(tmp_path / "ckpt")
    assert back.lm_head.weight is back.transformer.wte.weight
    idx = torch.randint(0, model.config.vocab_size, (2, 9))
    assert torch.equal(back(idx)[0], model.eval()(idx)[0])


def test_every_kind_of_path_resolves(tmp_path: Path) -> None:
    model = _model(0)
    run = tmp_path / "run"
    save_model(run / "checkpoints" / "step-0000005", model)
    save_model(run / "checkpoints" / "step-0000010", model)
    assert resolve_checkpoint(run).name == "step-0000010"  # no best: the latest step
    save_model(run / "checkpoints" / "best", model)
    assert resolve_checkpoint(run).name == "best"
    assert resolve_checkpoint(run, prefer="latest").name == "step-0000010"
    for misspelt in ("last", "Best"):  # silently meant the latest step, a model the caller did not ask for
        with pytest.raises(GptlabError, match=f"prefer must be 'best' or 'latest', got '{misspelt}'"):
            load_model(run, prefer=misspelt)
    assert resolve_checkpoint(run / "checkpoints" / "best" / "model.safetensors").name == "best"
    loaded, tokenizer = load_model(run)
    assert tokenizer is None and loaded.config == model.config
    for bad, message in ((tmp_path / "nope", "does not exist"), (tmp_path, "no checkpoint found"),
                         (run / "checkpoints" / "best" / "config.json", "is a file")):
        with pytest.raises(GptlabError, match=message):
            resolve_checkpoint(bad)


def test_a_device_or_dtype_that_cannot_be_is_named_before_any_weight_is_read(tmp_path: Path) -> None:
    model = _model(0)
    save_model(tmp_path / "ck", model)
    cases = [({"device": "foo"}, "device 'foo' is not a device"),
             ({"device": "xla"}, "device 'xla' cannot run a model"),
             ({"dtype": "float99"}, "dtype must be a floating-point torch.dtype"),
             ({"dtype": torch.int64}, "dtype must be a floating-point torch.dtype")]
    if not torch.cuda.is_available():  # failed inside safetensors: "pin_memory=True requires a CUDA ... backend"
        cases.append(({"device": "cuda"}, "CUDA is not available here"))
    for kwargs, message in cases:
        with pytest.raises(GptlabError, match=message):
            load_model(tmp_path / "ck", **kwargs)
    half, _ = load_model(tmp_path / "ck", dtype="bfloat16")  # a name, as from_hf takes it (was a TypeError)
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(half.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
