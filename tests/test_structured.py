"""Structured outputs: a JSON schema's grammar masks each row's next token (llguidance), so that every finished
output parses and validates against its schema (checked with `jsonschema`, an independent validator), in a batch
that mixes constrained and free rows, through chunked prefill, stop strings and streaming."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ByteTokenizer, packed_mask, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from gptlab.generation import Engine, SamplingParams, generate_batch, stream_deltas  # noqa: E402
from gptlab.generation.grammar import allowed_tokens, row_grammar  # noqa: E402
from gptlab.generation.params import JSON_OBJECT, InvalidSamplingParam  # noqa: E402
from gptlab.tokenizer import CharTokenizer  # noqa: E402


class EotBytes(ByteTokenizer):
    """Bytes plus an end-of-text token (256), so that a top-level number or string can end."""

    vocab_size, eot_id = 257, 256

    def decode_bytes(self, ids) -> bytes:  # noqa: ANN001
        return bytes(int(i) for i in ids if int(i) < 256)


TOK = EotBytes()


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=257, block_size=256)


def _constraint(schema: dict) -> tuple[str, str]:
    return SamplingParams(json_schema=schema).constraint()


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# small schemas whose outputs stay short (strings, arrays and objects bounded), so a random model finishes them
_scalars = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.integers(-50, 50).flatmap(lambda lo: st.just({"type": "integer", "minimum": lo, "maximum": lo + 100})),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.sampled_from(["red", "green", "x", "7"]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
)
_schemas = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.tuples(inner, st.integers(0, 2)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(lambda req: {
                "type": "object", "properties": props, "required": req, "additionalProperties": False})),
    ),
    max_leaves=4,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas, seed=st.integers(0, 2**31))
def test_every_finished_output_parses_and_validates_against_its_schema(model, schema, seed) -> None:
    params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=seed, json_schema=schema)
    gens = generate_batch(model, [list(b"{"), list(b"x y")], params, tokenizer=TOK)
    for g in gens:
        assert g.finish_reason in ("stop", "length")
        if g.finish_reason == "stop":
            assert _valid(g.text, schema), (schema, g.text)


def test_the_mask_allows_exactly_what_json_allows_next() -> None:
    # an analytic reference: an object starts with "{", then a key or "}"; end-of-text only once it is complete
    g = row_grammar(_constraint(JSON_OBJECT), TOK, frozenset({TOK.eot_id}))
    assert torch.nonzero(allowed_tokens([g], 257)[0]).flatten().tolist() == [ord("{")]
    assert not g.advance(ord("{"))
    assert torch.nonzero(allowed_tokens([g], 257)[0]).flatten().tolist() == [ord('"'), ord("}")]
    assert g.advance(ord("}"))  # the object is complete and nothing may follow: the row ends
    number = row_grammar(_constraint({"type": "integer"}), TOK, frozenset({TOK.eot_id}))
    number.advance(ord("7"))
    allowed = allowed_tokens([number], 260)[0]  # a model vocabulary padded past the tokenizer's
    assert allowed[TOK.eot_id] and allowed[ord("0")] and not allowed[ord("{")] and not allowed[257:].any()


def test_mixed_batch_rows_are_independent_and_length_cuts_mid_json(model) -> None:
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 3},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["word", "n"], "additionalProperties": False}
    free = SamplingParams(max_new_tokens=12, temperature=0)
    constrained = SamplingParams(max_new_tokens=80, temperature=0, json_schema=schema)
    cut = SamplingParams(max_new_tokens=3, temperature=0, json_schema=schema)
    engine = Engine(model, max_batch=3, tokenizer=TOK)
    gens = [engine.prepare(list(b"ab"), p) for p in (free, constrained, cut)]
    engine.run(gens)
    (alone,) = generate_batch(model, [list(b"ab")], free, tokenizer=TOK)
    assert gens[0].token_ids == alone.token_ids  # a free row in a constrained batch decodes as it does alone
    assert gens[1].finish_reason == "stop" and _valid(gens[1].text, schema)
    assert gens[2].finish_reason == "length" and len(gens[2].token_ids) == 3
    assert gens[2].text == gens[1].text[:3] and not _valid(gens[2].text, schema)


def test_a_grammar_that_fails_mid_answer_ends_its_row_alone(model, monkeypatch) -> None:
    """A grammar past llguidance's limits only mid-answer (its advance raising) ends its own row with that error;
    the batch's other rows answer as they do alone (the scheduler would otherwise fail every request)."""
    from gptlab.generation.grammar import RowGrammar

    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 3}}, "required": ["word"]}
    real = RowGrammar.advance
    calls = []

    def failing(self, token: int) -> bool:  # noqa: ANN001
        calls.append(token)
        if len(calls) == 3:
            raise InvalidSamplingParam("json_schema", f"(token {token})", "is too large for the grammar engine")
        return real(self, token)

    monkeypatch.setattr(RowGrammar, "advance", failing)
    free = SamplingParams(max_new_tokens=12, temperature=0)
    engine = Engine(model, max_batch=2, tokenizer=TOK)
    gens = [engine.prepare(list(b"ab"), p) for p in (free, SamplingParams(max_new_tokens=40, temperature=0,
                                                                          json_schema=schema))]
    engine.add(gens)
    while engine.running:  # (`run` raises a row's error at the end: the steps go on here as a server's do)
        engine.step()
    assert gens[1].finish_reason == "error" and isinstance(gens[1].error, InvalidSamplingParam)
    assert len(gens[1].token_ids) == 3 and engine.slots[1] is None
    (alone,) = generate_batch(model, [list(b"ab")], free, tokenizer=TOK)
    assert gens[0].token_ids == alone.token_ids and gens[0].finish_reason == alone.finish_reason


