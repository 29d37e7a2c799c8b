"""Speculative decoding: greedy output identical to the target's alone (hypothesis over prompts), and sampled
tokens distributed as the target's own (chi-square against the exact distribution from full forwards, on a
tiny vocabulary), for a draft model and for prompt lookup."""

from __future__ import annotations

import itertools

import pytest
import torch
from families import build as family_model
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from gptlab.config import RopeScaling
from gptlab.errors import GptlabError
from gptlab.generation import Engine, SamplingParams, generate, generate_batch
from gptlab.generation.speculative import MAX_NGRAM, NgramDrafter, accept

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = tiny_model()
DRAFTS = {"itself": TARGET, "other model": tiny_model(seed=1), "ngram": "ngram"}
P_MIN = 1e-3  # a seeded test: a p-value below this would be a real disagreement, not bad luck


def speculative_run(model, prompt, params, speculate, draft_tokens=4, max_len=None):
    engine = Engine(model, 1, max_len=max_len or len(prompt) + params.max_new_tokens, speculate=speculate,
                    draft_tokens=draft_tokens)
    gen = engine.prepare(prompt, params)
    engine.run([gen])
    return gen, engine.speculator.stats


# ---------------------------------------------------------------------------------------------------------
# Greedy: the target's own output
# ---------------------------------------------------------------------------------------------------------
@settings(max_examples=15, deadline=None)
@given(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=24), new=st.integers(1, 30),
       draft_tokens=st.integers(1, 6))
@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_output_is_the_targets(draft, prompt, new, draft_tokens):
    params = SamplingParams(temperature=0, max_new_tokens=new)
    (plain,) = generate_batch(TARGET, [prompt], params)
    gen, stats = speculative_run(TARGET, prompt, params, DRAFTS[draft], draft_tokens)
    assert gen.token_ids == plain.token_ids
    assert gen.finish_reason == plain.finish_reason
    if draft == "itself" and new > 1:  # the target guessing for itself is always right
        assert stats.accepted == stats.proposed > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft", DRAFTS)
