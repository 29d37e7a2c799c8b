"""Looking inside: attention weights, the trace, the logit lens, training curves, their pictures, the commands'
bad input, and the web page's JSON endpoints (the page itself in a browser: test_ui_browser.py)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import ByteTokenizer, attention_patterns, hf_llama_dir, one_line_error, tiny_model

from gptlab import GPTConfig
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.flops import flops_per_token, parameter_breakdown
from gptlab.inspection import attention_map, logit_lens, read_curves, trace
from gptlab.inspection.lens import stage_logits
from gptlab.inspection.trace import config_of, numeric, sizes
from gptlab.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "First Citizen: we are accounted poor"
CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ:.,!?\n"


@pytest.fixture(scope="module")
def char_tok():
    return CharTokenizer.from_text(CHARS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, char_tok):
    """A tiny grouped-query model (4 query heads share 2 key/value heads) saved with a char tokenizer."""
    path = tmp_path_factory.mktemp("insp") / "ckpt"
    save_model(path, tiny_model(vocab_size=char_tok.vocab_size), char_tok)
    return path


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk: proof that the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# --- attention ----------------------------------------------------------------------------------------------------
MODELS = {
    "gqa-rope": dict(n_head=4, n_kv_head=2),
    "mha-learned": dict(position="learned", n_kv_head=4),
    "sliding-softcap": dict(sliding_window=5, attn_softcap=20.0, n_kv_head=1),
}


@pytest.mark.parametrize("kw", MODELS.values(), ids=MODELS.keys())
def test_attention_json_is_causal_sums_to_one_and_equals_the_model(kw):
    model = tiny_model(vocab_size=256, **{k: v for k, v in kw.items() if k != "position"},
                       position=kw.get("position", "rope"))
    tok = ByteTokenizer()
    amap = attention_map(model, tok, TEXT)
    data = json.loads(json.dumps(amap.to_json()))
    T = len(TEXT)
    assert data["tokens"] == list(TEXT) and data["token_ids"] == list(TEXT.encode())
    assert (data["n_layer"], data["n_head"]) == (model.config.n_layer, model.config.n_head)
    with torch.no_grad():
        _, reference = attention_patterns(model, torch.tensor([list(TEXT.encode())]))
    for layer in data["layers"]:
        for head in layer["heads"]:
            w = torch.tensor(head["weights"])
            assert w.shape == (T, T)
            assert torch.all(w.triu(diagonal=1) == 0)  # causal: nothing above the diagonal
            torch.testing.assert_close(w.sum(-1), torch.ones(T), atol=1e-5, rtol=0)
            torch.testing.assert_close(w, reference[layer["layer"]][0, head["head"]], atol=1e-6, rtol=0)
            if kw.get("sliding_window"):  # and nothing outside the window
                assert torch.all(w.tril(diagonal=-kw["sliding_window"]) == 0)


@pytest.mark.slow  # transformers' import and a tokenizer's training: slow on a busy machine
def test_attention_equals_transformers_eager_attentions_for_a_gqa_llama(tmp_path):
    """An independent reference: transformers' own attention weights of the same Llama (1 key/value head)."""
    transformers = pytest.importorskip("transformers")
    from gptlab.loading import load_model

    directory = hf_llama_dir(tmp_path / "llama", TEXT * 40)
    model, tok = load_model(directory)
    amap = attention_map(model, tok, TEXT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf(torch.tensor([amap.token_ids]), output_attentions=True)
    assert amap.weights.shape[:2] == (2, 2)
    torch.testing.assert_close(amap.weights, torch.stack([a[0] for a in out.attentions]), atol=1e-5, rtol=1e-4)
    assert config_of(str(directory)) == model.config  # trace reads a Hugging Face directory's config alone


def test_attention_select_and_ranges(char_tok):
    amap = attention_map(tiny_model(vocab_size=char_tok.vocab_size), char_tok, "abc")
    assert amap.select(1, 2).shape == (3, 3) and amap.select(1, None).shape == (4, 3, 3)
    torch.testing.assert_close(amap.select(None, None)[0], amap.weights[0].mean(0))
    with pytest.raises(GptlabError, match=r"--layer 2 is out of range: this model has layers 0\.\.1"):
        amap.select(2, None)
    with pytest.raises(GptlabError, match="empty"):
        attention_map(tiny_model(vocab_size=char_tok.vocab_size), char_tok, "")


# --- trace --------------------------------------------------------------------------------------------------------
TRACE_CONFIGS = {
    "gpt2-like": dict(norm="layernorm", bias=True, position="learned", mlp="gelu", block="pre", n_kv_head=4),
    "llama-gqa-qknorm": dict(mlp="swiglu", n_kv_head=2, qk_norm=True, qk_norm_weight=True, tie_embeddings=False),
    "neox-parallel": dict(block="parallel", norm="layernorm", tie_embeddings=False, n_kv_head=4),
    "gptj-shared-norm": dict(block="parallel", shared_norm=True, norm="layernorm", n_kv_head=4),
    "gemma-sandwich": dict(block="sandwich", mlp="geglu", norm_unit_offset=True, scale_embeddings=True,
                           sliding_window=5, global_layer_every=2, attn_softcap=50.0, logit_softcap=30.0),
    "post-norm": dict(block="post", norm="layernorm", mlp="relu2", n_kv_head=1),
    "pocket": dict(embedding_norm=True, norm_weight=False, qk_norm=True, n_kv_head=2),
    "token-shift": dict(norm="layernorm", token_shift=True, logit_softcap=15.0),
}


@pytest.mark.parametrize("kw", TRACE_CONFIGS.values(), ids=TRACE_CONFIGS.keys())
def test_trace_shapes_params_and_flops_agree_with_the_model(kw):
    config = GPTConfig.preset("tiny", block_size=32, vocab_size=97, n_layer=3, **kw)
    B, T = 2, 12
    rows = trace(config, T, B)
    dims = sizes(config, B, T)
    # every module row's output shape is what that module really outputs in a forward
    model = tiny_model(block_size=32, vocab_size=97, n_layer=3, **{k: v for k, v in kw.items() if k != "position"},
                       position=kw.get("position", "rope"))
    seen: dict[str, tuple[int, ...]] = {}

    def record(name: str):  # noqa: ANN202
        def hook(module, inputs, out) -> None:  # noqa: ANN001
            seen.setdefault(name, tuple((out[0] if isinstance(out, tuple) else out).shape))
        return hook

    for name, module in model.named_modules():
        module.register_forward_hook(record(name))
    with torch.no_grad():
        _, attentions = attention_patterns(model, torch.randint(0, 97, (B, T)))
    named = [r for r in rows if r.module and r.module in seen]
    assert {r.module for r in named} >= {"transformer.wte", "transformer.h.0.attn.c_attn", "lm_head"}
    for r in named:
        assert numeric(r.shape_out, dims) == seen[r.module], r
    head_split = next(r for r in rows if r.step.startswith("scores"))
    assert numeric(head_split.shape_in, dims) == (B, config.n_head, T, config.head_size)
    assert numeric(head_split.shape_out, dims) == tuple(attentions[0].shape)
    # parameters: each once, the same total as the model and parameter_breakdown; FLOPs as gptlab.flops counts
    assert sum(r.params for r in rows) == parameter_breakdown(config)["total"] == model.num_parameters()
    assert sum(r.flops for r in rows) == pytest.approx(flops_per_token(config, T, training=False) * B * T)


def test_trace_of_the_largest_preset_runs_on_meta():
    config = GPTConfig.preset("gpt-neox-20b")
    rows = trace(config, 2048, 8)
    assert sum(r.params for r in rows) == parameter_breakdown(config)["total"]
    assert sum(r.flops for r in rows) == pytest.approx(flops_per_token(config, 2048, training=False) * 8 * 2048)


def test_trace_cli_table_mask_and_json(capsys, checkpoint):
    assert main(["trace", "gpt2", "--seq-len", "4", "--mask"]) == 0
    out = capsys.readouterr().out
    assert "(B, T, C)" in out and "(B, nh, T, hs)" in out and f"{124_439_808:,}" in out
    assert "1 0 0 0\n1 1 0 0\n1 1 1 0\n1 1 1 1" in out
    assert main(["trace", str(checkpoint), "--json", "--batch", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sizes"]["B"] == 3 and data["total"]["params"] == parameter_breakdown(
        GPTConfig.from_dict(data["config"]))["total"]


# --- logit lens ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(block="post", norm="layernorm"), dict(logit_softcap=5.0)],
                         ids=["pre", "post", "softcap"])
def test_lens_last_layer_is_the_models_logits(kw, char_tok):
    model = tiny_model(vocab_size=char_tok.vocab_size, **kw)
    ids = char_tok.encode("To be or not")
    stages = list(stage_logits(model, ids))
    assert len(stages) == model.config.n_layer + 1
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    torch.testing.assert_close(stages[-1], logits[0], atol=0, rtol=0)
    result = logit_lens(model, char_tok, "To be or not", k=4)
    top = logits[0].softmax(-1).topk(4)
    torch.testing.assert_close(result.probs[-1], top.values)
    assert torch.equal(result.ids[-1], top.indices)
    data = result.to_json(char_tok)
    assert data["layers"] == ["embeddings", "layer 0", "layer 1"] and len(data["top"][0]) == len(ids)
    assert data["top"][-1][0][0]["token"] == char_tok.decode([int(top.indices[0, 0])])


# --- curves and pictures ------------------------------------------------------------------------------------------
def fake_run(root, name, rows, batch=4, block=16):
    run = root / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"train": {"batch_size": batch}, "model": {"block_size": block}}
    (run / "config.resolved.json").write_text(json.dumps(config))
    return run