def test_grammar_state_survives_chunked_prefill_stop_strings_and_streaming(model) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 6}
    params = SamplingParams(max_new_tokens=60, temperature=0.9, seed=3, json_schema=schema, stop=["never"])
    engine = Engine(model, max_batch=2, tokenizer=TOK, prefill_chunk=4)
    other = engine.prepare(list(b"free running row, longer than a chunk"), SamplingParams(max_new_tokens=40))
    engine.add([other])
    engine.step()
    gen = engine.prepare(list(b"a prompt of several chunks"), params)
    text = "".join(stream_deltas(engine, gen))
    assert gen.finish_reason == "stop" and text == gen.text and _valid(text, schema)
    (alone,) = generate_batch(model, [list(b"a prompt of several chunks")], params, tokenizer=TOK)
    assert alone.token_ids == gen.token_ids  # seeded: the same output unchunked, alone


def test_a_bad_schema_or_a_vocabulary_that_cannot_write_it_is_refused_naming_the_field() -> None:
    for bad in ({"type": "foo"}, {"minLength": "a"}, "[1, 2]", "not json", 7):
        with pytest.raises(InvalidSamplingParam, match="json_schema"):
            SamplingParams(json_schema=bad)
    assert SamplingParams(json_schema=JSON_OBJECT).json_schema == '{"type": "object"}'
    chars = CharTokenizer.from_text("abc 123")  # no "{" to start an object with
    with pytest.raises(InvalidSamplingParam, match="cannot be written in this model's vocabulary"):
        row_grammar(_constraint(JSON_OBJECT), chars, frozenset())


# ---------------------------------------------------------------------------------------------------------
# The CLI: gptlab sample --json-schema FILE / --json
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def json_checkpoint(tmp_path_factory):
    from gptlab.checkpoint import save_model

    # no end-of-text token: a row ends where its grammar does
    tok = CharTokenizer.from_text('abcdefghijklmnopqrstuvwxyz {}[]":,0123456789-.\n')
    model = tiny_model(vocab_size=tok.vocab_size, block_size=128)
    return save_model(tmp_path_factory.mktemp("json") / "ckpt", model, tok)


