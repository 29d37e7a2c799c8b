"""Training on sharded data and on mixtures: shards give the single file's batches, a mixture draws its rows'
sources by weight as a pure function of (seed, step), resume after SIGKILL is bit-identical on a mixture of two
shard sets, and the loader's time per step is logged."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import corpus_text, one_line_error, write_recipe
from safetensors.torch import load_file

from gptlab.checkpoint import list_step_checkpoints
from gptlab.cli import main
from gptlab.data import prepare
from gptlab.data.dataset import parse_sources, recipe_sources
from gptlab.errors import GptlabError
from gptlab.train.batches import Mixture, TokenSplit, load_train_data, step_batch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    text = corpus_text(60_000)
    (root / "a.txt").write_text(text, encoding="utf-8")
    (root / "b.txt").write_text(text[20_000:50_000].upper(), encoding="utf-8")
    out = {"plain": root / "plain", "a": root / "a", "b": root / "b"}
    prepare([root / "a.txt"], out["plain"], tokenizer="char")
    prepare([root / "a.txt"], out["a"], tokenizer="char", shard_tokens=7000)
    (root / "tok.txt").write_text(text + text.upper(), encoding="utf-8")
    prepare([root / "tok.txt"], root / "tok", tokenizer="char")
    prepare([root / "b.txt"], out["b"], tokenizer_from=root / "tok", tokenizer=None, shard_tokens=5000)
    prepare([root / "a.txt"], root / "a2", tokenizer_from=root / "tok", tokenizer=None,
            shard_tokens=6000)
    out["a2"] = root / "a2"
    return out


def test_shards_give_the_single_files_batches(dirs: dict[str, Path]) -> None:
    plain, sharded = TokenSplit.load(dirs["plain"], "train"), TokenSplit.load(dirs["a"], "train")
    for step in range(20):
        a, b = step_batch(plain, 3, step, 8, 64), step_batch(sharded, 3, step, 8, 64)
        assert np.array_equal(a.windows, b.windows)


def test_a_mixture_draws_rows_by_weight_from_its_sources(dirs: dict[str, Path]) -> None:
    mix, seq = load_train_data([(dirs["a2"], 0.7), (dirs["b"], 0.3)], 32)
    assert isinstance(mix, Mixture) and seq == 32
    a_tokens, b_tokens = (np.asarray(s.tokens[0 : len(s.tokens)]) for s in mix.sources)
    # b is upper case: a row from b has no lower-case letter (its ids are those of the capitals), a's has some
    lower = np.array([c.islower() for c in json.loads((dirs["a2"] / "tokenizer_meta.json").read_text())["chars"]])
    from_b = 0
    for step in range(100):
        batch = step_batch(mix, 5, step, 16, 32)
        assert np.array_equal(batch.windows, step_batch(mix, 5, step, 16, 32).windows)  # pure in (seed, step)
        for row in batch.windows:
            source = b_tokens if not lower[row].any() else a_tokens
            hits = np.flatnonzero(source[: len(source) - 32] == row[0])
            assert any(np.array_equal(source[h : h + 33], row) for h in hits)  # a window of its source
            from_b += source is b_tokens
    n = 100 * 16
    assert abs(from_b / n - 0.3) < 4 * (0.3 * 0.7 / n) ** 0.5


def test_mixture_sources_must_share_a_tokenizer(dirs: dict[str, Path]) -> None:
    with pytest.raises(GptlabError, match="prepared with different tokenizers"):
        load_train_data([(dirs["a"], 1.0), (dirs["b"], 1.0)], 32)


@pytest.mark.parametrize("spec, expected", [
    ("a:0.7,b:0.3", [("a", 0.7), ("b", 0.3)]), ("a", [("a", 1.0)]), ("a,b:2", [("a", 1.0), ("b", 2.0)]),
])
def test_data_specs_parse(spec: str, expected: list) -> None:
    assert parse_sources(spec) == [(Path(d), w) for d, w in expected]


@pytest.mark.parametrize("spec, message", [("a:0,b:1", "must be a positive number"), ("a,a", "names a directory twice"),
                                           (":0.5", "an empty directory name"), ("a:-1", "positive")])
def test_bad_data_specs(spec: str, message: str) -> None:
    with pytest.raises(GptlabError, match=message):
        parse_sources(spec)


def _with_data_table(recipe: Path, table: str) -> Path:
    recipe.write_text(recipe.read_text() + f"\n[data]\n{table}\n")
    return recipe


def test_a_recipes_data_table_trains_as_the_same_data_flag(tmp_path: Path, dirs: dict[str, Path]) -> None:
    """`[data]` "A" = 0.7, "B" = 0.3 is `--data A:0.7,B:0.3`: the same pairs, and the run's weights bit for bit;
    --data, given, wins over the table."""
    table = f'"{dirs["a2"]}" = 0.7\n"{dirs["b"]}" = 0.3'
    settings = dict(max_steps=3, eval_interval=3, log_interval=1, warmup_steps=1)
    recipe = _with_data_table(write_recipe(tmp_path, **settings), table)
    assert recipe_sources(recipe) == parse_sources(f"{dirs['a2']}:0.7,{dirs['b']}:0.3")
    plain = write_recipe(tmp_path, name="plain.toml", **settings)
    assert main(["train", str(recipe), "--out", str(tmp_path / "table"), "--quiet"]) == 0
    assert _train(plain, f"{dirs['a2']}:0.7,{dirs['b']}:0.3", tmp_path / "flag") == 0
    assert _train(recipe, str(dirs["a2"]), tmp_path / "override") == 0
    weights = [load_file(list_step_checkpoints(tmp_path / run)[-1] / "model.safetensors")
               for run in ("table", "flag", "override")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


@pytest.mark.parametrize("table, message", [
    ('"a" = 0', "weight of a must be a positive number"), ('"a" = "x"', "weight of a must be a number"),
    ('"a" = true', "must be a number"), ('"a" = nan', "positive number"), ('"a" = inf', "positive number"),
    ('"" = 1', "an empty directory name"), ('"a" = 1\n"./a" = 1', "names a directory twice"),
    ('a = { b = 1 }', "must be a number"), ("", "must be a table"),
])
def test_a_bad_data_table_is_one_line_naming_the_recipe(tmp_path: Path, table: str, message: str,
                                                      capsys: pytest.CaptureFixture) -> None:
    recipe = _with_data_table(write_recipe(tmp_path), table)
    with pytest.raises(GptlabError, match=message) as e:
        recipe_sources(recipe)
    assert str(recipe) in str(e.value) and "\n" not in str(e.value)
    rc = main(["train", str(recipe), "--out", str(tmp_path / "run")])
    assert str(recipe) in one_line_error(rc, capsys.readouterr().err)


def test_no_data_anywhere_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["train", str(write_recipe(tmp_path)), "--out", str(tmp_path / "run")])
    assert "[data] table" in one_line_error(rc, capsys.readouterr().err)


def _train(recipe: Path, data: str, out: Path, *extra: str) -> int:
    return main(["train", str(recipe), "--data", data, "--out", str(out), "--quiet", *extra])


def test_sigkill_resume_on_a_mixture_of_shard_sets_is_bit_identical(tmp_path: Path, dirs: dict[str, Path]) -> None:
    from test_train import _wait_for, cli_subprocess

    recipe = write_recipe(tmp_path, max_steps=60, checkpoint_interval=10, eval_interval=30, dropout=0.1,
                          log_interval=10)
    data = f"{dirs['a2']}:0.6,{dirs['b']}:0.4"
    run = tmp_path / "run"
    proc = cli_subprocess("train", str(recipe), "--data", data, "--out", str(run), "--quiet")
    _wait_for(lambda: len(list_step_checkpoints(run)) >= 1, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert int(list_step_checkpoints(run)[-1].name.split("-")[1]) < 60
    assert _train(recipe, data, run, "--resume") == 0
    ref = tmp_path / "ref"
    assert _train(recipe, data, ref) == 0
    final = load_file(run / "checkpoints" / "step-0000060" / "model.safetensors")
    final_ref = load_file(ref / "checkpoints" / "step-0000060" / "model.safetensors")
    assert final.keys() == final_ref.keys() and all(torch.equal(final[k], final_ref[k]) for k in final)
    rows = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loader_ms"] >= 0 for r in rows if "train_loss" in r)
    state = json.loads((list_step_checkpoints(ref)[-1] / "state.json").read_text())
    assert state["data_sources"] == [[str(dirs["a2"]), 0.6], [str(dirs["b"]), 0.4]]


def test_resuming_on_other_data_is_refused(tmp_path: Path, dirs: dict[str, Path], capsys) -> None:
    recipe = write_recipe(tmp_path, max_steps=20, checkpoint_interval=10, eval_interval=0)
    run = tmp_path / "run"
    assert _train(recipe, f"{dirs['a2']}:0.6,{dirs['b']}:0.4", run, "--max-steps", "10") == 0
    capsys.readouterr()
    rc = _train(recipe, f"{dirs['a2']}:0.5,{dirs['b']}:0.5", run, "--resume")
    assert "its batches would differ" in one_line_error(rc, capsys.readouterr().err)


# --- the document mask ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position, kw", [("learned", {}), ("rope", {"sliding_window": 5}), ("rope", {})])
def test_packed_documents_compute_as_if_each_ran_alone(position: str, kw: dict) -> None:
    from helpers import tiny_model

    from gptlab.train.batches import document_ids

    model = tiny_model(position, vocab_size=50, **kw)
    eot = 0
    lengths = [[5, 1, 9, 7], [22]]  # a one-token document (its end-of-text alone) too
    rows = []
    gen = torch.Generator().manual_seed(0)
    for row in lengths:
        docs = [torch.cat([torch.randint(1, 50, (n - 1,), generator=gen), torch.tensor([eot])]) for n in row]
        rows.append(docs)
    x = torch.stack([torch.cat(docs) for docs in rows])
    documents = document_ids(x, eot)
    assert documents[0].tolist() == [0] * 5 + [1] + [2] * 9 + [3] * 7
    logits, _ = model(x, documents=documents)
    plain, _ = model(x)
    for b, docs in enumerate(rows):
        start = 0
        for doc in docs:
            alone, _ = model(doc[None])
            torch.testing.assert_close(logits[b, start : start + len(doc)], alone[0], rtol=1e-5, atol=1e-5)
            start += len(doc)
    assert not torch.allclose(logits[0, 5:], plain[0, 5:], atol=1e-3)  # the mask changed what later documents see
    torch.testing.assert_close(logits[1], plain[1], rtol=1e-5, atol=1e-5)  # one document: plain causal attention


def test_training_with_a_document_mask(tmp_path: Path, dirs: dict[str, Path], capsys) -> None:
    from helpers import hf_tokenizer_dir, write_jsonl

    tok = hf_tokenizer_dir(tmp_path / "tok", {})
    docs = [{"text": corpus_text(40_000)[i * 300 : i * 300 + 40 + i % 200]} for i in range(120)]
    data = tmp_path / "docs"
    prepare([write_jsonl(tmp_path / "d.jsonl", docs)], data, tokenizer=None, tokenizer_from=tok)
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0, document_mask=True)
    assert _train(recipe, str(data), tmp_path / "run") == 0
    losses = [json.loads(r)["train_loss"] for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "train_loss" in r]
    assert losses and all(np.isfinite(losses))
    # validation scores the documents as training computes them, each alone: the val loss is the one of the
    # model fed each window with its documents' ids (it was the plain causal model's, across documents)
    from gptlab import load_model
    from gptlab.train.batches import TokenSplit, document_ids

    model, _ = load_model(tmp_path / "run" / "checkpoints" / "step-0000010")
    val, T = TokenSplit.load(data, "val").tokens, model.config.block_size
    ids = torch.from_numpy(np.asarray(val[: len(val)]).astype(np.int64))
    eot = json.loads((data / "meta.json").read_text())["eot_id"]
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, T):
            x, y = ids[start : start + T][None], ids[start + 1 : start + T + 1][None]
            x = x[:, : y.shape[1]]
            total += float(model(x, y, reduction="sum", documents=document_ids(x, eot))[1])
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    assert logged == pytest.approx(total / (len(ids) - 1), rel=1e-5)
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0  # `gptlab eval` scores the run as it trained
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["document_mask"] and scored["val_loss"] == pytest.approx(logged, rel=1e-5)
    rc = _train(recipe, str(dirs["plain"]), tmp_path / "run2")  # char data: no end-of-text between documents
    assert "document_mask = true needs documents ended by end-of-text" in one_line_error(rc, capsys.readouterr().err)


def test_a_document_mask_checks_every_source_of_a_mixture(tmp_path: Path, capsys) -> None:
    from helpers import hf_tokenizer_dir, write_jsonl

    tok = hf_tokenizer_dir(tmp_path / "tok", {})
    docs = [{"text": corpus_text(20_000)[i * 300 : i * 300 + 200]} for i in range(60)]
    prepare([write_jsonl(tmp_path / "d.jsonl", docs)], tmp_path / "docs", tokenizer=None, tokenizer_from=tok)
    chats = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]}
             for i in range(40)]
    prepare([write_jsonl(tmp_path / "c.jsonl", chats)], tmp_path / "chats", tokenizer=None, tokenizer_from=tok,
            block_size=32)  # examples not ended by end-of-text: no documents to mask
    recipe = write_recipe(tmp_path, max_steps=10, eval_interval=0, document_mask=True)
    rc = _train(recipe, f"{tmp_path / 'docs'}:0.5,{tmp_path / 'chats'}:0.5", tmp_path / "run")
    err = one_line_error(rc, capsys.readouterr().err)
    assert "document_mask = true needs documents ended by end-of-text" in err and str(tmp_path / "chats") in err
