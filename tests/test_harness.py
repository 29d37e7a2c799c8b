"""The lm-eval adapter (`gptlab.evaluation.harness`) against lm-eval's own `hf` backend on the same tiny random Llama.

Everything is local: a byte-level BPE tokenizer trained here (with a Llama-style post-processor that puts BOS
first, the case gptlab's own `encode` does not cover), a random 2-layer Llama saved by transformers, and three
tasks whose YAML files and jsonl data are written into a temporary directory: multiple choice (loglikelihood,
acc), documents (loglikelihood_rolling, word_perplexity) and generation (generate_until, exact_match). Some
contexts are longer than the model's 64 positions and one is empty, so truncation and the prefix token are scored.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import corpus_text, hf_llama_dir, one_line_error, tiny_model

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gptlab.checkpoint import save_model  # noqa: E402
from gptlab.cli import main  # noqa: E402
from gptlab.conversion import convert  # noqa: E402
from gptlab.errors import GptlabError  # noqa: E402
from gptlab.evaluation.harness import GptlabLM, run_tasks  # noqa: E402
from gptlab.generation import generate  # noqa: E402
from gptlab.tokenizer import CharTokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures("one_thread")

TASKS = ["tiny_mc", "tiny_docs", "tiny_gen"]
BLOCK = 64
TEXT = corpus_text(40_000)
LINES = [line for line in TEXT.splitlines() if len(line) > 20]


# --- the model, its tokenizer and the tasks ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama (n_layer 2, n_embd 32) with a 400-token BPE whose encoding starts with <s>."""
    return hf_llama_dir(tmp_path_factory.mktemp("llama"), TEXT, BLOCK)


@pytest.fixture(scope="module")
def ckpt_dir(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "ckpt"
    convert(hf_dir, out, to="gptlab")
    return out


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tasks")
    cache = d / "hf-datasets-cache"
    mc = [{"question": q, "choices": [w.split()[0] for w in LINES[i + 1 : i + 4]], "label": i % 3}
          for i, q in enumerate(LINES[:5])]
    mc.append({"question": "", "choices": ["First", "Citizen", "king"], "label": 0})  # empty context
    mc.append({"question": " ".join(LINES[10:25]), "choices": ["yes", "no", "perhaps"], "label": 1})  # > 64 tokens
    docs = [{"text": TEXT[:120]}, {"text": TEXT[200:700]}, {"text": TEXT[1000:2200]}]
    gen = [{"question": q, "answer": "the"} for q in LINES[30:35]] + [{"question": " ".join(LINES[40:60]),
                                                                     "answer": "x"}]
    common = "dataset_path: json\ntest_split: test\n"

    def source(name: str, rows: list[dict]) -> str:
        return (f"dataset_kwargs:\n  data_files:\n    test: {_jsonl(d / f'{name}.jsonl', rows)}\n"
                f"  cache_dir: {cache}\n")

    (d / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}{source('mc', mc)}fewshot_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    (d / "tiny_docs.yaml").write_text(
        f"task: tiny_docs\n{common}{source('docs', docs)}output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
        "  - metric: bits_per_byte\n")
    (d / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}{source('gen', gen)}output_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['e', '\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return d


def _evaluate(model: str, model_args: str, tasks_dir: Path, batch_size: int = 4) -> dict:
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=batch_size,
                                   task_manager=manager, log_samples=True)


@pytest.fixture(scope="module")
def hf_scores(hf_dir: Path, tasks_dir: Path) -> dict:
    return _evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu", tasks_dir)


@pytest.fixture(scope="module")
def ours(hf_dir: Path, tasks_dir: Path) -> dict:
    return _evaluate("gptlab", f"pretrained={hf_dir},dtype=float32,device=cpu", tasks_dir)


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def assert_same_scores(a: dict, b: dict) -> None:
    """Per request: log-likelihoods to 1e-5, is_greedy and generated text equal; per task: acc and exact_match
    equal, perplexities to a relative 1e-5."""
    for (x,), (y,) in zip(sum(_responses(a, "tiny_mc"), []), sum(_responses(b, "tiny_mc"), []), strict=True):
        assert x[0] == pytest.approx(y[0], abs=1e-5) and x[1] == y[1]
    for x, y in zip(_responses(a, "tiny_docs"), _responses(b, "tiny_docs"), strict=True):
        assert x[0][0] == pytest.approx(y[0][0], abs=1e-5)
    assert _responses(a, "tiny_gen") == _responses(b, "tiny_gen")
    ra, rb = a["results"], b["results"]
    assert ra["tiny_mc"]["acc,none"] == rb["tiny_mc"]["acc,none"]
    assert ra["tiny_gen"]["exact_match,none"] == rb["tiny_gen"]["exact_match,none"]
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert ra["tiny_docs"][metric] == pytest.approx(rb["tiny_docs"][metric], rel=1e-5)


# --- scores: the same as lm-eval's hf backend --------------------------------------------------------------------
def test_scores_match_the_hf_backend(ours: dict, hf_scores: dict) -> None:
    assert_same_scores(ours, hf_scores)
    assert len(ours["samples"]["tiny_mc"]) == 7 and len(ours["samples"]["tiny_gen"]) == 6
    assert math.isfinite(ours["results"]["tiny_docs"]["word_perplexity,none"])
    texts = [r[0][0] for r in _responses(ours, "tiny_gen")]
    assert any(texts) and not any("e" in t or "\n" in t for t in texts)  # cut at the stop strings


def test_a_gptlab_checkpoint_scores_the_same(ckpt_dir: Path, tasks_dir: Path, hf_scores: dict) -> None:
    assert_same_scores(_evaluate("gptlab", f"pretrained={ckpt_dir}", tasks_dir), hf_scores)


def test_batch_size_does_not_change_scores(hf_dir: Path, tasks_dir: Path, ours: dict) -> None:
    assert_same_scores(_evaluate("gptlab", f"pretrained={hf_dir}", tasks_dir, batch_size=1), ours)


def test_single_requests_match_the_hf_backend(hf_dir: Path) -> None:
    """Request by request, including the edge cases: an empty context (the prefix token), trailing spaces,
    a context far longer than the model's 64 positions, and a continuation that is the greedy one."""
    from lm_eval.models.huggingface import HFLM

    theirs = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=3)
    ours = GptlabLM(hf_dir, device="cpu", batch_size=3)
    assert ours.tok_encode("First Citizen") == theirs.tok_encode("First Citizen")
    assert ours.tok_encode("<s>First") == theirs.tok_encode("<s>First")  # no second BOS
    pairs = [("", "First Citizen"), ("Before we proceed  ", "any further"), (TEXT[:1500], " hear me speak."),
             ("Speak, speak.", "\nAll:")]
    requests = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    context = ours.tok_encode("First Citizen:\n")  # + its greedy continuation, as token ids
    greedy = generate(ours.model, torch.tensor([context]), 6, temperature=0)[0, len(context):].tolist()
    for lm in (ours, theirs):
        ll = lm.loglikelihood(requests) + lm._loglikelihood_tokens([(None, context, greedy)])
        if lm is ours:
            ours_ll = ll
    for (a, greedy_a), (b, greedy_b) in zip(ours_ll, ll, strict=True):
        assert a == pytest.approx(b, abs=1e-5) and greedy_a == greedy_b
    assert ours_ll[-1][1] is True and not ours_ll[0][1]
    docs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([TEXT[:900], "Hi", ""])]
    for a, b in zip(ours.loglikelihood_rolling(docs), theirs.loglikelihood_rolling(docs), strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-5)


