"""Fine-tuning runs: LoRA on a Hugging Face base (loss falls, the base is untouched, the run loads anywhere, converts
to transformers and peft with equal logits, resumes bit-identically after SIGKILL, runs under DDP and FSDP) and
the loss mask (the mean over counted targets of the whole batch, however it is split)."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, make_data, one_line_error
from safetensors.torch import load_file

from gptlab.checkpoint import list_step_checkpoints
from gptlab.cli import main
from gptlab.data import batch_starts
from gptlab.errors import GptlabError
from gptlab.generation import SamplingParams, generate_batch
from gptlab.loading import load_model
from gptlab.lora import has_lora
from gptlab.train import build_train_config
from gptlab.train.batches import TokenSplit, step_batch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

# the training settings of a fine-tuning recipe; the architecture comes from init_from
FINETUNE = dict(batch_size=8, max_steps=30, lr=3e-2, warmup_steps=2, log_interval=5, eval_interval=0,
                eval_tokens=1024, tensorboard=False, threads=1, seed=3)


def write_finetune_recipe(root: Path, **changes: object) -> Path:
    values = {**FINETUNE, **changes}
    text = "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
    (root / "finetune.toml").write_text(text)
    return root / "finetune.toml"


def sha256_of(directory: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file())).hexdigest()


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("finetune_data"), chars=30_000)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama saved by transformers (vocabulary 96 covers the char data's ~60 symbols)."""
    directory = tmp_path_factory.mktemp("base") / "llama"
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                                   tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def base_val_loss(base: Path, data: Path) -> float:
    from gptlab.evaluation.loss import evaluate_split

    return evaluate_split(load_model(base, dtype=torch.float32)[0], data, "val")["val_loss"]


def final_val_loss(run: Path) -> float:
    return [r["val_loss"] for r in metrics(run) if "val_loss" in r][-1]


def train(recipe: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["train", str(recipe), "--data", str(data), "--out", str(out), "--quiet", *extra])


