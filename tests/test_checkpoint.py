"""Training checkpoints: optimizer state round trips through safetensors, atomic writes survive a crash
midway, pruning keeps the newest, and nothing is pickled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_model

from gptlab import checkpoint as ckpt
from gptlab.checkpoint import writing  # every checkpoint file is written there (save_file)
from gptlab.errors import GptlabError
from gptlab.loading import load_model, resolve_checkpoint
from gptlab.model import GPT
from gptlab.train.optim import OptimizerSpec, build_optimizers


def small_model(seed: int = 0) -> GPT:
    return tiny_model(block_size=16, vocab_size=40, seed=seed)


def trained(optimizer: str, impl: str = "torch") -> tuple[GPT, list]:
    model = small_model()
    opts = build_optimizers(model, OptimizerSpec(kind=optimizer, impl=impl))
    x = torch.randint(0, 40, (4, 17))
    for _ in range(3):
        model(x[:, :-1], x[:, 1:])[1].backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return model, opts


@pytest.mark.parametrize(("optimizer", "impl"), [("adamw", "torch"), ("muon", "torch"), ("muon", "gptlab")])
def test_optimizer_state_round_trips(tmp_path: Path, optimizer: str, impl: str) -> None:
    model, opts = trained(optimizer, impl)
    path = ckpt.save_checkpoint(tmp_path / "step-0000003", model, {"step": 3}, opts)
    fresh = small_model(seed=1)
    fresh_opts = build_optimizers(fresh, OptimizerSpec(kind=optimizer, impl=impl))
    state = ckpt.load_training_checkpoint(path, fresh, fresh_opts)
    assert state == {"step": 3}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for o1, o2 in zip(opts, fresh_opts, strict=True):
        s1, s2 = o1.state_dict(), o2.state_dict()
        assert s1["param_groups"] == s2["param_groups"]
        for pid, st in s1["state"].items():
            for key, value in st.items():
                assert torch.equal(value, s2["state"][pid][key]), (pid, key)
    # the optimizers keep working on the loaded parameters
    x = torch.randint(0, 40, (2, 17))
    fresh(x[:, :-1], x[:, 1:])[1].backward()
    for opt in fresh_opts:
        opt.step()


def test_checkpoint_files_are_safetensors_and_json_only(tmp_path: Path) -> None:
    model, opts = trained("muon")
    path = ckpt.save_checkpoint(tmp_path / "c", model, {"step": 3}, opts)
    assert sorted(p.name for p in path.iterdir()) == [
        ".gptlab",
        "config.json", "model.safetensors", "optimizer.safetensors", "state.json"]
    state = json.loads((path / "state.json").read_text())
    assert [o["type"] for o in state["optimizers"]] == ["Muon", "AdamW"]
    # the other implementation's state does not load silently
    with pytest.raises(GptlabError, match="BatchedMuon"):
        other = small_model()
        ckpt.load_training_checkpoint(path, other, build_optimizers(other, OptimizerSpec(kind="muon", impl="gptlab")))
    for f in path.iterdir():
        assert not f.read_bytes().startswith(b"\x80")  # no pickle protocol header


def test_a_checkpoint_without_optimizers_is_a_model_with_its_tokenizer(tmp_path: Path) -> None:
    """What checkpoints/best/ holds: weights, config, state.json and the data's tokenizer; no optimizer state."""
    model, _ = trained("adamw")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "tokenizer_meta.json").write_text('{"kind": "char", "chars": "abc"}')
    path = ckpt.save_checkpoint(tmp_path / "best", model, {"step": 3, "val_loss": 2.5}, tokenizer_dir=data_dir)
    assert sorted(p.name for p in path.iterdir()) == [
        ".gptlab",
        "config.json", "model.safetensors", "state.json", "tokenizer_meta.json"]
    assert json.loads((path / "state.json").read_text()) == {"step": 3, "val_loss": 2.5}
    assert (path / "tokenizer_meta.json").read_bytes() == (data_dir / "tokenizer_meta.json").read_bytes()
    assert ckpt.save_checkpoint(tmp_path / "other", model, {"step": 3}, writer=False) is None  # FSDP peers
    assert not (tmp_path / "other").exists()


def test_save_model_with_its_arguments_swapped_says_so(tmp_path: Path) -> None:
    model = tiny_model()
    # was "'PosixPath' object has no attribute 'modules'" from inside the state dict's reading
    with pytest.raises(GptlabError, match=r"model must be a torch.nn.Module, got PosixPath \(the path comes first"):
        ckpt.save_model(model, tmp_path / "ck")
    with pytest.raises(GptlabError, match="model must be a torch.nn.Module, got OrderedDict$"):
        ckpt.save_model(tmp_path / "ck", model.state_dict())
    assert not (tmp_path / "ck").exists()
    assert load_model(ckpt.save_model(tmp_path / "ck", model))[0].config == model.config


def test_a_crash_midway_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "run"
    model, opts = trained("adamw")
    good = run / "checkpoints" / ckpt.step_dir_name(10)
    ckpt.save_checkpoint(good, model, {"step": 10}, opts)

    real_save = writing.save_file

    def dies_midway(tensors, path, **kwargs) -> None:  # model.safetensors is written, optimizer's fails
        real_save(tensors, path, **kwargs)
        if path.endswith(ckpt.OPTIMIZER_FILE):
            raise KeyboardInterrupt

    monkeypatch.setattr(writing, "save_file", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(run / "checkpoints" / ckpt.step_dir_name(20), model, {"step": 20}, opts)
    monkeypatch.undo()
    assert ckpt.list_step_checkpoints(run) == [good]
    assert resolve_checkpoint(run, prefer="latest") == good
    assert [p.name for p in (run / "checkpoints").iterdir()] == [good.name]  # the temp dir was removed
    # even a temp dir left by a SIGKILL (no cleanup ran) is never picked, and the next prune removes it
    leftover = run / "checkpoints" / ".step-0000030.tmp-abc"
    leftover.mkdir()
    (leftover / ckpt.MODEL_FILE).write_bytes(b"partial")
    assert resolve_checkpoint(run, prefer="latest") == good
    loaded, _ = load_model(run, prefer="latest")
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)
    ckpt.prune_checkpoints(run, keep_last=2)
    assert not leftover.exists()


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        d = tmp_path / "checkpoints" / ckpt.step_dir_name(step)
        d.mkdir(parents=True)
        (d / ckpt.MODEL_FILE).write_bytes(b"x")
    ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in ckpt.list_step_checkpoints(tmp_path)] == ["step-0000015", "step-0000020"]


def test_wrapped_models_save_plain_names(tmp_path: Path) -> None:
    class Compiled(torch.nn.Module):  # what torch.compile's OptimizedModule looks like from outside
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

    model = small_model()
    ckpt.save_model(tmp_path / "m", Compiled(model))
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "m" / ckpt.MODEL_FILE).keys()
    assert "transformer.wte.weight" in keys and not any("_orig_mod" in k for k in keys)
