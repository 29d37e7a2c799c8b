"""Preference tuning: pairs in `prepare` (masks on the replies, a pair in two consecutive windows, bad records named),
DPO and IPO equal to trl's DPOTrainer (loss and gradients, fp32, within 1e-5), label smoothing, SimPO and ORPO against
their formulas, the LoRA reference (adapters off) equal to the base model, dropout off while training
(disable_dropout: the step of a model with dropout equal to the one without, trl's, and exact resume), and
`train --objective dpo` end to end: reward metrics in metrics.jsonl and `gptlab plot`, `gptlab chat` on the result,
DDP equal to one process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import PAIRS, hf_llama_dir, make_data, one_line_error, pairs_data, write_jsonl

from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.train.batches import TokenSplit, rows_of_pairs, step_batch
from gptlab.train.objectives import Preference, sequence_logps

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# --- data -------------------------------------------------------------------------------------------------------
def test_pairs_are_two_windows_with_targets_on_the_replies_only(tmp_path: Path) -> None:
    from gptlab.tokenizer import load_tokenizer

    data = pairs_data(tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    assert meta["layout"] == "pairs" and meta["examples"] == {"train": 3, "val": 1}
    tok, window = load_tokenizer(data), meta["window_tokens"]
    ids = np.fromfile(data / "train.bin", "<u2").reshape(-1, window)
    mask = np.fromfile(data / "train.mask.bin", "u1").reshape(-1, window)
    replies = [tok.decode(i[m == 1].tolist()) for i, m in zip(ids, mask, strict=True)]
    # the plain template ends a reply with its newline; the earlier assistant turn "Hello" is prompt, not target
    assert replies == [" Four.\n", " Five, I think.\n", " Blue\n", " Green\n", " yes\n", " no\n"]
    for c in range(0, len(ids), 2):  # the prompt's tokens are the same in both windows of a pair
        start = int(np.argmax(mask[c]))
        assert start == int(np.argmax(mask[c + 1])) and (ids[c, :start] == ids[c + 1, :start]).all()
    assert "Hello" in tok.decode(ids[2].tolist())
    # a step's rows: pairs side by side, chosen first; n_targets counts pairs
    split = TokenSplit.load(data, "train")
    batch = step_batch(split, seed=1, step=0, batch_size=4, block_size=window - 1)
    assert batch.windows.shape == (8, window) and batch.n_targets == 4
    starts = [int(np.flatnonzero((ids == row).all(1))[0]) for row in batch.windows]
    assert all(c % 2 == 0 and r == c + 1 for c, r in zip(starts[0::2], starts[1::2], strict=True))
    x, y = batch.micro(0, 1, 0, 1)  # cut after the longest reply's last target
    assert x.shape == y.shape and x.shape[1] < window - 1 and (y[:, -1] != -1).any()


def test_tokens_per_sec_counts_the_tokens_of_pairs_rows_as_cut(tmp_path: Path) -> None:
    """A pair's rows run only to the micro-step's longest reply: tokens/s (and MFU) count those tokens, not the
    whole windows (which had put MFU over 1)."""
    from gptlab.train.batches import StepFeed

    data = pairs_data(tmp_path)
    split = TokenSplit.load(data, "train")
    window = split.window_tokens
    batch = step_batch(split, seed=1, step=0, batch_size=4, block_size=window - 1)
    for world, accum in [(1, 1), (1, 2), (2, 2)]:
        held = sum(batch.micro(r, world, m, accum)[0].numel() for r in range(world) for m in range(accum))
        assert batch.tokens(world, accum) == held < 8 * (window - 1)
    feed = StepFeed(split, seed=1, batch_size=4, seq_len=window - 1, rank=0, world=1, grad_accum=2,
                    vocab_size=10_000, device="cpu")
    feed.prefetch(0)
    steps = [feed.get(0), feed.get(1)]  # one made ahead, one made when asked: both counted once
    assert feed.seen_tokens == sum(x.numel() for s in steps for x, _ in s.micro)
    seen = feed.seen_tokens
    feed.prefetch(2)  # made ahead, not yet handed out: not counted
    assert feed.seen_tokens == seen
    text = step_batch(TokenSplit.load(make_data(tmp_path / "text", chars=2_000), "train"), 1, 0, 4, 16)
    assert text.tokens(2, 2) == 4 * 16


@pytest.mark.parametrize(("row", "expected"), [
    ({"prompt": "p", "chosen": "c"}, "line 1: a preference pair needs 'chosen' and 'rejected', has no 'rejected'"),
    ({"chosen": "c", "rejected": "r"}, "line 1: has no 'prompt'"),
    ({"prompt": "p", "chosen": 3, "rejected": "r"}, "line 1: field 'chosen' must be a string, got int"),
    ({"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "user", "content": "c"}], "rejected": "r"},
     "line 1: field 'chosen' must end with an assistant message"),
    ({"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
     "line 1: the prompt is empty"),
])
def test_bad_pairs_are_one_line_naming_line_and_field(tmp_path: Path, capsys, row: dict, expected: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [row, PAIRS[0]])
    rc = main(["prepare", str(path), "--tokenizer", "char", "--block-size", "64", "--out", str(tmp_path / "d")])
    assert expected in one_line_error(rc, capsys.readouterr().err)


def test_objective_and_data_must_match(tmp_path: Path) -> None:
    from gptlab.train import Trainer, build_train_config

    data = pairs_data(tmp_path)
    with pytest.raises(GptlabError, match="holds preference pairs: train on them with --objective dpo"):
        Trainer(build_train_config({"block_size": 96, "max_steps": 2, "warmup_steps": 0}), data, tmp_path / "r")
    text = make_data(tmp_path / "text", chars=2_000)
    with pytest.raises(GptlabError, match="objective dpo trains on preference pairs; .* holds none"):
        Trainer(build_train_config({"objective": "dpo", "max_steps": 2, "warmup_steps": 0}), text, tmp_path / "r2")
    with pytest.raises(GptlabError, match="label_smoothing applies to objectives dpo and simpo"):
        build_train_config({"objective": "ipo", "label_smoothing": 0.1})
    with pytest.raises(GptlabError, match="beta must be a number > 0"):
        build_train_config({"objective": "dpo", "beta": 0.0})


@pytest.mark.parametrize("key, value, objective, owner, message", [
    ("beta", 0.04, "grpo", "dpo", "beta applies to objectives dpo, ipo, simpo and orpo, not grpo: GRPO's KL weight is "
                                  "kl_beta"),
    ("kl_beta", 0.1, "dpo", "grpo", "kl_beta applies to objective grpo, not dpo"),
    ("simpo_gamma", 1.0, "dpo", "simpo", "simpo_gamma applies to objective simpo, not dpo"),
    ("temperature", 0.7, "lm", "grpo", "temperature applies to objective grpo, not lm"),
    ("group_size", 4, "orpo", "grpo", "group_size applies to objective grpo, not orpo")])
def test_a_key_the_objective_does_not_read_is_refused_not_ignored(key: str, value: float, objective: str, owner: str,
                                                                 message: str) -> None:
    from gptlab.train import build_train_config

    with pytest.raises(GptlabError, match=message):
        build_train_config({"objective": objective, key: value})
    assert getattr(build_train_config({"objective": owner, key: value}), key) == value
    assert build_train_config({"objective": objective})  # at its default the key is no one's concern


def test_the_memory_check_counts_the_frozen_reference_copy_but_not_under_lora() -> None:
    from gptlab.flops import parameter_counts
    from gptlab.train import build_train_config
    from gptlab.train.memory import step_memory

    lm = build_train_config({"model": "gpt2", "batch_size": 1, "grad_accum": 1})
    dpo = build_train_config({"model": "gpt2", "batch_size": 1, "grad_accum": 1, "objective": "dpo"})
    params = parameter_counts(lm.model_config())[0]
    assert step_memory(dpo, dpo.model_config(), 1, True).total - \
        step_memory(lm, lm.model_config(), 1, True).total == 4 * params
    simpo = build_train_config({"model": "gpt2", "batch_size": 1, "grad_accum": 1, "objective": "simpo"})
    assert step_memory(simpo, simpo.model_config(), 1, True) == step_memory(lm, lm.model_config(), 1, True)
    lora = {"init_from": "x", "lora_rank": 4, "batch_size": 1, "grad_accum": 1}
    assert step_memory(build_train_config({**lora, "objective": "dpo"}), lm.model_config(), 1, False) == \
        step_memory(build_train_config(lora), lm.model_config(), 1, False)


# --- the losses against trl and the maths ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small random Llama (the reference) and the same perturbed (the policy), both as transformers saves them."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("dpo_llama")
    base = hf_llama_dir(root / "base", "the quick brown fox jumps over the lazy dog " * 200, vocab_size=300,
                        chat_template=CHATML)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(root / "policy")
    return base, root / "policy"


def id_pairs(vocab: int, n: int = 3) -> list[dict[str, list[int]]]:
    g = np.random.default_rng(0)
    return [{"prompt_ids": g.integers(3, vocab, int(g.integers(3, 9))).tolist(),
             "chosen_ids": g.integers(3, vocab, int(g.integers(2, 7))).tolist(),
             "rejected_ids": g.integers(3, vocab, int(g.integers(2, 7))).tolist()} for _ in range(n)]


def trl_loss_and_grads(base: Path, policy: Path, pairs: list, loss_type: str, beta: float, out: Path
                       ) -> tuple[float, dict[str, torch.Tensor]]:
    """trl's DPOTrainer on `pairs` (its own collator): the loss and every parameter's gradient."""
    trl = pytest.importorskip("trl")
    import transformers
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(base)
    tok.pad_token = tok.eos_token
    load = transformers.AutoModelForCausalLM.from_pretrained
    args = trl.DPOConfig(output_dir=str(out), beta=beta, loss_type=[loss_type], report_to=[], use_cpu=True,
                         per_device_train_batch_size=len(pairs), max_length=None, bf16=False, fp16=False)
    trainer = trl.DPOTrainer(model=load(policy, dtype=torch.float32), ref_model=load(base, dtype=torch.float32),
                             args=args, processing_class=tok,
                             train_dataset=Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    inputs = trainer.data_collator(pairs)
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_and_ipo_equal_trl_loss_and_gradients(llama: tuple[Path, Path], tmp_path: Path, loss_type: str) -> None:
    from gptlab import from_hf

    base, policy = llama
    reference, model = from_hf(base).float(), from_hf(policy).float().train()
    pairs, beta = id_pairs(reference.config.vocab_size), 0.3
    want_loss, want = trl_loss_and_grads(base, policy, pairs, loss_type, beta, tmp_path)

    objective = Preference("dpo" if loss_type == "sigmoid" else "ipo", beta, 0.0, reference)
    x, y = rows_of_pairs(pairs)
    loss, stats = objective.loss(model, x, y, scale=1 / len(pairs))
    loss.backward()
    assert abs(float(loss) - want_loss) < 1e-5
    assert_grads_equal_trl({n: p.grad for n, p in model.named_parameters()}, want, model.config.n_layer)
    assert abs(want_loss - math.log(2)) > 1e-3  # the policy is not the reference
    assert stats.shape == (3,) and 0 <= float(stats[2]) <= len(pairs)


def assert_grads_equal_trl(grads: dict[str, torch.Tensor], want: dict[str, torch.Tensor], n: int) -> None:
    """gptlab's gradients of a Llama equal transformers' (trl's) under their names, fp32 within 1e-5."""
    same = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight",
            **{f"transformer.h.{i}.attn.c_proj.weight": f"model.layers.{i}.self_attn.o_proj.weight" for i in range(n)},
            **{f"transformer.h.{i}.mlp.c_proj.weight": f"model.layers.{i}.mlp.down_proj.weight" for i in range(n)},
            **{f"transformer.h.{i}.ln_1.weight": f"model.layers.{i}.input_layernorm.weight" for i in range(n)}}
    compared = [ours for ours in same if ours in grads]  # a tied head has one gradient, under the embedding's name
    assert len(compared) >= 3 * n + 2
    for ours in compared:
        torch.testing.assert_close(grads[ours], want[same[ours]], atol=1e-5, rtol=1e-4, msg=ours)


