"""Hook points, the activation cache, patching and ablation on every family, checked against the model's own
forward and the maths (TransformerLens' side is tests/test_hooks_reference.py)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.nn.functional as F
from families import ALL_FAMILIES, model_of
from helpers import char_checkpoint, one_line_error, tiny_model

from gptlab.attention import CausalSelfAttention
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.generation import generate
from gptlab.generation.fast_decode import lean_step_exact
from gptlab.hooks import hook_point_names, hooked, hooked_here, run_with_cache, run_with_hooks
from gptlab.inspection.attention import attention_map
from gptlab.inspection.patching import ablate, ablation_hooks, activation_patching, logit_difference
from gptlab.loading import load_model
from gptlab.tokenizer import CharTokenizer

IDX = torch.tensor([[5, 17, 3, 42, 8, 11, 60], [1, 2, 3, 4, 5, 6, 7]])


def no_hooks_left(model) -> bool:  # noqa: ANN001
    blocks = model.transformer.h
    modules = [model, *blocks, *(b.attn for b in blocks), *(b.mlp for b in blocks)]
    return "_hook_registry" not in model.__dict__ and all(
        "hooks" not in m.__dict__ and "needs_pattern" not in m.__dict__ for m in modules)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_cache_leaves_the_forward_alone_and_agrees_with_itself(family: str) -> None:
    model = model_of(family)
    with torch.no_grad():
        expected, _ = model(IDX)
    logits, cache = run_with_cache(model, IDX)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert set(cache) == set(hook_point_names(model)) and no_hooks_left(model)
    n = model.config.n_layer
    for i in range(n - 1):  # one block hands the stream to the next
        assert torch.equal(cache[f"blocks.{i}.hook_resid_post"], cache[f"blocks.{i + 1}.hook_resid_pre"])
    final = model.transformer.ln_f(cache[f"blocks.{n - 1}.hook_resid_post"])
    torch.testing.assert_close(cache["ln_final.hook_normalized"], final)
    torch.testing.assert_close(cache["hook_logits"], logits)
    for i, block in enumerate(model.transformer.h):
        pattern = cache[f"blocks.{i}.attn.hook_pattern"]
        torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[:-1]))
        assert pattern.triu(1).abs().max() == 0  # causal
        z = cache[f"blocks.{i}.attn.hook_z"]  # each head's output: its pattern over its value head
        v = cache[f"blocks.{i}.attn.hook_v"].repeat_interleave(model.config.n_head // model.config.n_kv_head, dim=2)
        torch.testing.assert_close(z, torch.einsum("bhqk,bkhd->bqhd", pattern, v), atol=1e-5, rtol=0)
        mlp = block.mlp
        pre = cache[f"blocks.{i}.mlp.hook_pre"]
        up = cache.get(f"blocks.{i}.mlp.hook_pre_linear")
        post = mlp.nonlinearity(pre) * (up if up is not None else 1)
        torch.testing.assert_close(cache[f"blocks.{i}.mlp.hook_post"], post)


def test_per_head_outputs_make_the_attention_output() -> None:
    model = model_of("gpt2")
    _, cache = run_with_cache(model, IDX)
    attn = model.transformer.h[0].attn
    z = cache["blocks.0.attn.hook_z"]
    torch.testing.assert_close(attn.c_proj(z.flatten(2)), cache["blocks.0.hook_attn_out"])
    resid_mid = cache["blocks.0.hook_resid_pre"] + cache["blocks.0.hook_attn_out"]
    torch.testing.assert_close(cache["blocks.0.hook_resid_mid"], resid_mid)


def test_pattern_equals_the_attention_map() -> None:
    tokenizer = CharTokenizer.from_text("hello there")
    model = tiny_model(vocab_size=tokenizer.vocab_size, position="learned")
    amap = attention_map(model, tokenizer, "hello there")
    _, cache = run_with_cache(model, amap.token_ids)
    for i in range(model.config.n_layer):
        torch.testing.assert_close(cache[f"blocks.{i}.attn.hook_pattern"][0], amap.weights[i])


def test_fused_attention_stays_unless_the_pattern_is_hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of("llama")
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    run_with_cache(model, IDX, ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"])
    assert len(calls) == model.config.n_layer
    calls.clear()
    run_with_cache(model, IDX, ["blocks.1.attn.hook_pattern"])
    assert len(calls) == model.config.n_layer - 1  # only the hooked layer ran the manual path


def test_a_hook_replaces_its_activation() -> None:
    model = model_of("gpt2")
    zeroed = run_with_hooks(model, IDX, {f"blocks.{i}.attn.hook_z": torch.zeros_like
                                         for i in range(model.config.n_layer)})
    with hooked(model, {"blocks.0.attn.hook_z": torch.zeros_like}):
        _, zero_cache = run_with_cache(model, IDX, ["blocks.0.hook_attn_out"])
    bias = model.transformer.h[0].attn.c_proj.bias  # every head silenced: only the projection's bias is added
    out = zero_cache["blocks.0.hook_attn_out"]
    torch.testing.assert_close(out, bias.expand_as(out))
    assert not torch.allclose(zeroed, run_with_hooks(model, IDX, {}))
    assert no_hooks_left(model)


def test_hooks_are_removed_when_the_forward_raises() -> None:
    model = model_of("llama")

    def boom(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, IDX, {"hook_embed": lambda x: None, "blocks.1.attn.hook_pattern": boom})
    assert no_hooks_left(model) and model.training is False
    with pytest.raises(GptlabError, match="returned"):
        run_with_hooks(model, IDX, {"blocks.0.hook_resid_pre": lambda x: x[:, :1]})
    assert no_hooks_left(model)


def test_bad_names_get_a_one_line_error() -> None:
    model = model_of("llama")
    with pytest.raises(GptlabError, match="did you mean 'blocks.0.hook_resid_pre'"):
        run_with_cache(model, IDX, ["blocks.0.hook_resid_pr"])
    with pytest.raises(GptlabError, match="not a hook point"):
        run_with_cache(model, IDX, ["hook_pos_embed"])  # RoPE: no learned positions
    assert no_hooks_left(model)


def test_one_name_as_a_string_is_that_hook_point() -> None:
    model = model_of("gpt2")
    # was iterated by character: "'h' is not a hook point of this model"
    logits, cache = run_with_cache(model, IDX, "hook_logits")
    assert list(cache) == ["hook_logits"] and torch.equal(cache["hook_logits"], logits)
    with pytest.raises(GptlabError, match="'hook_logit' is not a hook point"):
        run_with_cache(model, IDX, "hook_logit")


def test_a_hook_runs_only_on_its_thread() -> None:
    model = model_of("gpt2")
    seen = []
    with hooked(model, {"hook_embed": lambda x: seen.append(threading.get_ident())}):
        other = threading.Thread(target=lambda: model(IDX))
        other.start()
        other.join()
        assert seen == []
        model(IDX)
    assert seen == [threading.get_ident()]


def test_another_threads_hooks_leave_this_threads_fast_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook on one thread (the server's page reading a pattern) sends only that thread through the manual
    attention and the plain forward: the engine's thread keeps the fused attention and the lean decode step."""
    model = model_of("llama")
    manual = []
    plain_manual = CausalSelfAttention._manual_attention
    monkeypatch.setattr(CausalSelfAttention, "_manual_attention",
                        lambda self, *a: manual.append(threading.get_ident()) or plain_manual(self, *a))
    with torch.no_grad():
        expected, _ = model(IDX)
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with hooked(model, {"blocks.0.attn.hook_pattern": lambda x: None}):
            inside.set()
            leave.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(30)
        with torch.no_grad():
            logits, _ = model(IDX)
        assert torch.equal(logits, expected) and manual == []
        assert not hooked_here(model) and lean_step_exact(model)
        with hooked(model, {"blocks.1.attn.hook_pattern": lambda x: None}):
            assert hooked_here(model) and not lean_step_exact(model)
            with torch.no_grad():
                model(IDX)
        assert manual == [threading.get_ident()]  # layer 1's, on this thread; never layer 0's for the other's hook
    finally:
        leave.set()
        holder.join()
    assert no_hooks_left(model)