def test_the_cpp_step_verifies_the_guesses(on_kernel, draft, dtype, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001
    """With the model's Linears on gptlab's kernels, the verify forward (and a draft model's catch-up) is one call of
    the C++ step (its rows the row's next positions, `decode_rows`), a draft model's greedy guesses another
    (`Engine.greedy_row`), and the greedy output is the target's own."""
    import gptlab.generation.engine as engine_module
    import gptlab.generation.engine_prefill as engine_prefill

    drafted = []
    greedy_row = engine_module.Engine.greedy_row
    monkeypatch.setattr(engine_module.Engine, "greedy_row",
                        lambda self, *a: drafted.append(r := greedy_row(self, *a)) or r)

    model = tiny_model().to(dtype)  # TARGET and DRAFTS' models, in this dtype
    # (prompt lookup after any match: this random model's output repeats no 3 tokens)
    speculate = {"itself": model, "other model": tiny_model(seed=1).to(dtype), "ngram": NgramDrafter(1)}[draft]
    calls = []
    real = engine_prefill.decode_rows
    monkeypatch.setattr(engine_prefill, "decode_rows", lambda *a, **kw: calls.append(len(a[2])) or real(*a, **kw))
    params = SamplingParams(temperature=0, max_new_tokens=40)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    (plain,) = generate_batch(model, [prompt], params)
    gen, stats = speculative_run(model, prompt, params, speculate)
    assert gen.token_ids == plain.token_ids
    assert stats.forwards > 0 and sum(n > 1 for n in calls) >= stats.forwards  # each verify: the last token, guesses
    if draft != "ngram":  # each check's guesses in one call
        assert len(drafted) >= stats.forwards and None not in drafted


@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_past_the_context_slides_as_the_target_does(draft):
    """A RoPE row that outgrows its cache slides its window: speculation makes room, and goes on after the slide
    (a draft model then reads the target's new window)."""
    params = SamplingParams(temperature=0, max_new_tokens=90)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    (plain,) = generate_batch(TARGET, [prompt], params)  # (block_size 64: slides)
    gen, stats = speculative_run(TARGET, prompt, params, DRAFTS[draft], max_len=64)
    assert gen.token_ids == plain.token_ids
    if draft == "itself":  # every guess right: all but the tokens of the steps around the slide came from checks
        assert stats.accepted == stats.proposed and stats.accepted + stats.forwards >= 80


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_length_dependent_rope_target_decodes_past_its_pretraining_context_as_alone(kind):
    """Dynamic NTK and longrope frequencies follow a forward's last position: a verify forward reaching past the
    pretraining context (16) would rotate its tokens otherwise than decoding them one by one. The row speculates
    only within it, and its tokens and logprobs are the target's own."""
    scaling = {"dynamic": RopeScaling("dynamic", factor=2.0, original_context=16),
               "longrope": RopeScaling("longrope", original_context=16, short_factor=(1.0,) * 8,
                                       long_factor=(2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0))}[kind]
    target = family_model("llama", rope_scaling=scaling)
    params = SamplingParams(temperature=0, max_new_tokens=20, logprobs=1)
    for prompt in ([5, 9, 13, 22, 7, 41, 5, 9], [5, 9, 13, 22, 7, 41, 5, 9] * 3):
        (plain,) = generate_batch(target, [prompt], params)
        gen, stats = speculative_run(target, prompt, params, target)  # the target's guesses: every one right
        assert gen.token_ids == plain.token_ids
        assert [e.logprob for e in gen.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)
        # 8 tokens held: 4 guesses, then 2 (the forward's last position 15), then none; 24: none
        assert stats.accepted == stats.proposed == (6 if len(prompt) == 8 else 0)


def test_a_draft_of_a_shorter_context_reads_its_latest_half():
    """A draft whose block_size is shorter than the target's window keeps guessing from the context's latest
    tokens, and the greedy output is still the target's own."""
    short = tiny_model(block_size=24)
    params = SamplingParams(temperature=0, max_new_tokens=50)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    (plain,) = generate_batch(TARGET, [prompt], params)
    gen, stats = speculative_run(TARGET, prompt, params, short, max_len=64)
    assert gen.token_ids == plain.token_ids
    assert stats.forwards * 4 >= stats.proposed > 40  # guesses made all along, past the draft's 24 positions


def test_learned_positions_end_where_the_target_does():
    model = tiny_model("learned", block_size=32)
    params = SamplingParams(temperature=0, max_new_tokens=100)
    prompt = [1, 2, 3, 1, 2, 3]
    (plain,) = generate_batch(model, [prompt], params)
    gen, stats = speculative_run(model, prompt, params, model, max_len=32)
    assert gen.token_ids == plain.token_ids and gen.finish_reason == plain.finish_reason == "length"
    assert stats.accepted > 0


def test_generate_takes_a_drafter_and_logprobs_match_plain_decoding():
    idx = torch.tensor([[4, 8, 15, 16, 23, 42, 4, 8, 15]])
    assert torch.equal(generate(TARGET, idx, 20, temperature=0, speculate="ngram"), generate(TARGET, idx, 20, 0))
    params = SamplingParams(temperature=0, max_new_tokens=12, logprobs=2)
    (plain,) = generate_batch(TARGET, [idx[0].tolist()], params)
    gen, stats = speculative_run(TARGET, idx[0].tolist(), params, TARGET)
    assert stats.accepted > 0 and len(gen.logprobs) == 12
    for a, b in zip(gen.logprobs, plain.logprobs, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(min_match=1)
    context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert drafter.propose(None, context, 2)[0] == [7, 8]  # "2 3" last seen before "7 8"
    assert NgramDrafter().propose(None, context, 2)[0] == []  # by default, a match of 3 tokens or more
    assert NgramDrafter().propose(None, [*context, 9, 1], 2)[0] == [2, 3]  # "3 9 1"
    assert drafter.propose(None, [1, 2, 3, 4], 3)[0] == []  # nothing repeats
    # the longest repeated ending wins over a later shorter one: "1 2 3 4" before "7 9", not "2 3 4" before "8 1"
    assert drafter.propose(None, [1, 2, 3, 4, 7, 9, 2, 3, 4, 8, 1, 2, 3, 4], 2)[0] == [7, 9]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 5))