def test_curves_with_and_without_val_rows(tmp_path):
    train_only = fake_run(tmp_path, "a", [{"step": s, "train_loss": 3 - s / 10, "lr": 1e-3, "elapsed_sec": s / 2}
                                          for s in (5, 10, 15)])
    both = fake_run(tmp_path, "b", [{"step": 10, "train_loss": 2.5, "lr": 1e-3, "elapsed_sec": 1.0, "val_loss": 2.6},
                                    {"step": 20, "val_loss": 2.4, "elapsed_sec": 2.0}])
    a = read_curves(train_only)
    assert a.name == "a" and a.train_loss.x == [5, 10, 15] and a.val_loss.x == [] and a.lr.y == [1e-3] * 3
    b = read_curves(both, x="tokens")
    assert b.val_loss.x == [10 * 64, 20 * 64] and b.train_loss.y == [2.5]
    assert read_curves(both, x="time").val_loss.x == [1.0, 2.0]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(GptlabError, match="has no metrics yet"):
        read_curves(empty)


def test_plot_cli_overlays_runs_into_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    runs = [fake_run(tmp_path, n, [{"step": s, "train_loss": 3 - s / 10 * i, "lr": s * 1e-4, "elapsed_sec": s}
                                   for s in (5, 10)]) for i, n in enumerate(("x", "y"), 1)]
    out = tmp_path / "curves.png"
    assert main(["plot", *map(str, runs), "-o", str(out), "--x", "tokens"]) == 0
    assert png_size(out) == (800, 450)