def test_label_smoothing_is_conservative_dpo_and_rewards_are_beta_log_ratios() -> None:
    logps = torch.tensor([-3.0, -5.0, -4.0, -2.5], dtype=torch.float64)
    ref = torch.tensor([-3.5, -4.5, -4.0, -3.0], dtype=torch.float64)
    beta, eps = 0.5, 0.2
    objective = Preference.__new__(Preference)
    objective.name, objective.beta, objective.label_smoothing = "dpo", beta, eps
    losses, chosen, rejected = objective.pair_losses(logps, torch.ones(4), ref)
    for i, (c, r) in enumerate([(0, 1), (2, 3)]):
        h = (logps[c] - ref[c]) - (logps[r] - ref[r])
        want = -(1 - eps) * math.log(1 / (1 + math.exp(-beta * h))) - eps * math.log(1 / (1 + math.exp(beta * h)))
        assert abs(float(losses[i]) - want) < 1e-12
        assert float(chosen[i]) == pytest.approx(beta * float(logps[c] - ref[c]))
        assert float(rejected[i]) == pytest.approx(beta * float(logps[r] - ref[r]))


def test_lora_reference_is_the_base_with_adapters_off(llama: tuple[Path, Path]) -> None:
    from gptlab import from_hf
    from gptlab.lora import LoRASpec, add_lora

    base = from_hf(llama[0]).float()
    x, y = rows_of_pairs(id_pairs(base.config.vocab_size, 2))
    with torch.no_grad():
        want = sequence_logps(base, x, y)[0]
    add_lora(base, LoRASpec(rank=2))
    for name, p in base.named_parameters():  # adapters that change the model
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    objective = Preference("dpo", 0.1, 0.0, base)
    assert objective.reference()[0] is base  # no copy of the model
    torch.testing.assert_close(objective.reference_logps(x, y), want, atol=0, rtol=0)
    assert not torch.allclose(sequence_logps(base, x, y)[0], want)  # the adapters are back on after it
    loss, _ = objective.loss(base, x, y, 0.5)
    loss.backward()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in base.named_parameters())


