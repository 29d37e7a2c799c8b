"""Tool calls: the openai client's tool-calling loop against the in-process server, under a Qwen-style and a
Llama-3-style chat template (tests/data/templates), with a tiny random model whose grammar forces valid calls.

Checked against independent references: every call's arguments validate against its function's schema with
`jsonschema`; the prompt of a turn that feeds calls and results back is the template rendered by plain Jinja2 on
the messages in transformers' shape (a byte tokenizer: its tokens are the text's bytes); streamed deltas add up to
the answer the same seeded request gets unstreamed; the reader of replies (`split_reply`) reads every beginning of
a reply as a beginning of what the whole reads as (a property test)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers import ByteTokenizer, templated_byte_tokenizer, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from gptlab.generation import InvalidSamplingParam, SamplingParams  # noqa: E402
from gptlab.generation.grammar import allowed_tokens, row_grammar  # noqa: E402
from gptlab.generation.tool_calls import ContentLooksLikeCalls, generate_tool_reply, tool_grammar  # noqa: E402
from gptlab.serve import ServerThread, create_app  # noqa: E402
from gptlab.tokenizer.chat_template import chat_template_for  # noqa: E402
from gptlab.tokenizer.tool_syntax import (  # noqa: E402
    NoToolSupportError,
    ToolSyntax,
    final_reply,
    split_reply,
    tool_syntax,
)

pytestmark = pytest.mark.usefixtures("one_thread")
TEMPLATES = Path(__file__).parent / "data" / "templates"

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n}.", "parameters": s}}
         for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
# an agent's output type (the OpenAI Agents SDK sends it as response_format beside the tools)
REPORT = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["qwen_tools", "llama3_tools", None])
def served(request):
    tok = templated_byte_tokenizer(request.param)
    model = tiny_model(vocab_size=257, block_size=2048)
    with ServerThread(create_app(model, tok, model_name="m", max_batch=2, ui=False)) as server:
        yield server, tok, request.param


@pytest.fixture
def templated(served):
    if served[2] is None:
        pytest.skip("the template without tools is tested on its own")
    return served


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


def _valid_calls(calls) -> bool:  # noqa: ANN001
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return True


def _reference_prompt(tok: ByteTokenizer, messages: list[dict], tools: list[dict]) -> str:
    """The template rendered by Jinja2 itself, as transformers renders one (no gptlab code)."""
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(jinja2.exceptions.TemplateError(message))
    return env.from_string(tok.chat_template).render(messages=messages, tools=tools, add_generation_prompt=True,
                                                     bos_token="", eos_token="")


# ---------------------------------------------------------------------------------------------------------
# The call syntax, read off each template, and replies read back
# ---------------------------------------------------------------------------------------------------------
def test_the_call_syntax_is_read_off_each_template() -> None:
    qwen = tool_syntax(chat_template_for(templated_byte_tokenizer("qwen_tools")))
    assert qwen == ToolSyntax('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", parallel=True)
    llama = tool_syntax(chat_template_for(templated_byte_tokenizer("llama3_tools")))
    assert llama == ToolSyntax('{"name": "', '", "parameters": ', "}", parallel=False)  # one call per turn
    with pytest.raises(NoToolSupportError, match="does not render tools"):
        tool_syntax(chat_template_for(templated_byte_tokenizer(None)))


_args = st.dictionaries(st.sampled_from(["a", "b", "x y"]), st.one_of(
    st.integers(-99, 99), st.text(max_size=4), st.lists(st.booleans(), max_size=2)), max_size=3)


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["f", "get_weather"]), _args), max_size=3),
       text=st.text(max_size=8), qwen=st.booleans())
def test_every_beginning_of_a_reply_reads_as_a_beginning_of_the_whole(calls, text, qwen) -> None:
    syntax = (ToolSyntax('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n") if qwen
              else ToolSyntax('{"name": "', '", "parameters": ', "}"))
    whole = (syntax.separator.join(syntax.call_text(n, json.dumps(a)) for n, a in calls) if calls
             else text if not text.startswith(syntax.prefix) else "")
    want = final_reply(whole, syntax)
    assert want.calls == [(n, json.dumps(a)) for n, a in calls] and want.content == ("" if calls else whole)
    assert not want.cut  # whole calls (or text)
    for end in range(len(whole) + 1):
        part = split_reply(whole[:end], syntax)
        assert want.content.startswith(part.content) and len(part.calls) <= len(want.calls)
        assert all(w[0] == p[0] and w[1].startswith(p[1]) for p, w in zip(part.calls, want.calls, strict=False))
        if part.calls and part.calls[-1] != want.calls[len(part.calls) - 1]:
            assert part.cut  # arguments cut short


def _allowed(grammar, text: str) -> set[str]:  # noqa: ANN001
    """The characters the grammar allows after `text` (asserting each of its bytes was allowed)."""
    for byte in text.encode():
        assert allowed_tokens([grammar], 257)[0, byte], text
        grammar.advance(byte)
    return {chr(t) for t in allowed_tokens([grammar], 257)[0].nonzero().flatten().tolist() if t < 256}


def test_each_tool_choice_allows_exactly_its_replies() -> None:
    tok = templated_byte_tokenizer("qwen_tools")
    syntax = tool_syntax(chat_template_for(tok))

    def grammar(choice: str, parallel: bool = True):  # noqa: ANN202
        params = SamplingParams(grammar=tool_grammar(syntax, TOOLS, choice, parallel))
        return row_grammar(params.constraint(), tok, frozenset({tok.eot_id}))

    # a character's first byte: ASCII, or a UTF-8 lead byte (the analytic reference for "any text")
    text_start = {chr(b) for b in [*range(128), *range(0xC2, 0xF5)]}
    assert _allowed(grammar("auto"), "") == text_start  # text, or the call prefix
    assert _allowed(grammar("auto"), syntax.prefix) == {"g", "a"}  # the prefix commits to a call of a given tool
    assert _allowed(grammar("auto"), "<tool_x") == text_start  # text that leaves the prefix is text
    assert _allowed(grammar("required"), "") == {"<"}
    assert _allowed(grammar("add"), syntax.prefix) == {"a"}
    assert _allowed(grammar("none"), syntax.prefix[:-1]) == text_start - {'"'}  # never the prefix
    call = syntax.call_text("add", '{"a": 1, "b": 2}')
    several, one = grammar("required"), grammar("required", parallel=False)
    assert _allowed(several, call) == {"\n"} and several.accepting  # another call, or the end
    assert _allowed(one, call) == set() and one.done
    assert _allowed(grammar("add"), syntax.prefix + 'add", "arguments": {"a": 1, "b": ') <= set("-0123456789")


def test_a_content_schema_makes_text_json_of_it_beside_the_calls() -> None:
    tok = templated_byte_tokenizer("qwen_tools")
    syntax = tool_syntax(chat_template_for(tok))

    def grammar(choice: str):  # noqa: ANN202
        params = SamplingParams(grammar=tool_grammar(syntax, TOOLS, choice, content_schema=REPORT))
        return row_grammar(params.constraint(), tok, frozenset({tok.eot_id}))

    assert _allowed(grammar("auto"), "") == {"{", "<"}  # the JSON's object, or the call prefix
    assert _allowed(grammar("auto"), '{"answer":"a","sure":') == {"t", "f"}  # json_schema's compact form
    assert _allowed(grammar("none"), "") == {"{"}
    assert _allowed(grammar("required"), "") == {"<"}  # calls have no content
    llama = tool_syntax(chat_template_for(templated_byte_tokenizer("llama3_tools")))
    with pytest.raises(ContentLooksLikeCalls, match="writes tool calls as JSON"):
        tool_grammar(llama, TOOLS, "auto", content_schema=REPORT)
    tool_grammar(llama, TOOLS, "required", content_schema=REPORT)


def test_a_grammar_is_checked_as_a_schema_is() -> None:
    assert SamplingParams(grammar='start: "a"').constraint() == ("grammar", 'start: "a"')
    for bad, words in (("start: (", "is not a grammar gptlab can enforce"), (7, "must be a grammar")):
        with pytest.raises(InvalidSamplingParam, match=words):
            SamplingParams(grammar=bad)
    with pytest.raises(InvalidSamplingParam, match="cannot be given with json_schema"):
        SamplingParams(grammar='start: "a"', json_schema={"type": "object"})


def test_a_schema_too_wide_past_the_calls_forced_start_is_refused_before_any_prefill() -> None:
    """The grammar of a call of a 1,000-property function passes its first mask, then goes past llguidance's limits
    a few tokens into the forced `<tool_call>{"name": "f", "arguments": {`: refused when the row is made (before its
    prompt, holding the tools' schemas, is prefilled), naming the field. One of 100 properties is accepted."""
    tok = templated_byte_tokenizer("qwen_tools")
    syntax = tool_syntax(chat_template_for(tok))

    def grammar(properties: int) -> tuple[str, str]:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
        return "tools", tool_grammar(syntax, [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                                     "required")

    row_grammar(grammar(100), tok, frozenset())
    with pytest.raises(InvalidSamplingParam, match="tools is too large for gptlab's grammar engine"):
        row_grammar(grammar(1000), tok, frozenset())


def test_the_python_api_calls_as_the_server_does(templated) -> None:
    server, tok, _ = templated
    model = tiny_model(vocab_size=257, block_size=2048)  # the served model's weights (same seed)
    reply, gen = generate_tool_reply(model, tok, ASK, TOOLS, tool_choice="get_weather", parallel=False,
                                     params=SamplingParams(temperature=0, max_new_tokens=300))
    (name, arguments), = reply.calls
    jsonschema.validate(json.loads(arguments), WEATHER)
    out = _client(server).chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0,
                                                  max_tokens=300, tool_choice={"type": "function", "function": {
                                                      "name": "get_weather"}}, parallel_tool_calls=False)
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (name, arguments) == ("get_weather", arguments)
    assert gen.finish_reason == "stop" and out.choices[0].finish_reason == "tool_calls"


# ---------------------------------------------------------------------------------------------------------
# The openai client's loop, end to end
# ---------------------------------------------------------------------------------------------------------
def test_the_openai_tool_loop_runs_end_to_end(templated) -> None:
    server, tok, _ = templated
    client = _client(server)
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=300)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and _valid_calls([call])
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
    history = [*ASK, choice.message.model_dump(exclude_none=True), result]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=5)
    assert second.choices[0].message.tool_calls is None and isinstance(second.choices[0].message.content, str)
    # the calls and the result reached the template as transformers passes them
    fed = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": "sunny, 21 C"}]
    assert second.usage.prompt_tokens == len(_reference_prompt(tok, fed, TOOLS).encode())