def test_jsonl_choice_tasks_score_as_the_hf_backend(hf_dir: Path) -> None:
    """A training run's .jsonl multiple-choice tasks (`evaluation.tasks`) on a tokenizer that puts BOS first: each
    choice's log-likelihood is the hf backend's for the same (context, choice), the context after BOS, an empty
    one as BOS, trailing whitespace (a newline too) moved to the choice."""
    from lm_eval.models.huggingface import HFLM

    from gptlab.evaluation.tasks import continuation_scores, split_pair, start_token

    theirs = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=2)
    ours = GptlabLM(hf_dir, device="cpu")
    pairs = [("", "First Citizen"), ("Before we proceed\n", "any further"), ("Speak, speak. ", "All"),
             ("First Citizen:", " You are all resolved")]
    expected = [s for s, _ in theirs.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])]
    start = start_token(ours.tok)
    scores = continuation_scores(ours.model, [split_pair(ours.tok, c, x, start) for c, x in pairs], BLOCK)
    assert [s for s, _ in scores] == pytest.approx(expected, abs=1e-5)


# --- errors ---------------------------------------------------------------------------------------------------
def test_model_errors(tmp_path: Path, hf_dir: Path) -> None:
    save_model(tmp_path / "bare", tiny_model())
    with pytest.raises(GptlabError, match="has no tokenizer"):
        GptlabLM(tmp_path / "bare")
    with pytest.raises(GptlabError, match="block_size"):
        GptlabLM(hf_dir, max_length=BLOCK + 1)
    with pytest.raises(GptlabError, match="batch_size"):
        GptlabLM(hf_dir, batch_size="auto")
    lm = GptlabLM(hf_dir)
    with pytest.raises(GptlabError, match="max_gen_toks 64"):
        lm.generate_until([Instance("generate_until", {}, ("Hi", {"until": ["."], "max_gen_toks": BLOCK}), 0)])


def test_a_char_model_scores_contexts_but_needs_a_start_token_for_documents(tmp_path: Path) -> None:
    save_model(tmp_path / "char", tiny_model(), CharTokenizer.from_text(TEXT))
    lm = GptlabLM(tmp_path / "char", batch_size=2)
    [(logprob, _)] = lm.loglikelihood([Instance("loglikelihood", {}, ("First", " Citizen"), 0)])
    assert logprob < 0
    [text] = lm.generate_until([Instance("generate_until", {}, ("First", {"until": ["\n"], "max_gen_toks": 5}), 0)])
    assert len(text) <= 5 and "\n" not in text
    with pytest.raises(GptlabError, match="neither a BOS nor an end-of-text token"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("First Citizen",), 0)])
    with pytest.raises(GptlabError, match="add_bos_token: .* has no BOS token"):  # not a None id in the rows
        GptlabLM(tmp_path / "char", add_bos_token=True)
    assert GptlabLM(tmp_path / "char", add_bos_token=False).tok_encode("First") == lm.tok_encode("First")