def test_prompt_lookup_follows_the_longest_repeated_ending(context: list[int], k: int, min_match: int) -> None:
    """Against a search of every earlier position: the tokens after the latest of the longest earlier matches of
    the context's ending (up to MAX_NGRAM tokens), where that is min_match tokens or more."""
    best, at = 0, None
    for e in range(len(context) - 1):  # an earlier match ending at e
        n = 0
        while n < min(MAX_NGRAM, e + 1) and context[e - n] == context[len(context) - 1 - n]:
            n += 1
        if n and n >= best:
            best, at = n, e
    want = [] if at is None or best < min_match else context[at + 1 : at + 1 + k]
    assert NgramDrafter(min_match).propose(None, context, k)[0] == want


# ---------------------------------------------------------------------------------------------------------
# Sampling: the target's distribution
# ---------------------------------------------------------------------------------------------------------
def _chisquare(samples: list, probs: dict) -> float:
    """p-value of the samples' counts against `probs` (cells expected below 5 pooled into one)."""
    n, total = len(samples), sum(probs.values())
    counts = {c: 0 for c in probs}
    for s in samples:
        counts[s] += 1
    big = [c for c in probs if probs[c] / total * n >= 5]
    observed = [counts[c] for c in big] + [n - sum(counts[c] for c in big)]
    expected = [probs[c] / total * n for c in big]
    expected.append(max(0.0, n - sum(expected)))
    if expected[-1] < 1e-6:
        observed, expected = observed[:-1], expected[:-1]
    expected = [e * sum(observed) / sum(expected) for e in expected]  # (sums agree to the float)
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("certain", [False, True], ids=["draft distribution", "prompt lookup"])
def test_accept_rule_keeps_the_targets_distribution(certain):
    torch.manual_seed(0)
    V, trials = 5, 4000
    logits = torch.randn(3, V) * 1.5  # the target after its last token and after each of 2 guesses
    q = torch.randn(2, V).softmax(-1)
    params = SamplingParams(temperature=1.0, seed=0)
    p = logits.softmax(-1)
    gen = torch.Generator().manual_seed(0)
    firsts, seconds = [], []
    for _ in range(trials):
        drafts = [3, 1] if certain else [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        tokens = accept(logits, drafts, None if certain else q, params, gen)
        firsts.append(tokens[0])
        if len(tokens) > 1:
            seconds.append(tokens[1])
    assert _chisquare(firsts, dict(enumerate(p[0].tolist()))) > P_MIN
    assert _chisquare(seconds, dict(enumerate(p[1].tolist()))) > P_MIN


@torch.no_grad()
def _exact_joint(model, prompt: list[int], n: int, params: SamplingParams) -> dict:
    """P(first n tokens) under the target's own sampling, from full forwards."""
    from gptlab.generation.sampling import filtered_probs

    V = model.config.vocab_size
    joint = {}
    for seq in itertools.product(range(V), repeat=n):
        logits, _ = model(torch.tensor([prompt + list(seq[:-1])]), targets=torch.zeros(1, len(prompt) + n - 1,
                                                                                          dtype=torch.long))
        probs = filtered_probs(logits[0, len(prompt) - 1 :].float(), [params] * n)
        joint[seq] = float(torch.prod(probs[torch.arange(n), torch.tensor(seq)]))
    return joint


@pytest.mark.parametrize("draft", ["other model", "ngram"])
@pytest.mark.parametrize("controls", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}])
def test_sampled_tokens_follow_the_targets_distribution(draft, controls):
    V = 4
    target = tiny_model(vocab_size=V)
    speculate = tiny_model(vocab_size=V, seed=1) if draft == "other model" else "ngram"
    prompt, n = [1, 2, 3, 1, 2], 3  # (repeats: prompt lookup has guesses)
    params = SamplingParams(max_new_tokens=n, seed=1234, **controls)
    engine = Engine(target, 1, max_len=len(prompt) + n, speculate=speculate, draft_tokens=2)
    samples = []
    for i in range(1500):
        gen = engine.prepare(prompt, params, sample_index=i)
        engine.run([gen])
        samples.append(tuple(gen.token_ids))
    assert engine.speculator.stats.forwards > 500  # most samples took their last tokens from one verify forward
    assert _chisquare(samples, _exact_joint(target, prompt, n, params)) > P_MIN