def test_a_named_function_is_called_and_auto_replies_are_text_or_valid_calls(templated) -> None:
    client = _client(templated[0])
    named = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=300, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add" and _valid_calls([call]) and named.choices[0].finish_reason == "tool_calls"
    kinds = set()
    for seed in range(6):
        out = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, seed=seed, max_tokens=120,
                                             temperature=1.0, parallel_tool_calls=False)
        message = out.choices[0].message
        kinds.add("calls" if message.tool_calls else "text")
        if message.tool_calls:
            assert message.content is None and _valid_calls(message.tool_calls)
        else:
            assert isinstance(message.content, str) and out.choices[0].finish_reason in ("stop", "length")
    assert kinds  # (which kinds a random model picks is its own; each is well formed)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_deltas_add_up_to_the_unstreamed_answer(templated, choice) -> None:
    client = _client(templated[0])
    body = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=11, max_tokens=160)
    answer = client.chat.completions.create(**body)
    plain, plain_usage = answer.choices[0], answer.usage
    content, calls, finish = "", {}, None
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == plain_usage.completion_tokens and not chunks[-1].choices
    for chunk in chunks[:-1]:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    want = [(c.function.name, c.function.arguments) for c in plain.message.tool_calls or []]
    assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == want
    assert content == (plain.message.content or "") and finish == plain.finish_reason
    assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_call_cut_by_max_tokens_is_a_cut_call_never_its_marker_as_content(templated, choice) -> None:
    """As OpenAI answers a call cut by max_tokens: finish_reason "length", content null, and the calls whose name
    was written, the last one's arguments cut short. Under tool_choice "required" or a named function the reply can
    only be calls, so a reply cut inside the call's opening (Qwen's `<tool_call>\\n{"name": "`) is a call cut
    before its name: no content (it used to come back as content, "<"), no call; streamed alike."""
    server, tok, _ = templated
    client = _client(server)
    syntax = tool_syntax(chat_template_for(tok))
    name_end = len(syntax.prefix) + len("add") + len(syntax.middle)  # (bytes: one token each)
    for max_tokens in (1, len(syntax.prefix) - 1, name_end + 3):
        body = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=max_tokens)
        out = client.chat.completions.create(**body)
        (answer,) = out.choices
        assert answer.finish_reason == "length" and answer.message.content is None, (max_tokens, answer)
        assert out.usage.completion_tokens == max_tokens
        calls = answer.message.tool_calls or []
        if max_tokens < len(syntax.prefix):
            assert calls == []
        elif choice != "required":  # (the name "required" picks is the model's)
            (call,) = calls
            assert call.function.name == "add" and call.function.arguments == '{"a'  # cut short
        streamed = list(client.chat.completions.create(**body, stream=True))
        assert all(not c.choices[0].delta.content for c in streamed)
        names = [d.function.name for c in streamed for d in c.choices[0].delta.tool_calls or [] if d.function.name]
        assert names == [c.function.name for c in calls] and streamed[-1].choices[0].finish_reason == "length"
    reply, gen = generate_tool_reply(tiny_model(vocab_size=257, block_size=2048), tok, ASK, TOOLS,
                                     tool_choice="required", params=SamplingParams(temperature=0, max_new_tokens=1))
    assert (reply.content, reply.calls, gen.finish_reason) == ("", [], "length") and gen.text == syntax.prefix[0]