# --- dropout off while training (disable_dropout, trl's default) ---------------------------------------------------
def dpo_step(init_from: Path, reference: torch.nn.Module | None, pairs: list, seed: int = 0, **keys: object
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One DPO step (beta 0.3) of the model a run of recipe `keys` starts from (`build_model`), against `reference`
    (None: the model's own, LoRA's base with its adapters off): the loss and the gradients. `seed`: the dropout
    stream the step draws from."""
    from gptlab.train import build_train_config
    from gptlab.train.setup import build_model

    cfg = build_train_config({"init_from": str(init_from), "objective": "dpo", "beta": 0.3, **keys})
    model = build_model(cfg, 0, "cpu")
    objective = Preference("dpo", 0.3, 0.0, model if reference is None else reference)
    torch.manual_seed(seed)
    x, y = rows_of_pairs(pairs)
    loss, _ = objective.loss(model, x, y, scale=1 / len(pairs))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    """The same loss and gradients, to the bit."""
    assert torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys()
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1]), [k for k in a[1] if not torch.equal(a[1][k], b[1][k])]


def test_dpo_turns_dropout_off_by_default_and_equals_trl(llama: tuple[Path, Path], tmp_path: Path) -> None:
    """A model whose config has dropout 0.1 (attention weights, residual, embeddings) takes, under disable_dropout's
    default, exactly the step of the same model with dropout 0; that step is trl's DPOTrainer's (which turns
    dropout off by default too). With disable_dropout = false the dropout runs: the step depends on its stream."""
    from gptlab import from_hf

    base, policy = llama
    reference = from_hf(base).float()
    pairs = id_pairs(reference.config.vocab_size)
    off = dpo_step(policy, reference, pairs, dropout=0.1)
    assert_same_step(off, dpo_step(policy, reference, pairs, dropout=0.0))
    want_loss, want = trl_loss_and_grads(base, policy, pairs, "sigmoid", 0.3, tmp_path)
    assert abs(float(off[0]) - want_loss) < 1e-5
    assert_grads_equal_trl(off[1], want, reference.config.n_layer)
    on = [float(dpo_step(policy, reference, pairs, seed=s, dropout=0.1, disable_dropout=False)[0]) for s in (1, 2)]
    assert on[0] != on[1] and float(off[0]) not in on


def test_lora_dpo_turns_the_adapters_dropout_off_too(llama: tuple[Path, Path]) -> None:
    """configs/lora.toml's lora_dropout 0.05 and the model's dropout: off by default, the step is the one without
    either. At the start the policy is the reference (B = 0): the loss is log 2 exactly, which the policy's dropout,
    absent from the reference's forward, would move (the bias trl's default avoids)."""
    policy = llama[1]
    pairs = id_pairs(json.loads((policy / "config.json").read_text())["vocab_size"])
    lora = {"lora_rank": 4, "lora_alpha": 8.0}
    off = dpo_step(policy, None, pairs, dropout=0.1, lora_dropout=0.05, **lora)
    assert_same_step(off, dpo_step(policy, None, pairs, dropout=0.0, lora_dropout=0.0, **lora))
    assert float(off[0]) == pytest.approx(math.log(2), abs=1e-6)
    on = [float(dpo_step(policy, None, pairs, seed=s, dropout=0.1, lora_dropout=0.05, disable_dropout=False,
                         **lora)[0]) for s in (1, 2)]
    assert on[0] != on[1] and abs(on[0] - math.log(2)) > 1e-4
    # the adapters' dropout alone (the output unchanged while B = 0): B's gradients follow its masks
    grads = [dpo_step(policy, None, pairs, seed=s, lora_dropout=0.05, disable_dropout=False, **lora)[1]
             for s in (1, 2)]
    assert any(not torch.equal(grads[0][k], grads[1][k]) for k in grads[0] if "lora_B" in k)


def test_disable_dropout_follows_the_objective_is_refused_for_lm_and_kept_on_resume() -> None:
    import dataclasses

    from gptlab.train import build_train_config
    from gptlab.train.config import resolve_disable_dropout, resume_differences

    objectives = ("lm", "dpo", "ipo", "simpo", "orpo", "grpo")
    assert {o: resolve_disable_dropout(build_train_config({"objective": o})).disable_dropout for o in objectives} \
        == {"lm": False, "dpo": True, "ipo": True, "simpo": True, "orpo": True, "grpo": False}  # trl's defaults
    assert build_train_config({"objective": "grpo"}, {"disable_dropout": "true"}).disable_dropout is True
    assert build_train_config({"objective": "dpo"}, {"disable_dropout": "off"}).disable_dropout is False
    assert build_train_config({"disable_dropout": False}).disable_dropout is False  # lm's own behaviour, restated
    with pytest.raises(GptlabError, match=r"disable_dropout applies to objectives .*not lm.*set dropout = 0"):
        build_train_config({"disable_dropout": True})
    with pytest.raises(GptlabError, match=r"disable_dropout = 'sometimes': expected bool \| 'auto'"):
        build_train_config({"objective": "dpo", "disable_dropout": "sometimes"})
    # what a run builds: every nn.Dropout's p (attention's included) 0 where it resolves true, the config as it was
    from gptlab.train.setup import build_model

    def dropouts(**keys: object) -> tuple[set[float], float]:
        model = build_model(build_train_config({"objective": "grpo", "dropout": 0.1, **keys}), 65, "cpu")
        ps = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
        assert len([m for m in model.modules() if isinstance(m, torch.nn.Dropout)]) > 3 * model.config.n_layer
        return ps, model.config.dropout

    assert dropouts() == ({0.1}, 0.1) and dropouts(disable_dropout=True) == ({0.0}, 0.1)
    # resumed: as the checkpoint ran; one from before the key ran its dropout, and resumes so
    dpo = build_train_config({"objective": "dpo"})
    assert resolve_disable_dropout(dpo, {"disable_dropout": False}).disable_dropout is False
    assert resolve_disable_dropout(dpo, {"disable_dropout": True}).disable_dropout is True
    old = {k: v for k, v in dpo.to_dict().items() if k != "disable_dropout"}
    assert resolve_disable_dropout(dpo, old).disable_dropout is False
    assert resume_differences(old, resolve_disable_dropout(dpo, old)) == []
    assert resume_differences(old, dataclasses.replace(dpo, disable_dropout=True)) == ["disable_dropout"]


# --- a run ----------------------------------------------------------------------------------------------------------
def test_train_dpo_logs_rewards_plots_and_chats(tmp_path: Path, capsys, monkeypatch) -> None:
    data = pairs_data(tmp_path, PAIRS * 4)
    recipe = tmp_path / "dpo.toml"
    recipe.write_text('model = "tiny"\nobjective = "dpo"\nbeta = 0.5\nbatch_size = 4\nmax_steps = 12\n'
                      "warmup_steps = 1\nlog_interval = 1\nlr = 3e-3\nblock_size = 96\ntensorboard = false\n"
                      "threads = 1\ndropout = 0.0\n")
    assert main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train_loss" in r]
    for r in logged:
        assert r["reward_margin"] == pytest.approx(r["rewards_chosen"] - r["rewards_rejected"])
        assert 0.0 <= r["reward_accuracy"] <= 1.0
    assert logged[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-6)  # the first step's policy is the reference
    assert logged[-1]["train_loss"] < 0.5
    assert logged[-1]["reward_margin"] > 0 and "val_loss" in rows[-1]
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path / "run"), "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 0
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("What is two plus two?\n"))
    assert main(["chat", str(tmp_path / "run"), "--max-new-tokens", "4", "--temperature", "0"]) == 0


def test_lora_dpo_on_a_hugging_face_base_then_chat(llama: tuple[Path, Path], tmp_path: Path, monkeypatch,
                                                   capsys) -> None:
    """The usual case: pairs rendered with the base's own chat template, adapters trained against the base."""
    base = llama[0]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 3)
    assert main(["prepare", str(pairs), "--tokenizer-from", str(base), "--block-size", "64", "--out",
                 str(tmp_path / "data")]) == 0
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["layout"] == "pairs" and meta["chat_template"] != "plain"
    run = tmp_path / "run"
    assert main(["train", "configs/lora.toml", "--data", str(tmp_path / "data"), "--out", str(run), "--quiet",
                 "--init-from", str(base), "--objective", "dpo", "--batch-size", "4", "--max-steps", "8",
                 "--warmup-steps", "1", "--log-interval", "1", "--lr", "1e-2", "--tensorboard", "false"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "train_loss" in line]
    assert rows[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-5)  # B = 0: the policy is the base
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and rows[-1]["reward_margin"] > 0
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("Hi\n"))
    capsys.readouterr()
    assert main(["chat", str(run), "--max-new-tokens", "2", "--temperature", "0"]) == 0  # the context is 64
    assert capsys.readouterr().out.strip()


