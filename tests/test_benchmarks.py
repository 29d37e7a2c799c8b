"""Benchmarks during training (eval_tasks): the built-in multiple-choice scoring against a manual computation and
against lm-eval's own scoring of the same examples, the scores in metrics.jsonl and `gptlab plot`, and a run's
weights untouched by them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_RECIPE, make_data, one_line_error, tiny_model, write_jsonl, write_recipe
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.evaluation.tasks import load_choice_task, score_choice_task, score_choice_tasks, split_pair
from gptlab.loading import load_model
from gptlab.tokenizer import CharTokenizer, load_tokenizer
from gptlab.train import build_train_config
from gptlab.train.benchmarks import Benchmarks

WORDS = ["the", "king", "queen", "lord", "sword", "crown", "night", "day", "love", "death", "blood", "heart"]


def _examples(seed: int, n: int = 8) -> list[dict]:
    """Short contexts with 2 to 4 word choices of different lengths (so acc_norm can differ from acc)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        choices = rng.sample(WORDS, 2 + i % 3)
        rows.append({"context": f"{rng.choice(WORDS).title()} of the {rng.choice(WORDS)},",
                     "choices": [" " + c for c in choices], "answer": rng.randrange(len(choices))})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("bench_data"))


@pytest.fixture(scope="module")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tasks")
    write_jsonl(d / "words.jsonl", _examples(0))
    write_jsonl(d / "more_words.jsonl", _examples(1, 6))
    return d


def _manual_scores(model, tok, rows: list[dict]) -> dict[str, float]:
    """From the maths: each choice's log-likelihood is the sum over its characters of log softmax of the full
    forward's logits at the position before it; argmax over choices (raw, and per character)."""
    right = right_norm = chance = 0.0
    for row in rows:
        lls = []
        for choice in row["choices"]:
            ctx, cont = tok.encode(row["context"]), tok.encode(choice)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logits, _ = model(ids[:, :-1])
            logp = torch.log_softmax(logits[0].double(), -1)
            lls.append(sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)))
        right += int(np.argmax(lls)) == row["answer"]
        right_norm += int(np.argmax([ll / len(c) for ll, c in zip(lls, row["choices"], strict=True)])) == row["answer"]
        chance += 1 / len(row["choices"])
    n = len(rows)
    return {"acc": right / n, "acc_norm": right_norm / n, "centered": (right / n - chance / n) / (1 - chance / n)}


def test_choice_scores_match_a_manual_computation(task_files: Path) -> None:
    rows = [json.loads(line) for line in (task_files / "words.jsonl").read_text().splitlines()]
    tok = CharTokenizer.from_text(" ".join(WORDS).title() + " ".join(WORDS) + ",of")
    for seed in range(3):  # random models: the scores differ between them
        model = tiny_model(vocab_size=tok.vocab_size, seed=seed)
        ours = score_choice_task(model, tok, load_choice_task(task_files / "words.jsonl"), batch_size=3)
        manual = _manual_scores(model, tok, rows)
        assert ours == pytest.approx(manual, abs=1e-12)


def test_core_is_the_mean_centered_accuracy(task_files: Path) -> None:
    tok = CharTokenizer.from_text(" ".join(WORDS).title() + " ".join(WORDS) + ",of")
    model = tiny_model(vocab_size=tok.vocab_size, seed=4)
    tasks = [load_choice_task(task_files / "words.jsonl"), load_choice_task(task_files / "more_words.jsonl")]
    out = score_choice_tasks(model, tok, tasks, limit=5)
    assert set(out) == {f"{t}/{m}" for t in ("words", "more_words") for m in ("acc", "acc_norm", "centered")} | {
        "core"}
    assert out["core"] == pytest.approx((out["words/centered"] + out["more_words/centered"]) / 2)
    assert out["words/acc"] == score_choice_task(model, tok, tasks[0], limit=5)["acc"]


def test_split_pair_moves_the_context_s_trailing_whitespace_as_lm_eval_does() -> None:
    tok = CharTokenizer.from_text("ab c\n")
    assert split_pair(tok, "a b ", "c", None) == (tok.encode("a b"), tok.encode(" c"))
    assert split_pair(tok, "a b\n", "c", None) == (tok.encode("a b"), tok.encode("\nc"))
    assert split_pair(tok, "", "ab", 3) == ([3], tok.encode("ab"))
    with pytest.raises(GptlabError, match="empty context"):
        split_pair(tok, "", "ab", None)


