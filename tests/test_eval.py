"""Whole-split evaluation against a manual computation, and `gptlab eval`."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import make_data

from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.config import GPTConfig
from gptlab.data import load_split
from gptlab.evaluation.loss import evaluate_loss
from gptlab.model import GPT


def manual_loss(model: GPT, data: np.ndarray, T: int) -> tuple[float, int]:
    """Every target once: window by window, token by token, summed in float64."""
    total, count = 0.0, 0
    ids = torch.from_numpy(np.asarray(data).astype(np.int64))
    with torch.no_grad():
        for start in range(0, len(ids) - 1, T):
            x = ids[start : start + T]
            y = ids[start + 1 : start + T + 1]
            x = x[: len(y)]
            logits, _ = model(x[None])
            losses = F.cross_entropy(logits[0].double(), y, reduction="none")
            total += float(losses.sum())
            count += len(y)
    return total / count, count


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, GPT, tuple[float, int]]:
    root = tmp_path_factory.mktemp("eval")
    data = make_data(root, chars=30_000)
    torch.manual_seed(0)
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=vocab))
    save_model(root / "ckpt", model.eval())
    return data, root / "ckpt", model, manual_loss(model, load_split(data, "val"), 16)


def test_evaluate_loss_matches_manual_computation(setup) -> None:
    data_dir, _, model, (expected, count) = setup
    val = load_split(data_dir, "val")
    assert (len(val) - 1) % 16 != 0  # the last window is a partial one
    for batch_size in (7, 64):
        result = evaluate_loss(model, val, 16, batch_size=batch_size)
        assert result.tokens == count == len(val) - 1
        assert result.loss == pytest.approx(expected, abs=1e-5)
    prefix = evaluate_loss(model, val, 16, max_tokens=100)
    assert prefix.tokens == 100
    assert prefix.loss == pytest.approx(manual_loss(model, val[:101], 16)[0], abs=1e-5)


def test_scoring_passes_take_the_training_kernels(setup, monkeypatch) -> None:
    """evaluate_loss's forwards run as a scoring pass (`gptlab.kernels.scoring`): the training kernels (norms, the
    heads' split with RoPE, the short attention) serve them without a gradient, the loss ATen's within fp32
    rounding; outside it a forward without a gradient keeps ATen's ops."""
    from gptlab import kernels

    if kernels.widest_ops() is None:
        pytest.skip("no gptlab kernel build on this machine")
    data_dir, _, model, (expected, _) = setup
    val = load_split(data_dir, "val")
    served = []
    real = kernels.training_ops
    monkeypatch.setattr(kernels, "training_ops", lambda *t: served.append(real(*t) is not None) or real(*t))
    with torch.no_grad():
        model(torch.zeros(2, 16, dtype=torch.long))
    assert served and not any(served)  # inference: ATen's
    served.clear()
    with_kernels = evaluate_loss(model, val, 16, batch_size=64).loss
    assert served and all(served)
    monkeypatch.setattr(kernels, "widest_ops", lambda: None)  # no build: ATen's ops
    without = evaluate_loss(model, val, 16, batch_size=64).loss
    assert with_kernels == pytest.approx(without, rel=1e-6) and with_kernels == pytest.approx(expected, abs=1e-5)