def test_nested_hooks_compose_and_threads_overlap() -> None:
    model = model_of("gpt2")
    with hooked(model, {"blocks.0.hook_resid_pre": lambda x: x + 1}):
        with hooked(model, {"blocks.0.hook_resid_pre": lambda x: x * 2}):
            _, cache = run_with_cache(model, IDX, ["blocks.0.hook_resid_pre"])
        _, outer_only = run_with_cache(model, IDX, ["blocks.0.hook_resid_pre"])
    _, plain = run_with_cache(model, IDX, ["blocks.0.hook_resid_pre"])
    name = "blocks.0.hook_resid_pre"
    torch.testing.assert_close(cache[name], (plain[name] + 1) * 2)  # outer frame first, and the cache sees it
    torch.testing.assert_close(outer_only[name], plain[name] + 1)
    assert no_hooks_left(model)
    # thread A sets hooks, thread B sets its own, A leaves first: B's still run, then all is gone
    a_in, b_in, a_out, b_checked = (threading.Event() for _ in range(4))
    seen = {}

    def thread_a() -> None:
        with hooked(model, {"hook_embed": lambda x: x * 0}):
            a_in.set()
            b_in.wait()
        a_out.set()

    def thread_b() -> None:
        a_in.wait()
        with hooked(model, {"hook_embed": lambda x: x + 0}):
            b_in.set()
            a_out.wait()
            seen["b"] = run_with_cache(model, IDX, ["hook_embed"])[1]["hook_embed"]
        b_checked.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(seen["b"], plain_embed := run_with_cache(model, IDX, ["hook_embed"])[1]["hook_embed"])
    assert plain_embed.abs().sum() > 0 and no_hooks_left(model)


