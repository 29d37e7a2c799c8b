"""Training checkpoints: optimizer state round trips through safetensors, atomic writes survive a crash
midway, pruning keeps the newest, and nothing is pickled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptlab import checkpoint as ckpt
from gptlab.config import GPTConfig
from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.optim import build_optimizers
from gptlab.trainer_config import TrainConfig


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=40))


def trained(optimizer: str, impl: str = "torch") -> tuple[GPT, list]:
    model = tiny_model()
    opts = build_optimizers(model, TrainConfig(optimizer=optimizer, optimizer_impl=impl))
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
    path = ckpt.save_training_checkpoint(tmp_path / "step-0000003", model, opts, {"step": 3})
    fresh = tiny_model(seed=1)
    fresh_opts = build_optimizers(fresh, TrainConfig(optimizer=optimizer, optimizer_impl=impl))
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
    path = ckpt.save_training_checkpoint(tmp_path / "c", model, opts, {"step": 3})
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "model.safetensors", "optimizer.safetensors", "state.json"]
    state = json.loads((path / "state.json").read_text())
    assert [o["type"] for o in state["optimizers"]] == ["Muon", "AdamW"]
    # the other implementation's state does not load silently
    with pytest.raises(GptlabError, match="BatchedMuon"):
        ckpt.load_training_checkpoint(path, tiny_model(), build_optimizers(tiny_model(), TrainConfig(
            optimizer="muon", optimizer_impl="gptlab")))
    for f in path.iterdir():
        assert not f.read_bytes().startswith(b"\x80")  # no pickle protocol header


def test_a_crash_midway_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "run"
    model, opts = trained("adamw")
    good = run / "checkpoints" / ckpt.step_dir_name(10)
    ckpt.save_training_checkpoint(good, model, opts, {"step": 10})

    real_save = ckpt.save_file

    def dies_midway(tensors, path, **kwargs) -> None:  # model.safetensors is written, optimizer's fails
        real_save(tensors, path, **kwargs)
        if path.endswith(ckpt.OPTIMIZER_FILE):
            raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "save_file", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_training_checkpoint(run / "checkpoints" / ckpt.step_dir_name(20), model, opts, {"step": 20})
    monkeypatch.undo()
    assert ckpt.list_step_checkpoints(run) == [good]
    assert ckpt.resolve_checkpoint(run, prefer="latest") == good
    assert [p.name for p in (run / "checkpoints").iterdir()] == [good.name]  # the temp dir was removed
    # even a temp dir left by a SIGKILL (no cleanup ran) is never picked, and the next prune removes it
    leftover = run / "checkpoints" / ".step-0000030.tmp-abc"
    leftover.mkdir()
    (leftover / ckpt.MODEL_FILE).write_bytes(b"partial")
    assert ckpt.resolve_checkpoint(run, prefer="latest") == good
    loaded, _ = ckpt.load_model(run, prefer="latest")
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

    model = tiny_model()
    ckpt.save_model(tmp_path / "m", Compiled(model))
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "m" / ckpt.MODEL_FILE).keys()
    assert "transformer.wte.weight" in keys and not any("_orig_mod" in k for k in keys)