def test_dpo_run_without_dropout_resumes_exactly_and_its_checkpoint_keeps_the_dropout(tmp_path: Path,
                                                                                       capsys) -> None:
    """A DPO run of a model with dropout 0.1: trains as with dropout 0 (the same losses), records disable_dropout
    true, saves dropout 0.1 in its checkpoints' model config, and resumes bit-identically. With disable_dropout =
    false the dropout runs; a checkpoint from before the key (its state.json without it) resumes with its dropout
    on, bit-identically to that run, and refuses disable_dropout = true."""
    import shutil

    from safetensors.torch import load_file

    data = pairs_data(tmp_path, PAIRS * 4)
    recipe = tmp_path / "dpo.toml"
    recipe.write_text('model = "tiny"\nobjective = "dpo"\nbatch_size = 4\nmax_steps = 6\nwarmup_steps = 1\n'
                      "log_interval = 1\nlr = 3e-3\nblock_size = 96\ntensorboard = false\nthreads = 1\n"
                      "dropout = 0.1\ncheckpoint_interval = 3\neval_interval = 0\n")

    def train(run: str, *extra: str) -> int:
        return main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / run), "--quiet", *extra])

    def losses(run: str) -> list[float]:
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["train_loss"] for line in rows if "train_loss" in line]

    def weights(run: str) -> dict[str, torch.Tensor]:
        return load_file(tmp_path / run / "checkpoints" / "step-0000006" / "model.safetensors")

    def from_step_3(run: str, copy: str) -> Path:
        shutil.copytree(tmp_path / run, tmp_path / copy)
        shutil.rmtree(tmp_path / copy / "checkpoints" / "step-0000006")
        return tmp_path / copy / "checkpoints" / "step-0000003" / "state.json"

    assert train("off") == 0 and train("zero", "--dropout", "0.0") == 0
    assert losses("off") == losses("zero")
    assert json.loads((tmp_path / "off" / "config.resolved.json").read_text())["train"]["disable_dropout"] is True
    saved = json.loads((tmp_path / "off" / "checkpoints" / "step-0000006" / "config.json").read_text())
    assert saved["dropout"] == 0.1  # a fine-tune of the result has the model's own dropout
    from_step_3("off", "off_resumed")
    assert train("off_resumed", "--resume") == 0
    assert losses("off_resumed") == losses("off")
    assert all(torch.equal(a, weights("off")[k]) for k, a in weights("off_resumed").items())

    assert train("on", "--disable-dropout", "false") == 0
    # the first step's policy is the reference: log 2 without dropout, moved by it (the bias it is off for)
    assert losses("off")[0] == pytest.approx(math.log(2), abs=1e-6) and abs(losses("on")[0] - math.log(2)) > 1e-4
    state_path = from_step_3("on", "old")
    state = json.loads(state_path.read_text())
    del state["config"]["disable_dropout"]
    state["config_hash"] = "0123456789abcdef"
    state_path.write_text(json.dumps(state))
    capsys.readouterr()
    assert train("old", "--resume", "--disable-dropout", "true") == 2
    assert "disable_dropout" in capsys.readouterr().err
    assert train("old", "--resume") == 0
    assert losses("old") == losses("on")
    assert all(torch.equal(a, weights("on")[k]) for k, a in weights("old").items())