# ---------------------------------------------------------------------------------------------------------
# Where it applies, and bad drafts
# ---------------------------------------------------------------------------------------------------------
def test_rows_decoding_together_step_normally_and_a_lone_row_speculates():
    params = SamplingParams(temperature=0, max_new_tokens=30)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    plain = generate_batch(TARGET, prompts, params)
    engine = Engine(TARGET, 2, max_len=40, speculate=TARGET)
    gens = [engine.prepare(p, params) for p in prompts]
    engine.add(gens)
    engine.step()
    assert engine.speculator.stats.forwards == 0 and all(len(g.token_ids) == 2 for g in gens)
    engine.release(gens[1])
    while engine.running:
        engine.step()
    assert gens[0].token_ids == plain[0].token_ids and engine.speculator.stats.forwards > 0


def test_penalized_rows_decode_normally():
    params = SamplingParams(temperature=0, max_new_tokens=20, repetition_penalty=1.3)
    prompt = [1, 2, 3, 1, 2]
    (plain,) = generate_batch(TARGET, [prompt], params)
    gen, stats = speculative_run(TARGET, prompt, params, TARGET)
    assert gen.token_ids == plain.token_ids and stats.forwards == 0


def test_bad_drafts_are_refused():
    with pytest.raises(GptlabError, match="vocabulary has 64 tokens, the target's 256"):
        Engine(TARGET, 1, speculate=tiny_model(vocab_size=64))
    with pytest.raises(GptlabError, match="draft model or 'ngram'"):
        Engine(TARGET, 1, speculate="bigram")
    with pytest.raises(GptlabError, match="at least 1"):
        Engine(TARGET, 1, speculate="ngram", draft_tokens=0)
    with pytest.raises(GptlabError, match="min_match must be at least 1, got 0"):
        NgramDrafter(min_match=0)


# ---------------------------------------------------------------------------------------------------------
# gptlab sample and gptlab serve
# ---------------------------------------------------------------------------------------------------------
CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,!?\n"


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    from gptlab.checkpoint import save_model
    from gptlab.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text(CHARS)
    target, draft = tiny_model(vocab_size=tok.vocab_size), tiny_model(vocab_size=tok.vocab_size, seed=1)
    root = tmp_path_factory.mktemp("speculative")
    return save_model(root / "target", target, tok), save_model(root / "draft", draft, tok), target, tok