def test_a_call_cut_by_a_stop_string_does_not_finish_as_tool_calls(templated) -> None:
    """finish_reason "tool_calls" says the calls are whole: a stop string met inside a call's arguments ends the
    reply with "stop" and the call cut short (it used to say "tool_calls" over arguments that are not JSON, which
    a client then runs); one met after the arguments (in Qwen's `</tool_call>`) leaves the call whole."""
    server, _, template = templated
    client = _client(server)
    named = {"type": "function", "function": {"name": "add"}}
    stops = {'"b"': "stop"} | ({"</tool_call>": "tool_calls"} if template == "qwen_tools" else {})
    for stop, finish in stops.items():
        body = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=named, stop=[stop], temperature=1.0, seed=2,
                    max_tokens=300)
        (answer,) = client.chat.completions.create(**body).choices
        (call,) = answer.message.tool_calls
        assert answer.finish_reason == finish and answer.message.content is None, (stop, answer)
        if finish == "stop":
            assert call.function.arguments.startswith('{"a": ') and call.function.arguments.endswith(", ")
        else:
            assert _valid_calls([call])
        streamed = list(client.chat.completions.create(**body, stream=True))
        assert streamed[-1].choices[0].finish_reason == finish


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_a_developer_message_reaches_the_template_as_the_system_message(templated, tools) -> None:
    """OpenAI's `developer` role is its newer name for `system`; a template that does not know it (Qwen's, Llama
    3.1's) dropped the message (Qwen's writes only system, user, assistant and tool turns) or, with tools, took it
    for the first user turn (Llama 3.1's). It goes to the template as a system message: the prompt is the
    reference rendering of the same messages with role "system"."""
    server, tok, _ = templated
    said = [{"role": "developer", "content": "Answer in French."}, *ASK]
    out = _client(server).chat.completions.create(model="m", messages=said, max_tokens=1, **(
        {"tools": tools} if tools else {}))
    want = _reference_prompt(tok, [{**said[0], "role": "system"}, *ASK], tools)
    assert "Answer in French." in want and out.usage.prompt_tokens == len(want.encode())