def test_dpo_under_torchrun_ddp_matches_one_process(tmp_path: Path) -> None:
    """Two processes split each step's pairs; the loss and the reward statistics are those of the whole batch."""
    import subprocess
    import sys

    from helpers import REPO

    data = pairs_data(tmp_path, PAIRS * 4)
    recipe = tmp_path / "dpo.toml"
    recipe.write_text('model = "tiny"\nobjective = "dpo"\nbatch_size = 4\nmax_steps = 4\nwarmup_steps = 1\n'
                      "log_interval = 1\nlr = 3e-3\nblock_size = 96\ntensorboard = false\nthreads = 1\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptlab.cli",
           "train", str(recipe), "--data", str(data), "--out", str(tmp_path / "ddp"), "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / "one"), "--quiet",
                 "--grad-accum", "2"]) == 0
    keys = ("train_loss", "rewards_chosen", "rewards_rejected", "reward_accuracy")
    rows = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                  if "train_loss" in line] for run in ("ddp", "one")}
    assert len(rows["ddp"]) == 4
    for ours, one in zip(rows["ddp"], rows["one"], strict=True):
        assert [ours[k] for k in keys] == pytest.approx([one[k] for k in keys], abs=1e-5)


def test_simpo_and_orpo_against_their_formulas_and_without_a_reference() -> None:
    counts, logps = torch.tensor([2, 4, 3, 1]), torch.tensor([-1.0, -6.0, -0.3, -2.5], dtype=torch.float64)
    model = torch.nn.Linear(2, 2)
    simpo = Preference("simpo", 2.0, 0.1, model, simpo_gamma=0.4)
    orpo = Preference("orpo", 0.25, 0.0, model)
    assert simpo.reference()[0] is None and orpo.reference_logps(torch.zeros(1), torch.zeros(1)) is None
    got_simpo, chosen, rejected = simpo.pair_losses(logps, counts, None)
    got_orpo, _, _ = orpo.pair_losses(logps, counts, None)
    for i, (c, r) in enumerate([(0, 1), (2, 3)]):
        a_c, a_r = float(logps[c] / counts[c]), float(logps[r] / counts[r])
        h = 2.0 * (a_c - a_r) - 0.4
        want = -0.9 * math.log(1 / (1 + math.exp(-h))) - 0.1 * math.log(1 / (1 + math.exp(h)))
        assert float(got_simpo[i]) == pytest.approx(want, abs=1e-12)
        assert float(chosen[i]) == pytest.approx(2.0 * a_c) and float(rejected[i]) == pytest.approx(2.0 * a_r)
        odds = math.log(math.exp(a_c) / (1 - math.exp(a_c))) - math.log(math.exp(a_r) / (1 - math.exp(a_r)))
        assert float(got_orpo[i]) == pytest.approx(-a_c - 0.25 * math.log(1 / (1 + math.exp(-odds))), abs=1e-12)