def test_eval_cli_json_matches_manual(setup, capsys) -> None:
    data_dir, ckpt, _, (expected, count) = setup
    assert main(["eval", str(ckpt), "--data", str(data_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    val = load_split(data_dir, "val")
    text = (data_dir.parent / "text.txt").read_text(encoding="utf-8")
    n_bytes = len(text[-(len(val) - 1) :].encode("utf-8"))  # the scored targets: all val chars but the first
    assert out["val_loss"] == pytest.approx(expected, abs=1e-5)
    assert out["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert out["tokens"] == count and out["bytes"] == n_bytes
    assert out["bits_per_byte"] == pytest.approx(expected * count / (math.log(2) * n_bytes), rel=1e-5)


def test_eval_cli_bf16_is_close(setup, capsys) -> None:
    data_dir, ckpt, _, (expected, _) = setup
    assert main(["eval", str(ckpt), "--data", str(data_dir), "--json", "--dtype", "bfloat16"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(expected, abs=2e-2)


def test_eval_cli_errors_are_one_line(setup, tmp_path: Path, capsys) -> None:
    data_dir, ckpt, _, _ = setup
    assert main(["eval", str(tmp_path / "nothing"), "--data", str(data_dir)]) == 2
    assert main(["eval", str(ckpt), "--data", str(tmp_path / "nodata")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)


def test_eval_refuses_data_of_another_tokenizer(setup, tmp_path: Path, capsys) -> None:
    """A model whose vocabulary holds the data's ids but means other text by them: one line, not a score of
    nonsense (a GPT-2 model scored char data before). With the data's own tokenizer it scores as without one."""
    from gptlab.tokenizer import CharTokenizer, load_tokenizer

    data_dir, _, model, (expected, _) = setup
    ours = save_model(tmp_path / "ours", model, load_tokenizer(data_dir))
    assert main(["eval", str(ours), "--data", str(data_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(expected, abs=1e-5)
    vocab = model.config.vocab_size
    other = save_model(tmp_path / "other", model, CharTokenizer([chr(0x4E00 + i) for i in range(vocab)]))
    assert main(["eval", str(other), "--data", str(data_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was tokenized with another tokenizer" in err, err


def test_eval_of_a_run_without_data_scores_the_data_it_trained_on(setup, tmp_path: Path, capsys) -> None:
    """`gptlab eval RUN` (or a checkpoint inside it) without --data or --tasks scores the data directory the run's
    config.resolved.json records, as --data would, and says so; where there is none to score, one line naming why."""
    data_dir, ckpt, _, (expected, _) = setup
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, run / "checkpoints" / "step-0000001")
    (run / "config.resolved.json").write_text(json.dumps({"train": {}, "data": str(data_dir)}))
    for target in (run, run / "checkpoints" / "step-0000001"):
        assert main(["eval", str(target), "--json"]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["val_loss"] == pytest.approx(expected, abs=1e-5)
        assert str(data_dir) in captured.err and "--data" in captured.err
    (run / "config.resolved.json").write_text(json.dumps({"data": str(tmp_path / "gone")}))
    assert main(["eval", str(run)]) == 2
    assert main(["eval", str(ckpt)]) == 2  # a checkpoint outside any run
    assert main(["eval", str(run), "--data", str(data_dir), "--tasks", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert str(tmp_path / "gone") in err[0] and str(ckpt) in err[1] and "not both" in err[2]


def test_a_failing_evaluation_gives_the_model_back_in_training_mode() -> None:
    """eval_mode restores the caller's mode when the block raises: a training model left in eval mode would train
    on without dropout."""
    from gptlab.hooks import eval_mode

    model = torch.nn.Dropout(0.5).train()
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not model.training
        raise RuntimeError("out of memory, say")
    assert model.training
    model.eval()
    with eval_mode(model):
        pass
    assert not model.training


@pytest.mark.parametrize("flags", [["--limit", "5"], ["--num-fewshot", "3"], ["--include-path", "tasks"]])
def test_task_flags_without_tasks_are_refused(setup, flags: list[str], capsys) -> None:
    """--limit, --num-fewshot and --include-path shape lm-eval tasks: on a split's loss they used to be ignored,
    and the whole split scored as if they had not been given."""
    data_dir, ckpt, _, _ = setup
    assert main(["eval", str(ckpt), "--data", str(data_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flags[0]} needs --tasks" in err, err


def test_split_with_tasks_is_refused(setup, capsys) -> None:
    """--split picks a prepared split; lm-eval tasks have their own, so it used to be ignored with --tasks."""
    _, ckpt, _, _ = setup
    assert main(["eval", str(ckpt), "--tasks", "hellaswag", "--split", "train"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--split" in err and "--tasks" in err, err


@pytest.mark.parametrize("flags, message", [
    (["--limit", "0"], "--limit must be"), (["--limit", "-3"], "--limit must be"),
    (["--limit", "nan"], "--limit must be"), (["--limit", "1e999"], "--limit must be"),
    (["--limit", "2.5"], "--limit must be"), (["--num-fewshot", "-1"], "--num-fewshot must be"),
])
def test_task_limits_out_of_range_are_refused(setup, flags: list[str], message: str, capsys) -> None:
    """--limit is a count of examples (a whole number from 1) or a fraction in (0, 1): 2.5 used to become 2, and 0,
    negatives and nan went on to lm-eval as they were."""
    _, ckpt, _, _ = setup
    assert main(["eval", str(ckpt), "--tasks", "hellaswag", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bits_per_byte_counts_the_text_s_bytes_not_the_end_of_text_marker(tmp_path: Path) -> None:
    """Documents are joined by the end-of-text token, which holds none of their text: a split over two documents
    has the bytes of its text (less the first token's, which is not scored), not 13 more for "<|endoftext|>"."""
    from helpers import hf_tokenizer_dir

    from gptlab.data import prepare
    from gptlab.evaluation.loss import evaluate_split
    from gptlab.tokenizer import load_tokenizer

    hf = hf_tokenizer_dir(tmp_path / "hf", {})
    first, second = "hello world " * 20, "world, hello " * 20
    (tmp_path / "a.txt").write_text(first)
    (tmp_path / "b.txt").write_text(second)
    meta = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "d", tokenizer=None, tokenizer_from=hf,
                   val_fraction=0.25)
    tok, train = load_tokenizer(tmp_path / "d"), load_split(tmp_path / "d", "train")
    assert meta["separator"] == "eot" and tok.eot_id in train.tolist()
    text = first + second[: len(first) + len(second) - round((len(first) + len(second)) * 0.25) - len(first)]
    assert tok.decode(train) == first + "<|endoftext|>" + text[len(first):]
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=tok.vocab_size))
    out = evaluate_split(model.eval(), tmp_path / "d", "train")
    assert out["bytes"] == len(text.encode()) - len(tok.decode_bytes(train[:1].tolist()))
    assert out["bits_per_byte"] == pytest.approx(out["train_loss"] * out["tokens"] / (math.log(2) * out["bytes"]))


def test_a_loss_past_exp_s_range_reports_an_infinite_perplexity(tmp_path: Path, capsys) -> None:
    """A diverged model (here every logit scaled up) can score over 709 nats a token, past where exp overflows a
    float: perplexity is then infinite (null in JSON, which has no infinity), not an OverflowError."""
    data = make_data(tmp_path, chars=3000)
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_embd=32, n_head=2, n_kv_head=2, block_size=16, vocab_size=vocab))
    with torch.no_grad():
        model.lm_head.weight.mul_(3000)
    save_model(tmp_path / "ckpt", model.eval())
    assert main(["eval", str(tmp_path / "ckpt"), "--data", str(data), "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert out["val_loss"] > 709 and out["perplexity"] is None
    assert main(["eval", str(tmp_path / "ckpt"), "--data", str(data)]) == 0
    assert "perplexity inf" in capsys.readouterr().out