@settings(max_examples=200, deadline=None)
@given(st.text("ab c", min_size=1), st.text("ab c", min_size=1))
def test_split_pair_tokens_are_the_whole_text_s(context: str, continuation: str) -> None:
    """Whatever the spaces: context + continuation tokens encode the joined text, the continuation's tokens
    start where the context less its trailing spaces ends, and they hold the whole continuation."""
    tok = CharTokenizer.from_text("ab c")
    ctx, cont = split_pair(tok, context, continuation, 0)
    if context.strip(" "):
        assert ctx + cont == tok.encode(context + continuation)
        assert tok.decode(ctx) == context.rstrip(" ")
    else:  # a context of spaces only: they join the continuation, after the start token
        assert ctx == [0] and tok.decode(cont) == context + continuation
    assert tok.decode(cont).endswith(continuation)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["wandb", "mlflow", "tensorboard"]), min_size=1, max_size=3))
def test_a_tracker_list_reads_alike_from_toml_and_the_command_line(names: list[str]) -> None:
    from_toml = build_train_config({"tracker": names}).tracker
    assert from_toml == tuple(names) == build_train_config({}, {"tracker": ", ".join(names)}).tracker
    assert build_train_config({"tracker": names[0]}).tracker == (names[0],)


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "words.jsonl:2 is not JSON"),
    ('{"context": "a", "choices": ["b"], "answer": 0}', "words.jsonl:2: choices must be a list of at least 2"),
    ('{"context": "a", "choices": ["b", "c"], "answer": 2}', "words.jsonl:2: answer must be the index"),
    ('{"context": 1, "choices": ["b", "c"], "answer": 0}', "words.jsonl:2: context must be a string"),
])
def test_malformed_task_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "words.jsonl"
    path.write_text('{"context": "a", "choices": ["b", "c"], "answer": 0}\n' + line + "\n")
    with pytest.raises(GptlabError, match=message):
        load_choice_task(path)


def test_the_model_goes_back_to_train_mode_and_the_rng_is_untouched(tmp_path: Path, data: Path,
                                                                    task_files: Path) -> None:
    def failing(model, tokenizer, name):  # an lm-eval scorer that draws random numbers, then fails
        torch.rand(3), random.random(), np.random.rand()
        raise RuntimeError("task failed")

    cfg = build_train_config({"eval_tasks": [str(task_files / "words.jsonl"), "some_lm_eval_task"]})
    bench = Benchmarks(cfg, data, failing)
    model = tiny_model(vocab_size=load_tokenizer(data).vocab_size).train()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = torch.rand(2), random.random(), np.random.rand()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    with pytest.raises(RuntimeError, match="task failed"):
        bench.score(model, "run")
    assert model.training
    got = torch.rand(2), random.random(), np.random.rand()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_lm_eval_names_without_a_scorer_and_fsdp_are_refused(data: Path) -> None:
    cfg = build_train_config({"eval_tasks": ["hellaswag"]})
    with pytest.raises(GptlabError, match="lm-eval tasks need a scorer"):
        Benchmarks(cfg, data)
    with pytest.raises(GptlabError, match="fsdp"):
        Benchmarks(cfg, data, sharded=True)