@pytest.mark.parametrize("layer, head, size", [(0, 1, (420, 420)), (1, None, (1280, 320)), (None, None, (640, 320)),
                                               (None, 3, (640, 320))])
def test_attention_cli_writes_pngs_of_the_expected_size_and_json(layer, head, size, checkpoint, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, js = tmp_path / "a.png", tmp_path / "a.json"
    args = ["attention", str(checkpoint), "--prompt", "Hello there", "-o", str(out), "--json", str(js)]
    args += ["--layer", str(layer)] * (layer is not None) + ["--head", str(head)] * (head is not None)
    assert main(args) == 0
    assert png_size(out) == size
    data = json.loads(js.read_text())
    assert data["tokens"] == list("Hello there")
    assert [h["head"] for h in data["layers"][0]["heads"]] == ([head] if head is not None else [0, 1, 2, 3])


def test_attention_and_lens_cli_print_text(checkpoint, capsys):
    assert main(["attention", str(checkpoint), "--prompt", "abc", "--layer", "0", "--head", "1"]) == 0
    assert "layer 0, head 1" in capsys.readouterr().out
    assert main(["lens", str(checkpoint), "--prompt", "ab", "--top-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "position 1: 'b' ->" in out and "layer 1" in out


# --- bad input: one line, exit 2 ------------------------------------------------------------------------------------
def bad(capsys, *argv: str) -> str:
    rc = main(list(argv))
    return one_line_error(rc, capsys.readouterr().err)


def test_cli_bad_input(checkpoint, tmp_path, capsys):
    ck = str(checkpoint)
    assert "--layer 7 is out of range: this model has layers 0..1" in bad(capsys, "attention", ck, "--prompt", "a",
                                                                         "--layer", "7")
    assert "heads 0..3" in bad(capsys, "attention", ck, "--prompt", "a", "--head", "4")
    assert "--layer must be 0 or more" in bad(capsys, "attention", ck, "--prompt", "a", "--layer", "-1")
    assert "*.png" in bad(capsys, "attention", ck, "--prompt", "a", "-o", str(tmp_path / "a.jpg"))
    assert "does not exist" in bad(capsys, "attention", ck, "--prompt", "a", "-o", str(tmp_path / "no/a.png"))
    assert "empty" in bad(capsys, "lens", ck, "--prompt", "")
    assert "--top-k must be at least 1" in bad(capsys, "lens", ck, "--prompt", "a", "--top-k", "0")
    assert "at most 64 fit" in bad(capsys, "lens", ck, "--prompt", "a" * 65)
    # a character the model's vocabulary lacks: said of the prompt, without prepare's advice to pick a tokenizer
    for command in ("lens", "attention"):
        line = bad(capsys, command, ck, "--prompt", "a\u03a9")
        assert line == "error: the prompt has 1 character(s) not in the model's char vocabulary: '\u03a9'", line
    line = bad(capsys, "patch", ck, "--clean", "a\u03a9", "--corrupt", "ab")
    assert line == "error: --clean: the prompt has 1 character(s) not in the model's char vocabulary: '\u03a9'"
    assert "--seq-len 99 is out of range" in bad(capsys, "trace", ck, "--seq-len", "99")
    assert "neither a preset" in bad(capsys, "trace", "gpt-7")
    assert "has no metrics yet" in bad(capsys, "plot", str(tmp_path), "-o", str(tmp_path / "c.png"))


def test_pictures_without_matplotlib_give_the_install_hint(monkeypatch, checkpoint, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if it were not installed
    line = bad(capsys, "attention", str(checkpoint), "--prompt", "a", "-o", str(tmp_path / "a.png"))
    assert "pip install 'gptlab[viz]'" in line


# --- the web page's JSON endpoints ------------------------------------------------------------------------------------
KEY = "sesame"


@pytest.fixture(scope="module")
def ui_server(checkpoint):
    pytest.importorskip("fastapi")
    from gptlab.loading import load_model
    from gptlab.serve import ServerThread, create_app

    model, tok = load_model(checkpoint)
    with ServerThread(create_app(model, tok, api_key=KEY)) as server:
        yield server, model, tok


def test_ui_endpoints_answer_what_the_library_computes(ui_server):
    import httpx

    server, model, tok = ui_server
    auth = {"Authorization": f"Bearer {KEY}"}
    page = httpx.get(server.url + "/")  # the page itself holds no model data: no key needed
    assert page.status_code == 200 and "/static/gptlab.js" in page.text
    assert httpx.get(server.url + "/static/gptlab.js").status_code == 200
    assert httpx.get(server.url + "/static/../ui.py").status_code == 404
    assert httpx.post(server.url + "/ui/attention", json={"text": "ab"}).status_code == 401
    info = httpx.get(server.url + "/ui/info", headers=auth).json()
    assert (info["n_layer"], info["n_head"], info["max_tokens"]) == (2, 4, 64)
    r = httpx.post(server.url + "/ui/attention", json={"text": "Hello", "layer": 1, "head": 2}, headers=auth)
    assert r.status_code == 200
    reference = attention_map(model, tok, "Hello").weights[1, 2]
    torch.testing.assert_close(torch.tensor(r.json()["weights"]), reference, atol=1e-6, rtol=0)
    mean = httpx.post(server.url + "/ui/attention", json={"text": "Hello", "layer": 0, "head": None}, headers=auth)
    torch.testing.assert_close(torch.tensor(mean.json()["weights"]), attention_map(model, tok, "Hello").weights[0]
                               .mean(0), atol=1e-6, rtol=0)
    lens = httpx.post(server.url + "/ui/lens", json={"text": "Hello", "top_k": 2}, headers=auth).json()
    assert lens == logit_lens(model, tok, "Hello", 2).to_json(tok)


@pytest.mark.parametrize("body, param", [({"text": "ab", "layer": 2}, "layer"), ({"text": "ab", "head": 9}, "head"),
                                         ({"text": ""}, "text"), ({"text": "~"}, "text"), ({"text": "a" * 65}, "text"),
                                         ({"text": 5}, "text"), ({"text": "a", "layer": "1"}, "layer"),
                                         ({"text": "a", "layer": 1.0}, "layer"), ({"text": "a", "layr": 1}, "layr")])
def test_ui_bad_input_is_a_400_in_openai_shape(ui_server, body, param):
    import httpx

    server = ui_server[0]
    r = httpx.post(server.url + "/ui/attention", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_ui_attention_heads_are_the_layers_cached_patterns(ui_server):
    import httpx

    from gptlab.hooks import run_with_cache

    server, model, tok = ui_server
    r = httpx.post(server.url + "/ui/attention", json={"text": "Hello", "layer": 1, "heads": True},
                   headers={"Authorization": f"Bearer {KEY}"}).json()
    _, cache = run_with_cache(model, tok.encode("Hello"), ["blocks.1.attn.hook_pattern"])
    pattern = cache["blocks.1.attn.hook_pattern"][0]  # (n_head, T, T): one per query head of the GQA model
    assert len(r["heads"]) == model.config.n_head == 4
    torch.testing.assert_close(torch.tensor(r["heads"]), pattern, atol=1e-6, rtol=0)


@pytest.mark.parametrize("point, answer, wrong", [("resid_pre", "a", "b"), ("mlp_out", "t", "s"), ("z", "e", "o")])
def test_ui_patch_is_the_librarys_activation_patching(ui_server, point, answer, wrong):
    import httpx

    from gptlab.inspection.patching import PATCH_POINTS, activation_patching, logit_difference, patch_prompts

    server, model, tok = ui_server
    body = {"clean": "the cat sat", "corrupt": "the dog sat", "point": point, "answer": answer, "wrong": wrong}
    r = httpx.post(server.url + "/ui/patch", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    data = r.json()
    metric = logit_difference(tok.encode(answer)[0], tok.encode(wrong)[0])
    expected = activation_patching(model, tok.encode("the cat sat"), tok.encode("the dog sat"), metric,
                                   PATCH_POINTS[point], positions=point != "z")
    torch.testing.assert_close(torch.tensor(data["values"]), expected, atol=1e-5, rtol=0)
    assert data["tokens"] == list("the cat sat") and data["axes"][1] == ("head" if point == "z" else "position")
    default = httpx.post(server.url + "/ui/patch", json={"clean": "the cat sat", "corrupt": "the dog sat"},
                         headers={"Authorization": f"Bearer {KEY}"}).json()
    assert default == patch_prompts(model, tok, "the cat sat", "the dog sat").to_json()


@pytest.mark.parametrize("body, param", [
    ({"clean": "the cat", "corrupt": "the dog sat"}, "corrupt"), ({"clean": "", "corrupt": "a"}, "clean"),
    ({"clean": "~", "corrupt": "a"}, "clean"), ({"clean": "a" * 65, "corrupt": "b" * 65}, "clean"),
    ({"clean": "ab", "corrupt": "ba", "point": "q"}, "point"), ({"clean": "ab", "corrupt": "ba", "answer": "xy"},
                                                                "answer"),
    ({"clean": "ab", "corrupt": "ba", "wrong": "~"}, "wrong"), ({"clean": "ab", "corrupt": 3}, "corrupt"),
    ({"clean": "ab", "corrupt": "ba", "answer": "a", "wrong": "a"}, "answer"),
    ({"clean": "ab", "corrupt": "ba", "heads": True}, "heads"), ({"corrupt": "ba"}, "clean"),
])
def test_ui_patch_bad_input_is_a_400_naming_the_field(ui_server, body, param):
    import httpx

    r = httpx.post(ui_server[0].url + "/ui/patch", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and "\n" not in err["message"]


def test_no_ui_serves_no_page(checkpoint):
    pytest.importorskip("fastapi")
    import httpx

    from gptlab.loading import load_model
    from gptlab.serve import ServerThread, create_app

    model, tok = load_model(checkpoint)
    with ServerThread(create_app(model, tok, ui=False)) as server:
        assert httpx.get(server.url + "/").status_code == 404
        assert httpx.post(server.url + "/ui/attention", json={"text": "a"}).status_code == 404