@pytest.mark.parametrize(("flags", "draft_quantized"), [
    (["--draft", "{draft}"], False),
    (["--draft", "{draft}", "--draft-quantize", "int8"], True),
    (["--draft", "{draft}", "--quantize", "int8"], True),  # the draft quantized as the model, by default
    (["--draft", "{draft}", "--quantize", "int8", "--draft-quantize", "none"], False),
    (["--speculate", "ngram", "--draft-tokens", "2"], None),
    # --group-size is the int4 model's: an int8 draft takes none (it was handed the size, and its load refused it)
    (["--draft", "{draft}", "--quantize", "int4", "--group-size", "32", "--draft-quantize", "int8"], "int8"),
])
def test_sample_with_a_drafter_prints_the_targets_greedy_text(char_models, capsys, flags, draft_quantized,
                                                               monkeypatch):
    from gptlab.cli import main
    from gptlab.generation.speculative import Speculator
    from gptlab.loading import load_model
    from gptlab.quantize import QuantizedLinear

    target_path, draft_path, model, tok = char_models
    prompt = "Hello Hello Hello"
    flags = [f.format(draft=draft_path) for f in flags]
    if "--quantize" in flags:  # the output is the quantized model's own
        group = int(flags[flags.index("--group-size") + 1]) if "--group-size" in flags else None
        model, _ = load_model(target_path, quantize=flags[flags.index("--quantize") + 1], group_size=group)
    (ref,) = generate_batch(model, [tok.encode(prompt)], SamplingParams(temperature=0, max_new_tokens=30),
                            tokenizer=tok)
    drafts = []
    real = Speculator.__init__
    monkeypatch.setattr(Speculator, "__init__", lambda self, engine, speculate, *a: drafts.append(speculate)
                        or real(self, engine, speculate, *a))
    assert main(["sample", str(target_path), "--prompt", prompt, "--max-new-tokens", "30", "--temperature", "0",
                 *flags]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == prompt + ref.text + "\n---------------\n"
    if draft_quantized is not None:
        modes = {m.mode for m in drafts[0].modules() if isinstance(m, QuantizedLinear)}
        assert modes == ({draft_quantized} if isinstance(draft_quantized, str) else {"int8"} if draft_quantized
                         else set())


def test_sample_refuses_bad_speculation_flags_in_one_line(char_models, capsys, tmp_path):
    from gptlab.checkpoint import save_model
    from gptlab.cli import main

    target_path, _, _, _ = char_models
    other = save_model(tmp_path / "other", tiny_model(vocab_size=40))
    assert main(["sample", str(target_path), "--draft", str(other), "--max-new-tokens", "2"]) == 2
    assert "vocabulary has 40 tokens" in capsys.readouterr().err
    assert main(["sample", str(target_path), "--speculate", "ngram", "--draft-tokens", "0"]) == 2
    assert "--draft-tokens must be at least 1" in capsys.readouterr().err
    assert main(["sample", str(target_path), "--speculate", "ngram", "--draft-quantize", "int8"]) == 2
    assert "--draft-quantize needs --draft" in capsys.readouterr().err
    assert main(["sample", str(target_path), "--draft-tokens", "3", "--max-new-tokens", "2"]) == 2  # not ignored
    assert "--draft-tokens needs --draft or --speculate" in capsys.readouterr().err


def test_a_draft_that_cannot_be_quantized_so_is_named(char_models, capsys, tmp_path):
    """A draft whose widths the int4 group size does not divide: the one-line error says it is the draft's."""
    from gptlab.checkpoint import save_model
    from gptlab.cli import main

    target_path, _, _, tok = char_models
    draft = save_model(tmp_path / "draft48", tiny_model(vocab_size=tok.vocab_size, n_embd=48), tok)
    assert main(["sample", str(target_path), "--max-new-tokens", "2", "--draft", str(draft),
                 "--draft-quantize", "int4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --draft: ") and "does not divide" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["sample", "serve"])
def test_a_bad_draft_is_refused_before_the_model_loads(char_models, capsys, tmp_path, monkeypatch, command):
    import gptlab.loading
    from gptlab.cli import main

    def no_load(*a, **kw):  # noqa: ANN002, ANN003
        raise AssertionError("the model was loaded before --draft was checked")

    monkeypatch.setattr(gptlab.loading, "load_model", no_load)
    target_path = char_models[0]
    (tmp_path / "empty").mkdir()
    port = [] if command == "sample" else ["--port", "0"]
    for draft, message in [(tmp_path / "nowhere", "does not exist"), (tmp_path / "empty", "no checkpoint found in"),
                           (target_path / "config.json", "is a file")]:
        assert main([command, str(target_path), *port, "--draft", str(draft)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --draft: ") and message in err and str(draft) in err, err
        assert err.count("\n") == 1, err
    assert main([command, str(target_path), *port, "--speculate", "ngram", "--draft-tokens", "0"]) == 2
    assert "--draft-tokens must be at least 1" in capsys.readouterr().err


def test_server_with_a_draft_answers_as_the_target_alone(char_models):
    openai = pytest.importorskip("openai")
    import httpx

    from gptlab.serve import ServerThread, create_app

    target_path, _, model, tok = char_models
    draft = tiny_model(vocab_size=tok.vocab_size, seed=1)
    app = create_app(model, tok, max_batch=2, speculate=draft, draft_tokens=3)
    prompt = "To be or not to be"
    (ref,) = generate_batch(model, [tok.encode(prompt)], SamplingParams(temperature=0, max_new_tokens=25),
                            tokenizer=tok)
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=30.0, max_retries=0)
        done = client.completions.create(model="gptlab", prompt=prompt, max_tokens=25, temperature=0)
        streamed = client.completions.create(model="gptlab", prompt=prompt, max_tokens=25, temperature=0,
                                             stream=True)
        text = "".join(c.choices[0].text for c in streamed)
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert done.choices[0].text == text == ref.text
    assert done.usage.completion_tokens == len(ref.token_ids)
    stats = app.state.server.engine.speculator.stats
    assert stats.forwards > 0
    assert f"gptlab_speculative_checks_total {float(stats.forwards)}" in metrics  # what /metrics says
    assert f"gptlab_speculative_guesses_total {float(stats.proposed)}" in metrics