def test_sample_writes_json_under_a_schema_file(json_checkpoint, tmp_path, capsys) -> None:
    from gptlab.cli import main

    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "tag": {"enum": ["abc", "xyz"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for flags, want in ((["--json-schema", str(path)], schema), (["--json"], JSON_OBJECT)):
        assert main(["sample", str(json_checkpoint), "--prompt", "a", "--max-new-tokens", "100", "--seed", "1",
                     *flags]) == 0
        out = capsys.readouterr().out
        assert out.startswith("a") and out.endswith("\n---------------\n")
        assert _valid(out[1 : -len("\n---------------\n")], want), out


@pytest.mark.parametrize("content, message", [
    (None, "not found"), ("{oops", "cannot read"), ("[1]", "should hold a JSON object"),
    ('{"type": "foo"}', "--json-schema is not a schema gptlab can enforce"),
])
def test_sample_with_a_bad_schema_file_is_one_line_exit_2(json_checkpoint, tmp_path, capsys, content,
                                                           message) -> None:
    from gptlab.cli import main

    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    assert main(["sample", str(json_checkpoint), "--json-schema", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1


def test_sample_json_on_a_vocabulary_without_braces_names_the_flag_given(tmp_path, capsys) -> None:
    from gptlab.checkpoint import save_model
    from gptlab.cli import main

    tok = CharTokenizer.from_text("abc 123")  # a char model trained on text without '{'
    ckpt = save_model(tmp_path / "ckpt", tiny_model(vocab_size=tok.vocab_size), tok)
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    for flags, want in ((["--json"], "--json: this model's vocabulary cannot spell JSON"),
                        (["--json-schema", str(schema)], f"cannot be written in this model's vocabulary: no token "
                                                         f"starts an output it allows (the schema in {schema})")):
        assert main(["sample", str(ckpt), "--prompt", "a", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # (after a first run's kernel-build note)
        assert err.startswith("error: ") and want in err, err
        assert "grammars" not in err and ("--json-schema" in err) == (flags[0] == "--json-schema"), err


# ---------------------------------------------------------------------------------------------------------
# The server: response_format json_object / json_schema, rows with and without grammars in one batch
# ---------------------------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def served(model):
    pytest.importorskip("fastapi")
    from gptlab.serve import ServerThread, create_app

    app = create_app(model, TOK, model_name="m", max_batch=4, ui=False, prefill_chunk=4)
    with ServerThread(app) as server:
        yield server


def _post(server, path: str, body: dict):
    import httpx

    return httpx.post(server.url + path, json={"model": "m", **body}, timeout=60)


def test_server_mixed_batch_answers_json_where_asked(served, model) -> None:
    from concurrent.futures import ThreadPoolExecutor

    chat = {"messages": [{"role": "user", "content": "who is it?"}], "max_tokens": 100, "temperature": 0.8, "seed": 1}
    # a random model's strings and objects end at random, most often after max_tokens: the json_object row's bias
    # on '"' and '}' closes them within a few tokens each (and a logit bias works inside the grammar's mask)
    closing = {"logit_bias": {str(ord('"')): 6, str(ord("}")): 6}}
    requests = [
        ("/v1/chat/completions", {**chat, "response_format": AS_SCHEMA}, SCHEMA),
        ("/v1/chat/completions", {**chat, **closing, "response_format": {"type": "json_object"}}, JSON_OBJECT),
        ("/v1/completions", {"prompt": "a long prompt, prefilled in chunks", "max_tokens": 100, "temperature": 0,
                             "response_format": AS_SCHEMA}, SCHEMA),
        ("/v1/completions", {"prompt": "free text", "max_tokens": 20, "temperature": 0}, None),
        ("/v1/completions", {"prompt": "free", "max_tokens": 20, "response_format": {"type": "text"}}, None),
    ]
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: _post(served, r[0], r[1]), requests))
    for (route, _, schema), r in zip(requests, answers, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "chat" in route else choice["text"]
        if schema is not None:
            assert choice["finish_reason"] == "stop" and _valid(text, schema), text
    (free,) = generate_batch(model, [TOK.encode("free text")], SamplingParams(max_new_tokens=20, temperature=0),
                             tokenizer=TOK)
    assert answers[3].json()["choices"][0]["text"] == free.text  # the free row as the engine writes it alone


def test_server_streams_json_and_cuts_at_max_tokens_with_length(served) -> None:
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=100,
                                            response_format=AS_SCHEMA, stream=True, seed=2)
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert chunks[-1].finish_reason == "stop" and _valid(text, SCHEMA)
    cut = client.completions.create(model="m", prompt="hi", max_tokens=4, extra_body={"response_format": AS_SCHEMA})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].text == '{"na'


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": "a"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "xml"},
    "json",
])
def test_server_refuses_a_bad_response_format_naming_it(served, response_format) -> None:
    for route, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "a"}]})):
        r = _post(served, route, {**body, "response_format": response_format})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_grammar_masks_set_forbidden_logits_to_minus_infinity_and_leave_the_rest(monkeypatch) -> None:
    """apply_grammars against masked_fill: allowed logits unchanged to the bit, forbidden ones -inf (a +inf one
    too, not NaN), rows without a grammar untouched, the caller's logits not written."""
    import gptlab.generation.grammar as grammar
    from gptlab.generation.logit_filters import apply_grammars

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 300, generator=g) * 5
    logits[0, 7] = float("inf")
    before = logits.clone()
    allowed = torch.rand(2, 300, generator=g) > 0.6
    allowed[1, 11], allowed[0, 7], allowed[0, 8] = True, False, True
    logits[0, 8] = float("inf")  # an allowed +inf stays +inf
    before = logits.clone()
    monkeypatch.setattr(grammar, "allowed_tokens", lambda grammars, vocab: allowed)
    rule = object()
    for grammars, rows in (([rule, None, rule], [0, 2]), ([rule, rule], [0, 1])):
        x = before[: len(grammars)]
        got = apply_grammars(x, grammars)
        expected = x.clone()
        expected[rows] = x[rows].masked_fill(~allowed, float("-inf"))
        assert torch.equal(got, expected) and torch.equal(x, before[: len(grammars)])