def test_cache_device_and_dtype() -> None:
    model = model_of("gpt2")
    _, cache = run_with_cache(model, IDX, ["blocks.0.hook_resid_pre"], device="cpu", dtype=torch.float16)
    assert cache["blocks.0.hook_resid_pre"].dtype == torch.float16
    _, by_name = run_with_cache(model, IDX, ["blocks.0.hook_resid_pre"], dtype="bfloat16")
    assert by_name["blocks.0.hook_resid_pre"].dtype == torch.bfloat16
    # each was torch's own error from inside the first hook (a TypeError, a RuntimeError listing device types,
    # CUDA's AssertionError on a machine without it), after the forward had begun
    cases = [({"device": "foo"}, "device 'foo' is not a device"),
             ({"dtype": "half-ish"}, "dtype must be a floating-point torch.dtype"),
             ({"dtype": torch.int32}, "dtype must be a floating-point torch.dtype")]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "CUDA is not available here"))
    for kwargs, message in cases:
        with pytest.raises(GptlabError, match=message):
            run_with_cache(model, IDX, ["blocks.0.hook_resid_pre"], **kwargs)
        assert no_hooks_left(model)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_generation_runs_the_hooks_and_a_no_op_hook_changes_nothing(family: str) -> None:
    model = model_of(family)
    prompt = IDX[:1]
    plain = generate(model, prompt, 6, temperature=0)
    calls = []
    with hooked(model, {"blocks.0.hook_resid_post": lambda x: calls.append(x.shape[1])}):
        hooked_out = generate(model, prompt, 6, temperature=0)
    assert torch.equal(plain, hooked_out)
    assert calls[0] == prompt.shape[1] and calls[1:] == [1] * 5  # the prefill, then each decode step


def test_patching_everything_restores_the_clean_metric() -> None:
    model = model_of("llama")
    clean, corrupt = IDX[:1], IDX[1:]
    metric = logit_difference(3, 9)
    with torch.no_grad():
        clean_value = float(metric(run_with_hooks(model, clean, {})))
        corrupt_value = float(metric(run_with_hooks(model, corrupt, {})))
    whole = activation_patching(model, clean, corrupt, metric, positions=False)
    assert whole.shape == (model.config.n_layer,)
    torch.testing.assert_close(whole, torch.full_like(whole, clean_value), atol=1e-5, rtol=0)
    by_position = activation_patching(model, clean, corrupt, metric)
    # layer 0, a position whose token is the same in both prompts: nothing changes
    same = [t for t in range(IDX.shape[1]) if clean[0, t] == corrupt[0, t]]
    for t in same:
        assert abs(by_position[0, t] - corrupt_value) < 1e-5
    # the last layer's residual stream at the last position decides the prediction alone
    by_output = activation_patching(model, clean, corrupt, metric, point="hook_resid_post")
    assert abs(by_output[-1, -1] - clean_value) < 1e-5
    heads = activation_patching(model, clean, corrupt, metric, point="attn.hook_z", positions=False)
    assert heads.shape == (model.config.n_layer, model.config.n_head)


def test_patching_refuses_prompts_of_different_lengths() -> None:
    model = model_of("gpt2")
    with pytest.raises(GptlabError, match="same length"):
        activation_patching(model, [1, 2, 3], [1, 2], logit_difference(1, 2))
    with pytest.raises(GptlabError, match="no head axis"):
        activation_patching(model, [1, 2], [2, 1], logit_difference(1, 2), heads=True)


def test_logit_difference_names_a_token_or_position_the_logits_lack() -> None:
    model = model_of("gpt2")
    vocab = model.config.vocab_size
    clean, corrupt = IDX[:1, :4], IDX[1:, :4]
    # were an IndexError from inside the patching loop; a negative id read a logit from the vocabulary's end
    for metric, message in ((logit_difference(vocab, 2), f"answer token {vocab} is outside the vocabulary"),
                            (logit_difference(1, -1), "wrong token -1 is outside the vocabulary"),
                            (logit_difference(1, 2, position=4), "position 4 is outside the prompt's 4 tokens")):
        with pytest.raises(GptlabError, match=message):
            activation_patching(model, clean, corrupt, metric)
        assert no_hooks_left(model)
    logits = run_with_hooks(model, clean, {})
    assert float(logit_difference(1, 2, position=-4)(logits)) == float(logits[0, 0, 1] - logits[0, 0, 2])