def test_lora_run_trains_adapters_only_and_loads_converts_and_exports(tmp_path: Path, data: Path, base: Path,
                                                                       base_val_loss: float, capsys) -> None:
    before = sha256_of(base)
    recipe = write_finetune_recipe(tmp_path, init_from=str(base), lora_rank=4, lora_alpha=8.0, lora_dropout=0.05)
    run = tmp_path / "run"
    assert train(recipe, data, run) == 0
    assert final_val_loss(run) < base_val_loss - 0.5
    assert sha256_of(base) == before  # the base is read, never written
    (step,) = list_step_checkpoints(run)
    assert {p.name for p in step.iterdir()} >= {"lora.safetensors", "lora.json", "config.json", "optimizer.safetensors"}
    assert not (step / "model.safetensors").exists()
    lora = json.loads((step / "lora.json").read_text())
    assert lora["rank"] == 4 and lora["base"]["path"] == str(base.resolve())
    adapters = load_file(str(step / "lora.safetensors"))
    assert all(".lora_" in k and v.dtype == torch.float32 for k, v in adapters.items())

    # loads anywhere a run loads: merged (default) and unmerged compute the same, and generate the same
    merged, tok = load_model(run)
    unmerged, _ = load_model(run, merge_adapters=False)
    assert not has_lora(merged) and has_lora(unmerged) and tok is not None
    ids = torch.tensor([tok.encode("ROMEO:\nWhat say")])
    with torch.no_grad():
        torch.testing.assert_close(unmerged(ids)[0], merged(ids)[0], rtol=0, atol=1e-5)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    prompt = [ids[0].tolist()]
    tokens = [g.token_ids for g in generate_batch(merged, prompt, params)]
    assert tokens == [g.token_ids for g in generate_batch(unmerged, prompt, params)]
    assert main(["sample", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--seed", "1"]) == 0

    # merged into a Hugging Face directory that transformers loads with equal logits
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, merged(ids)[0], rtol=0, atol=1e-5)
    # the adapters alone, in peft's format, on the base they were trained on
    assert main(["convert", str(run), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(tuned(ids).logits, unmerged(ids)[0], rtol=0, atol=1e-5)
    capsys.readouterr()
    assert main(["convert", str(base), str(tmp_path / "x"), "--adapter-only"]) == 2
    assert "--adapter-only needs a LoRA run" in one_line_error(2, capsys.readouterr().err)


def test_lora_needs_its_base_unchanged(tmp_path: Path, data: Path, base: Path) -> None:
    moved = tmp_path / "base"
    moved.mkdir()
    for f in base.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    recipe = write_finetune_recipe(tmp_path, init_from=str(moved), lora_rank=2, max_steps=2, warmup_steps=1)
    assert train(recipe, data, tmp_path / "run") == 0
    weights = moved / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    from safetensors.torch import save_file

    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(GptlabError, match="has changed since"):
        load_model(tmp_path / "run")
    with pytest.raises(GptlabError, match="lora_rank needs a pretrained model"):
        build_train_config({"lora_rank": 4})
    with pytest.raises(GptlabError, match="unknown LoRA target"):
        recipe = write_finetune_recipe(tmp_path, init_from=str(base), lora_rank=2, lora_targets="q,x")
        from gptlab.train import Trainer, load_train_config

        Trainer(load_train_config(recipe), data, tmp_path / "bad", quiet=True)


@pytest.mark.parametrize("change, named", [(["--lora-rank", "8"], "lora_rank (4 -> 8)"),
                                           (["--lora-targets", "q,v"], "lora_targets ('all-linear' -> 'q,v')")])
def test_a_resume_that_changes_the_adapters_names_the_key(tmp_path: Path, data: Path, base: Path, capsys,
                                                          change: list[str], named: str) -> None:
    """A resume with other adapters is refused naming the recipe key that changed, not a tensor of another shape
    (or one too many) in the checkpoint's files."""
    recipe = write_finetune_recipe(tmp_path, init_from=str(base), lora_rank=4, max_steps=2, warmup_steps=1)
    assert train(recipe, data, tmp_path / "run") == 0
    capsys.readouterr()
    rc = train(recipe, data, tmp_path / "run", "--resume", "--max-steps", "4", *change)
    assert f"the config differs in {named}" in one_line_error(rc, capsys.readouterr().err)


def test_lora_sigkill_then_resume_is_bit_identical(tmp_path: Path, data: Path, base: Path) -> None:
    recipe = write_finetune_recipe(tmp_path, init_from=str(base), lora_rank=4, lora_dropout=0.1, max_steps=60,
                                   checkpoint_interval=5, keep_last=1)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "gptlab.cli", "train", str(recipe), "--data", str(data), "--out",
                             str(run), "--quiet"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        import time

        deadline = time.time() + 120
        while not list_step_checkpoints(run):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert int(list_step_checkpoints(run)[-1].name.split("-")[1]) < 60
    assert train(recipe, data, run, "--resume") == 0
    assert train(recipe, data, tmp_path / "ref") == 0
    final = load_file(str(list_step_checkpoints(run)[-1] / "lora.safetensors"))
    ref = load_file(str(list_step_checkpoints(tmp_path / "ref")[-1] / "lora.safetensors"))
    assert final.keys() == ref.keys() and all(torch.equal(final[k], ref[k]) for k in ref)


def test_lora_in_bfloat16_keeps_a_bf16_base_and_fp32_adapters(tmp_path: Path, data: Path, base: Path,
                                                              base_val_loss: float) -> None:
    from gptlab.train import Trainer, load_train_config

    recipe = write_finetune_recipe(tmp_path, init_from=str(base), lora_rank=4, dtype="bfloat16",
                                   activation_checkpointing=True, max_steps=20)
    trainer = Trainer(load_train_config(recipe), data, tmp_path / "run", quiet=True)
    dtypes = {(p.requires_grad, p.dtype) for p in trainer.model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    assert trainer.model.activation_checkpointing
    assert trainer.run() == 0
    assert final_val_loss(tmp_path / "run") < base_val_loss - 0.5


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_lora_under_torchrun_matches_one_process(mode: str, tmp_path: Path, data: Path, base: Path) -> None:
    recipe = write_finetune_recipe(tmp_path, init_from=str(base), lora_rank=4, max_steps=6, log_interval=2)
    out = tmp_path / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptlab.cli",
           "train", str(recipe), "--data", str(data), "--out", str(out), "--quiet", "--distributed", mode]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert train(recipe, data, tmp_path / "one", "--grad-accum", "2") == 0
    ours = [r["train_loss"] for r in metrics(out) if "train_loss" in r]
    one = [r["train_loss"] for r in metrics(tmp_path / "one") if "train_loss" in r]
    assert ours == pytest.approx(one, abs=1e-4)
    (ckpt,) = list_step_checkpoints(out)  # whole adapters, gathered from the shards under FSDP
    whole, single = load_file(str(ckpt / "lora.safetensors")), load_file(
        str(list_step_checkpoints(tmp_path / "one")[0] / "lora.safetensors"))
    assert all(torch.allclose(whole[k], single[k], atol=1e-4) for k in single)
    if mode == "fsdp":  # resumed, each process reads its rows of the adapters and their moments, and goes on alike
        proc = subprocess.run([*cmd, "--resume", "--max-steps", "8"], cwd=REPO, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert train(recipe, data, tmp_path / "one", "--grad-accum", "2", "--resume", "--max-steps", "8") == 0
        ours = [r["train_loss"] for r in metrics(out) if "train_loss" in r]
        one = [r["train_loss"] for r in metrics(tmp_path / "one") if "train_loss" in r]
        assert len(ours) == 4 and ours == pytest.approx(one, abs=1e-4)


# --- the loss mask ----------------------------------------------------------------------------------------------------
def masked_data(root: Path, window: int = 17, windows_per_split: int = 24, vocab: int = 40) -> Path:
    """A DATA_DIR as `gptlab prepare` writes chat data: examples packed into windows, a 0/1 target mask."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": "char", "vocab_size": vocab, "dtype": "uint16", "mask": True, "window_tokens": window,
            "layout": "packed"}
    for split in ("train", "val"):
        n = window * windows_per_split
        rng.integers(0, vocab, n).astype("<u2").tofile(root / f"{split}.bin")
        mask = (rng.random(n) < 0.4).astype(np.uint8)
        mask[::window] = 0  # a window's first token is never a target
        mask.tofile(root / f"{split}.mask.bin")
        meta[f"{split}_tokens"] = n
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_masked_step_loss_is_the_mean_over_counted_targets_however_split(tmp_path: Path) -> None:
    data = masked_data(tmp_path / "data")
    split = TokenSplit.load(data, "train")
    batch = step_batch(split, seed=1, step=0, batch_size=8, block_size=16)
    assert (batch.windows.shape, batch.n_targets) == ((8, 17), int(batch.mask[:, 1:].sum()))
    assert all(batch_starts(len(split.tokens), 1, 0, 8, 16, window_tokens=17) % 17 == 0)  # rows are whole windows
    torch.manual_seed(0)
    from gptlab.config import GPTConfig
    from gptlab.model import GPT

    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=16))
    # the reference: every counted target's cross-entropy, averaged once over the whole batch
    logits = model(torch.from_numpy(batch.windows[:, :-1]))[0]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch.windows[:, 1:]).flatten(),
                                           reduction="none")
    expected = ce[torch.from_numpy(batch.mask[:, 1:]).flatten() == 1].mean().detach()
    for world, accum in [(1, 1), (1, 4), (2, 2), (4, 2)]:
        total = 0.0
        for rank in range(world):
            for micro in range(accum):
                x, y = batch.micro(rank, world, micro, accum)
                with torch.no_grad():
                    total += float(model(x, y, reduction="sum")[1]) * world / batch.n_targets
        assert total / world == pytest.approx(float(expected), rel=1e-5)


def test_training_on_masked_data_counts_only_masked_targets(tmp_path: Path) -> None:
    data = masked_data(tmp_path / "data")
    recipe = tmp_path / "r.toml"
    recipe.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {
        **FINETUNE, "model": "tiny", "n_layer": 1, "n_embd": 16, "n_head": 2, "n_kv_head": 2, "block_size": 16,
        "max_steps": 4, "batch_size": 4, "log_interval": 1}.items()))
    assert train(recipe, data, tmp_path / "run") == 0
    assert train(recipe, data, tmp_path / "accum", "--grad-accum", "4") == 0
    one = [r["train_loss"] for r in metrics(tmp_path / "run") if "train_loss" in r]
    accum = [r["train_loss"] for r in metrics(tmp_path / "accum") if "train_loss" in r]
    assert len(one) == 4 and one == pytest.approx(accum, rel=1e-5)
    # rows are the prepared windows: a model with a longer context trains on them as they are, a shorter one can't
    recipe.write_text(recipe.read_text().replace("block_size = 16", "block_size = 24"))
    assert train(recipe, data, tmp_path / "longer_context") == 0
    assert len([r for r in metrics(tmp_path / "longer_context") if "train_loss" in r]) == 4
    recipe.write_text(recipe.read_text().replace("block_size = 24", "block_size = 8"))
    assert train(recipe, data, tmp_path / "short") == 2