def _train(recipe: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["train", str(recipe), "--data", str(data), "--out", str(out), "--quiet", *extra])


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_benchmarks_has_the_same_weights_and_logs_their_scores(tmp_path: Path, data: Path,
                                                                          task_files: Path) -> None:
    tasks = [str(task_files / "words.jsonl"), str(task_files / "more_words.jsonl")]
    recipe = write_recipe(tmp_path, max_steps=20, dropout=0.1, eval_interval=10, log_interval=5)
    plain, scored = tmp_path / "plain", tmp_path / "scored"
    assert _train(recipe, data, plain) == 0
    assert _train(recipe, data, scored, "--eval-tasks", ",".join(tasks), "--eval-tasks-interval", "8") == 0
    final = "checkpoints/step-0000020/model.safetensors"
    a, b = load_file(plain / final), load_file(scored / final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = _rows(scored)
    assert [r["step"] for r in rows if "eval/core" in r] == [8, 16, 20]  # every 8 steps, and at the end
    losses = {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}  # more rows: 8 and 16 too
    assert {r["step"]: losses[r["step"]] for r in _rows(plain) if "train_loss" in r} == {
        r["step"]: r["train_loss"] for r in _rows(plain) if "train_loss" in r}
    # the last row's scores are the final weights' (scored here from the checkpoint, from scratch)
    model, tok = load_model(scored / "checkpoints/step-0000020")
    again = score_choice_tasks(model.eval(), tok, [load_choice_task(t) for t in tasks])
    assert {k.removeprefix("eval/"): v for k, v in rows[-1].items() if k.startswith("eval/")} == again


def test_lm_eval_tasks_score_as_lm_eval_scores_the_same_examples(tmp_path: Path, data: Path,
                                                                 task_files: Path) -> None:
    """One task two ways, in one run: the built-in .jsonl and an lm-eval task YAML over the same examples
    (lm-eval's own multiple-choice scoring); then lm-eval again from the final checkpoint (`gptlab eval`'s path)."""
    pytest.importorskip("lm_eval")
    from gptlab.evaluation.harness import run_tasks

    yaml = tmp_path / "lm_words.yaml"
    yaml.write_text(f"task: lm_words\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                    f"{task_files / 'words.jsonl'}\n  cache_dir: {tmp_path / 'hf-cache'}\ntest_split: test\n"
                    "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: choices\n"
                    "doc_to_target: answer\ntarget_delimiter: ''\n"
                    "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0, log_interval=5)
    run = tmp_path / "run"
    assert _train(recipe, data, run, "--eval-tasks", f"{task_files / 'words.jsonl'},{yaml}") == 0
    last = _rows(run)[-1]
    assert last["eval/lm_words/acc"] == last["eval/words/acc"]
    assert last["eval/lm_words/acc_norm"] == last["eval/words/acc_norm"]
    out = run_tasks(run / "checkpoints/step-0000010", [str(yaml)], device="cpu")
    assert out["results"]["lm_words"]["acc,none"] == last["eval/lm_words/acc"]


def test_benchmark_errors_are_one_line(tmp_path: Path, data: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = write_recipe(tmp_path, max_steps=10)
    rc = _train(recipe, data, tmp_path / "run", "--eval-tasks", str(tmp_path / "missing.jsonl"))
    assert "missing.jsonl not found" in one_line_error(rc, capsys.readouterr().err)
    rc = _train(recipe, data, tmp_path / "run", "--eval-tasks-interval", "-1")
    assert "eval_tasks_interval must be an integer >= 0" in one_line_error(rc, capsys.readouterr().err)


def test_plot_draws_the_benchmark_scores(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gptlab.inspection.curves import read_curves

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 5, "train_loss": 3.0, "lr": 1e-3, "elapsed_sec": 1.0, "eval/words/acc": 0.25},
            {"step": 10, "val_loss": 2.5, "elapsed_sec": 2.0, "eval/words/acc": 0.5, "eval/core": 0.1}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = read_curves(run)
    assert curve.evals["eval/words/acc"].x == [5.0, 10.0] and curve.evals["eval/words/acc"].y == [0.25, 0.5]
    assert curve.evals["eval/core"].y == [0.1]
    assert main(["plot", str(run), "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_failing_final_benchmark_still_saves_the_weights(tmp_path: Path, data: Path) -> None:
    """Through the Python API, with a scorer of its own for a task name: it fails at the end of the run, which
    raises, but only after the final weights are saved."""
    from gptlab.train import Trainer

    calls = []

    def scorer(model, tokenizer, name):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("the benchmark server went away")
        return {"my_task/acc": 0.5}

    cfg = build_train_config({**TINY_RECIPE, "max_steps": 10, "eval_tasks": ["my_task"], "eval_tasks_interval": 5})
    trainer = Trainer(cfg, data, tmp_path / "run", quiet=True, lm_eval_tasks=scorer)
    with pytest.raises(RuntimeError, match="went away"):
        trainer.run()
    assert calls == ["run", "run"]
    assert (tmp_path / "run" / "checkpoints" / "step-0000010" / "model.safetensors").is_file()
    assert [r["eval/my_task/acc"] for r in _rows(tmp_path / "run") if "eval/my_task/acc" in r] == [0.5]