@pytest.mark.parametrize("objective", ["ipo", "simpo", "orpo"])
def test_the_other_objectives_train(tmp_path: Path, objective: str) -> None:
    data = pairs_data(tmp_path, PAIRS * 4)
    recipe = tmp_path / "p.toml"
    recipe.write_text(f'model = "tiny"\nobjective = "{objective}"\nbatch_size = 4\nmax_steps = 10\n'
                      "warmup_steps = 1\nlog_interval = 1\nlr = 3e-3\nblock_size = 96\ntensorboard = false\n"
                      "threads = 1\ndropout = 0.0\n")
    assert main(["train", str(recipe), "--data", str(data), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    assert losses[-1] < losses[0] and rows[-1]["val_loss"] > 0


def test_ipo_pair_loss_is_the_squared_gap() -> None:
    objective = Preference.__new__(Preference)
    objective.name, objective.beta, objective.label_smoothing = "ipo", 0.25, 0.0
    logps, ref = torch.tensor([-2.0, -6.0]), torch.tensor([-3.0, -5.0])
    losses, _, _ = objective.pair_losses(logps, torch.tensor([2, 4]), ref)
    assert float(losses[0]) == pytest.approx((1.0 / 2 - (-1.0) / 4 - 1 / (2 * 0.25)) ** 2)
    assert F.logsigmoid(torch.zeros(1)).item() == pytest.approx(-math.log(2))