def test_ablation_against_the_maths() -> None:
    model = model_of("llama")
    _, cache = run_with_cache(model, IDX)
    reference = IDX
    for kind in ("zero", "mean"):
        logits = ablate(model, IDX[:1], heads=[(1, 2)], neurons=[(0, 5)], kind=kind, reference=reference)
        z_value = 0 if kind == "zero" else cache["blocks.1.attn.hook_z"][:, :, 2].mean(dim=(0, 1))
        n_value = 0 if kind == "zero" else cache["blocks.0.mlp.hook_post"][..., 5].mean()

        def z_fn(z: torch.Tensor, value: object = z_value) -> torch.Tensor:
            z = z.clone()
            z[:, :, 2] = value
            return z

        def n_fn(h: torch.Tensor, value: object = n_value) -> torch.Tensor:
            h = h.clone()
            h[..., 5] = value
            return h

        expected = run_with_hooks(model, IDX[:1], {"blocks.1.attn.hook_z": z_fn, "blocks.0.mlp.hook_post": n_fn})
        torch.testing.assert_close(logits, expected)
    with pytest.raises(GptlabError, match="out of range"):
        ablation_hooks(model, heads=[(0, 4)])
    with pytest.raises(GptlabError, match="reference"):
        ablation_hooks(model, heads=[(0, 1)], kind="mean")


# --- gptlab patch ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):  # noqa: ANN001, ANN201
    return char_checkpoint(tmp_path_factory.mktemp("patch") / "ckpt")


def test_patch_cli_table_json_and_png(checkpoint, tmp_path, capsys) -> None:  # noqa: ANN001
    args = ["patch", str(checkpoint), "--clean", "the cat sat", "--corrupt", "the dog sat"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "clean" in out and out.count("\n") == 2 + 1 + 2  # baselines, header, title, a row per layer
    png, js = tmp_path / "p.png", tmp_path / "p.json"
    assert main([*args, "--point", "z", "-o", str(png), "--json", str(js), "--answer", "a", "--wrong", "b"]) == 0
    data = json.loads(js.read_text())
    model, tokenizer = load_model(checkpoint)
    clean, corrupt = tokenizer.encode("the cat sat"), tokenizer.encode("the dog sat")
    metric = logit_difference(tokenizer.encode("a")[0], tokenizer.encode("b")[0])
    expected = activation_patching(model, clean, corrupt, metric, point="attn.hook_z", positions=False)
    torch.testing.assert_close(torch.tensor(data["values"]), expected, atol=1e-5, rtol=0)
    assert data["axes"] == ["layer", "head"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("extra, message", [
    (["--corrupt", "the dog"], "same length"),
    (["--corrupt", "the dog sat", "--answer", "ab"], "2 tokens"),
    (["--corrupt", "the dog sat", "--answer", "a", "--wrong", "a"], "the same"),
    (["--corrupt", "the dog sat", "-o", "x.jpg"], "PNG"),
    (["--corrupt", "the dog sat", "--point", "q"], "not one of"),
])
def test_patch_cli_bad_input(checkpoint, capsys, extra, message) -> None:  # noqa: ANN001
    assert main(["patch", str(checkpoint), "--clean", "the cat sat", *extra]) == 2
    assert message in one_line_error(2, capsys.readouterr().err)


def test_patching_a_point_a_parallel_block_lacks_names_the_point(tmp_path, capsys) -> None:  # noqa: ANN001
    """GPT-J's parallel blocks have no resid_mid: `gptlab patch` says so in its own flag's terms, and the page's
    /ui/patch answers a 400 naming "point" (not "clean")."""
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    path = save_model(tmp_path / "gptj", model_of("gptj"), tok)
    assert main(["patch", str(path), "--clean", "the cat", "--corrupt", "the dog", "--point", "resid_mid"]) == 2
    line = one_line_error(2, capsys.readouterr().err)
    assert line.startswith("error: --point resid_mid:") and "resid_pre, resid_post" in line
    pytest.importorskip("fastapi")
    import httpx

    from gptlab.serve import ServerThread, create_app

    with ServerThread(create_app(*load_model(path))) as server:
        r = httpx.post(server.url + "/ui/patch", json={"clean": "the cat", "corrupt": "the dog", "point": "resid_mid"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "point"


def test_every_families_hook_points_are_in_the_readme_table() -> None:
    """The README's hook-point table names every point any family has (a layer's as `blocks.{i}.`)."""
    import re
    from pathlib import Path

    rows = [line for line in (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
            if line.startswith("| `") and "hook_" in line]
    documented = set()
    for row in rows:
        first = row.split("|")[1]
        names = re.findall(r"`([^`]+)`", first)
        prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
        documented |= {names[0], *(prefix + n if "." not in n else n for n in names[1:])}
    for family in ALL_FAMILIES:
        points = {re.sub(r"^blocks\.\d+\.", "blocks.{i}.", n) for n in hook_point_names(model_of(family))}
        assert points <= documented, (family, points - documented)