# --- run_tasks and `gptlab eval --tasks` --------------------------------------------------------------------------
def test_run_tasks_is_the_same_evaluation(ckpt_dir: Path, tasks_dir: Path, ours: dict) -> None:
    out = run_tasks(ckpt_dir, TASKS, include_path=tasks_dir, batch_size=4, device="cpu", log_samples=True)
    assert_same_scores(out, ours)


def test_eval_cli_prints_a_table_and_json(ckpt_dir: Path, tasks_dir: Path, capsys: pytest.CaptureFixture) -> None:
    base = ["eval", str(ckpt_dir), "--tasks", "tiny_mc,tiny_docs", "--include-path", str(tasks_dir), "--limit", "3"]
    assert main([*base, "--num-fewshot", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["task", "metric", "value", "stderr"]
    assert {tuple(line.split()[:2]) for line in lines[1:]} >= {("tiny_mc", "acc"), ("tiny_docs", "word_perplexity"),
                                                                ("tiny_docs", "bits_per_byte")}
    assert main([*base, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"tiny_mc", "tiny_docs"} and 0 <= results["tiny_mc"]["acc,none"] <= 1


@pytest.mark.parametrize("args, message", [
    (["--tasks", "tiny_mc", "--data", "somewhere"], "not both"),
    ([], "not a gptlab run that records its data directory"),  # a checkpoint outside a run: nothing to default to
    (["--tasks", "tiny_mc,no_such_task"], "unknown lm-eval task(s): no_such_task"),
])
def test_eval_cli_errors_are_one_line(args: list[str], message: str, ckpt_dir: Path, tasks_dir: Path,
                                      capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # a name not under --include-path is looked up among lm-eval's own tasks; indexing those takes ~10 s, so here
    # the index is of --include-path alone (the slow test below runs the whole index)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))
    include = ["--include-path", str(tasks_dir)] if "--tasks" in args else []  # without --tasks it is refused
    rc = main(["eval", str(ckpt_dir), *include, *args])
    assert message in one_line_error(rc, capsys.readouterr().err)


def test_a_task_file_that_is_not_yaml_is_named(ckpt_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A training run's .jsonl multiple-choice file given to --tasks: lm-eval reads task files as YAML, so it failed
    as an 'internal error' of YAML's parser."""
    task = tmp_path / "words.jsonl"
    _jsonl(task, [{"context": "First", "choices": [" Citizen", " king"], "answer": 0}])
    rc = main(["eval", str(ckpt_dir), "--tasks", str(task), "--include-path", str(tmp_path)])
    err = one_line_error(rc, capsys.readouterr().err)
    assert f"{task}: not a task YAML file" in err and "internal error" not in err


def test_the_builtin_task_index_is_built_once_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Indexing lm-eval's built-in tasks takes ~10 s; every later check of a name (and run) reuses the index."""
    from gptlab.evaluation import harness

    built = []

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        built.append(kwargs)
        return TaskManager(*args, include_defaults=False, **kwargs)  # the index of no folder: quick

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", counting)
    harness._builtin_tasks.cache_clear()
    try:
        for _ in range(3):
            with pytest.raises(GptlabError, match="unknown lm-eval task"):
                harness._task_manager(["no_such_task"], None)
        assert built == [{}]
    finally:
        harness._builtin_tasks.cache_clear()  # the other tests get lm-eval's real index


def test_eval_cli_without_lm_eval(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    rc = main(["eval", str(ckpt_dir), "--tasks", "hellaswag"])
    assert one_line_error(rc, capsys.readouterr().err) == "error: lm-eval is not installed: pip install 'gptlab[eval]'"


def test_a_task_whose_data_cannot_be_fetched_says_what_to_do_offline(
    ckpt_dir: Path, tasks_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Offline, datasets' "Couldn't reach 'Rowan/hellaswag' on the Hub" was the whole line: nothing on what to do."""

    def offline(**kwargs):  # noqa: ANN003, ANN202 - as datasets raises it with no network
        raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))
    rc = main(["eval", str(ckpt_dir), "--include-path", str(tasks_dir), "--tasks", "tiny_mc"])
    line = one_line_error(rc, capsys.readouterr().err)
    assert "Couldn't reach 'Rowan/hellaswag'" in line and "offline" in line and "--include-path" in line, line


@pytest.mark.slow  # lm-eval's own command line indexes all of its ~15k built-in tasks first (~10 s)
def test_lm_eval_command_line_with_the_gptlab_model(ckpt_dir: Path, tasks_dir: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "gptlab.evaluation.harness", "--model", "gptlab", "--model_args",
         f"pretrained={ckpt_dir}", "--tasks", "tiny_mc", "--include_path", str(tasks_dir), "--limit", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "tiny_mc" in run.stdout and "acc" in run.stdout