# ---------------------------------------------------------------------------------------------------------
# Bad requests: a 400 naming the field
# ---------------------------------------------------------------------------------------------------------
def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 2,
                                                                  **body}, timeout=120)


def _refused(r: httpx.Response, param: str, words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_bad_tools_and_tool_choice_are_refused_naming_the_field(templated) -> None:
    server, _, template = templated
    weather = TOOLS[0]["function"]
    _refused(_post(server, {"tool_choice": "auto"}), "tool_choice", "only allowed when 'tools'")
    _refused(_post(server, {"parallel_tool_calls": False}), "parallel_tool_calls", "only allowed when 'tools'")
    _refused(_post(server, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
             "tool_choice", "'nope'")
    _refused(_post(server, {"tools": TOOLS, "tool_choice": "sometimes"}), "tool_choice", "Invalid value")
    _refused(_post(server, {"tools": [TOOLS[0], TOOLS[0]]}), "tools", "own name")
    _refused(_post(server, {"tools": [{"type": "function", "function": {**weather, "name": "a b"}}]}), "tools",
             "Invalid value")
    _refused(_post(server, {"tools": [{"type": "function", "function": {**weather, "parameters": {
        "type": "array"}}}]}), "tools", "object's schema")
    _refused(_post(server, {"tools": [{"type": "retrieval"}]}), "tools", "Invalid value")
    _refused(_post(server, {"functions": [weather]}), "functions", "use tools")
    bad_args = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]
    _refused(_post(server, {"tools": TOOLS, "messages": bad_args}), "messages", "not JSON")
    _refused(_post(server, {"tools": TOOLS, "messages": [*ASK, {"role": "tool", "tool_call_id": "x",
                                                                "content": "1"}]}), "messages", "tool_call_id")


def test_a_call_fed_back_with_empty_arguments_reads_as_no_arguments(templated) -> None:
    """Some APIs write "" as the arguments of a function that takes none; fed back, it is the empty object, as the
    template would render "{}"."""
    from gptlab.serve.schemas import ChatRequest
    from gptlab.serve.tools import template_messages

    server, tok, _ = templated
    def fed(arguments: str) -> list[dict]:
        return [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "now", "arguments": arguments}}]}, {"role": "tool", "tool_call_id": "c1", "content": "noon"}]

    tools = [*TOOLS, {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    template = chat_template_for(tok)
    empty, braces = (template_messages(ChatRequest.model_validate({"messages": fed(a), "tools": tools}), template)
                     for a in ("", "{}"))
    assert empty == braces and empty[1]["tool_calls"][0]["function"]["arguments"] == {}
    r = _post(server, {"tools": tools, "messages": fed("  ")})
    assert r.status_code == 200, r.text


def test_parallel_tool_calls_true_allows_several_calls_where_the_template_renders_them(templated) -> None:
    """parallel_tool_calls true permits several calls in a turn, as OpenAI's default does: a template that renders
    one call per turn (Llama 3.1's) makes one, as llama.cpp's server does, rather than refusing what clients send
    by default; elsewhere a turn may hold several."""
    server, tok, template = templated
    syntax = tool_syntax(chat_template_for(tok))
    out = _client(server).chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=True, temperature=0, max_tokens=300)
    calls, finish = out.choices[0].message.tool_calls, out.choices[0].finish_reason
    whole = calls[:-1] if finish == "length" else calls  # (max_tokens may cut the last call's arguments)
    assert calls and _valid_calls(whole) and (len(calls) == 1 or template != "llama3_tools")
    assert finish == "tool_calls" or template != "llama3_tools"
    one, several = tool_grammar(syntax, TOOLS, "required", parallel=True), tool_grammar(syntax, TOOLS, "required",
                                                                                        parallel=False)
    assert (one == several) == (template == "llama3_tools")


def test_response_format_beside_tools_makes_the_content_json_of_its_schema(templated) -> None:
    """As an agent with an output type asks (the OpenAI Agents SDK): under "auto" each reply is valid calls or JSON
    content of the schema, under "required" calls, under "none" that JSON; the Python API alike. A template that
    writes calls as bare JSON (Llama 3.1's) cannot tell such content from calls: "auto" is a 400 naming
    response_format there."""
    server, tok, template = templated
    client = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    ask = dict(model="m", messages=ASK, tools=TOOLS, response_format=fmt, max_tokens=200, parallel_tool_calls=False)
    if template == "llama3_tools":
        _refused(_post(server, {"tools": TOOLS, "response_format": fmt}), "response_format", "tool_choice")
    else:
        for seed in range(4):
            out = client.chat.completions.create(**ask, seed=seed, temperature=1.0)
            message, finish = out.choices[0].message, out.choices[0].finish_reason
            if message.tool_calls:
                assert message.content is None and _valid_calls(message.tool_calls) and finish == "tool_calls"
            else:
                jsonschema.validate(json.loads(message.content), REPORT)
                assert finish == "stop", out
    required = client.chat.completions.create(**ask, tool_choice="required", temperature=0)
    assert _valid_calls(required.choices[0].message.tool_calls) and required.choices[0].message.content is None
    none = client.chat.completions.create(**ask, tool_choice="none", temperature=0)
    jsonschema.validate(json.loads(none.choices[0].message.content), REPORT)
    model = tiny_model(vocab_size=257, block_size=2048)  # the served model's weights (same seed)
    reply, _ = generate_tool_reply(model, tok, ASK, TOOLS, tool_choice="none", json_schema=REPORT,
                                   params=SamplingParams(temperature=0, max_new_tokens=200))
    assert reply.content == none.choices[0].message.content and not reply.calls


def test_a_template_without_tools_is_a_clear_400(served) -> None:
    server, _, template = served
    if template is not None:
        pytest.skip("this template takes tools")
    _refused(_post(server, {"tools": TOOLS}), "tools", "does not render tools")
    assert _post(server, {}).status_code == 200  # and the server goes on