class _Allowed:
    """A stand-in grammar: row `row` of a fixed 0/1 mask, which the patched `allowed_tokens` returns."""

    def __init__(self, mask: torch.Tensor, row: int) -> None:
        self.mask, self.row = mask, row

    def allows(self, token: int) -> bool:
        return bool(self.mask[self.row, token])


def _patch_masks(monkeypatch, mask: torch.Tensor) -> list[int]:
    """allowed_bits answering from `mask` for _Allowed grammars; returns the list of batch sizes asked for."""
    import gptlab.generation.grammar as grammar

    asked: list[int] = []

    def fake(grammars, vocab):  # noqa: ANN001, ANN202
        asked.append(len(grammars))
        return packed_mask(mask[[g.row for g in grammars]])

    monkeypatch.setattr(grammar, "allowed_bits", fake)
    return asked


def test_a_constrained_row_samples_its_distribution_restricted_to_what_its_grammar_allows(monkeypatch) -> None:
    """Without filters a row draws as if free and draws again under its mask only where its token is forbidden:
    the tokens follow softmax(logits / T) restricted to the allowed set (an analytic reference, 40,000 draws
    within 5 standard errors each), never a forbidden one, and only the rows that drew a forbidden token ask
    for a mask."""
    from gptlab.generation.sampling import sample_next

    V, n = 8, 40_000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 3.0, -1.0])
    allowed = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    p = torch.softmax(logits.double() / 0.7, -1)
    expected = torch.where(allowed, p, 0.0) / p[allowed].sum()
    asked = _patch_masks(monkeypatch, allowed[None])
    torch.manual_seed(0)
    got = torch.tensor(sample_next(logits.expand(n, V), [SamplingParams(temperature=0.7)] * n, [None] * n,
                                   grammars=[_Allowed(allowed[None], 0)] * n))
    freq = torch.bincount(got, minlength=V).double() / n
    assert (freq[~allowed] == 0).all()
    assert ((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-12).all(), (freq, expected)
    forbidden_first = n * (1 - p[allowed].sum().item())  # rows that asked: ~Binomial(n, the forbidden share)
    assert len(asked) == 1 and abs(asked[0] - forbidden_first) <= 5 * forbidden_first**0.5


def test_only_rows_that_drew_a_forbidden_token_are_masked_and_greedy_rows_take_the_allowed_argmax(
        monkeypatch) -> None:
    """A row whose free draw is allowed keeps it, no mask asked; a greedy row whose argmax is forbidden takes the
    allowed argmax; a sampled row whose allowed tokens all underflow in the free softmax still gets one; rows
    without a grammar draw as they would alone."""
    from gptlab.generation.sampling import sample_next

    V = 300
    logits = torch.zeros(4, V)
    logits[0, 10] = 80.0  # row 0: the free draw (token 10, probability ~1) is allowed: kept, no mask
    logits[1, 20], logits[1, 21] = 9.0, 8.0  # row 1 (greedy): 20 forbidden, 21 the allowed argmax
    logits[2, 30], logits[2, :30] = 200.0, -200.0  # row 2: only 0..29 allowed, all of them underflow beside 30
    logits[3, 40] = 80.0  # row 3: no grammar
    allowed = torch.zeros(3, V, dtype=torch.bool)
    allowed[0, 10] = allowed[0, 11] = True
    allowed[1] = True
    allowed[1, 20] = False
    allowed[2, :30] = True
    asked = _patch_masks(monkeypatch, allowed)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    got = sample_next(logits, params, gens, grammars=[_Allowed(allowed, 0), _Allowed(allowed, 1),
                                                      _Allowed(allowed, 2), None])
    assert got[0] == 10 and got[1] == 21 and 0 <= got[2] < 30 and got[3] == 40
    assert asked == [2]  # rows 1 and 2, once (row 2's mask then went on its logits: the underflow)
    assert sample_next(logits[:1], params[:1], gens[:1], grammars=[_Allowed(allowed, 0)]) == [10] and asked == [2]


def test_a_seeded_constrained_row_draws_the_same_token_whether_or_not_another_row_filters(monkeypatch) -> None:
    """A constrained row that does not filter draws as it does alone (free draw, then the mask where forbidden)
    beside a row that filters, constrained or not: its seed gives the same token whatever shares the batch."""
    from gptlab.generation.sampling import sample_next

    V = 300
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 2
    allowed = torch.rand(2, V, generator=g) > 0.5
    _patch_masks(monkeypatch, allowed)
    own = SamplingParams(temperature=0.9)
    for seed in range(40):
        alone = sample_next(logits[:1], [own], [torch.Generator().manual_seed(seed)],
                            grammars=[_Allowed(allowed, 0)])
        for other, grammar in ((SamplingParams(top_k=5), None), (SamplingParams(top_p=0.5), _Allowed(allowed, 1))):
            both = sample_next(logits[:2], [own, other], [torch.Generator().manual_seed(seed), None],
                               grammars=[_Allowed(allowed, 0), grammar])
            assert both[0] == alone[0], (seed, other)


@settings(max_examples=15, deadline=None)
@given(schema=_schemas, seed=st.integers(0, 2**31))
def test_a_grammar_allows_one_token_exactly_where_its_mask_does(schema, seed) -> None:
    """RowGrammar.allows (llguidance's check of one token, and the stop token where the JSON is complete) against
    allowed_tokens' mask, at every state of a random walk through the grammar's allowed tokens."""
    g = row_grammar(_constraint(schema), TOK, frozenset({TOK.eot_id}))
    rng = torch.Generator().manual_seed(seed)
    for _ in range(30):
        mask = allowed_tokens([g], 260)[0]  # a model vocabulary padded past the tokenizer's
        assert [g.allows(t) for t in range(260)] == mask.bool().tolist()
        choices = mask.nonzero().flatten()
        token = int(choices[torch.randint(len(choices), (), generator=rng)])
        if token == TOK.eot_id or g.advance(token):
            break


def test_rows_of_one_schema_share_its_compiled_start_but_not_their_state() -> None:
    """row_grammar keeps each recent grammar's checked start and gives every row a copy: two rows of one schema
    advance independently, a later row starts fresh, and a schema that fails its check fails every time."""
    first = row_grammar(_constraint(JSON_OBJECT), TOK, frozenset({TOK.eot_id}))
    second = row_grammar(_constraint(JSON_OBJECT), TOK, frozenset({TOK.eot_id}))
    assert first.matcher is not second.matcher
    first.advance(ord("{"))
    assert torch.nonzero(allowed_tokens([second], 257)[0]).flatten().tolist() == [ord("{")]
    assert torch.nonzero(allowed_tokens([first], 257)[0]).flatten().tolist() == [ord('"'), ord("}")]
    assert first.advance(ord("}")) and not second.done
    third = row_grammar(_constraint(JSON_OBJECT), TOK, frozenset({TOK.eot_id}))
    assert torch.nonzero(allowed_tokens([third], 257)[0]).flatten().tolist() == [ord("{")]
    digits_only = CharTokenizer(list("0123456789"))  # a vocabulary that cannot open an object
    for _ in range(2):
        with pytest.raises(InvalidSamplingParam, match="cannot be written"):
            row_grammar(_constraint(JSON_OBJECT), digits_only, frozenset())


@pytest.mark.parametrize("repetition_penalty", [5e-324, 1e-30, 1e30, 1e308])
@pytest.mark.parametrize("extra", [{"temperature": 0.8}, {"temperature": 0.8, "top_k": 5}, {"temperature": 0}])
def test_a_penalty_that_overflows_the_logits_still_keeps_the_row_in_its_grammar(model, repetition_penalty,
                                                                                extra) -> None:
    """A penalty that overflows a row's logits to +-inf makes its softmax NaN, and a draw from NaN weights any
    token: a constrained row then takes its most likely allowed token, so what ends with "stop" validates."""
    params = SamplingParams(max_new_tokens=40, seed=3, json_schema=SCHEMA, repetition_penalty=repetition_penalty,
                            **extra)
    gens = generate_batch(model, [list(b'{"name"'), list(b"x")], params, tokenizer=TOK)
    for g in gens:
        assert g.finish_reason in ("stop", "length"), g.finish_reason
        assert g.finish_reason == "length" or _valid(g.text, SCHEMA), g.text
