"""`gptlab.tokenizer.template_worker`: a model directory's chat template renders in a worker process whose time and
memory are bounded for real, one Jinja step included; it renders what the sandbox renders in process."""

from __future__ import annotations

import resource
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptlab.tokenizer import template_sandbox, template_worker
from gptlab.tokenizer.chat_template import BrokenChatTemplateError, ChatTemplate, ChatTemplateError

ORIGIN = "/models/m/chat_template.jinja"
TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
LINES = "{% set s = 'a\\n' * 3000000 %}"  # 6 M characters: under the sandbox's value bound

# one step of each runs long or grows memory where the sandbox's checks between steps cannot see it
ONE_LONG_STEP = {
    "indent-of-many-lines": (LINES + "{{ s | indent(1000) | length }}", "MiB of memory to render"),
    "expandtabs": ("{{ ('\\t' * 3000000).expandtabs(1000) | length }}", "MiB of memory to render"),
    "values-held-by-recursion": ("{% macro f(s) %}{{ f(s ~ 'x') }}{% endmacro %}{{ f('x' * 7000000) }}",
                                 "MiB of memory to render"),
    "hundreds-of-large-variables": ("".join(f"{{% set v{i} = 'x' * 7000000 ~ '{i}' %}}" for i in range(300)),
                                    "MiB of memory to render"),
    # runs long and grows: which bound it meets first depends on the machine's speed
    "wordwrap-of-millions-of-words": ("{{ ('a ' * 3500000) | wordwrap(1) | length }}",
                                      ("takes more than 0.5 s", "MiB of memory to render")),
    "brackets-nested-too-deep": ("{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}",
                                 "is not a valid Jinja template: maximum recursion depth exceeded"),
}


@pytest.fixture
def tight(monkeypatch):
    """Bounds small enough for a test to hit quickly: 0.5 s (+0.5 s before the kill), 128 MiB."""
    monkeypatch.setattr(template_sandbox, "MAX_RENDER_SECONDS", 0.5)
    monkeypatch.setattr(template_worker, "GRACE_SECONDS", 0.5)
    monkeypatch.setattr(template_worker, "MAX_RENDER_BYTES", 128 << 20)


@pytest.mark.parametrize("name", list(ONE_LONG_STEP))
def test_one_long_step_is_bounded_and_named(name: str, tight) -> None:
    source, fragment = ONE_LONG_STEP[name]
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(BrokenChatTemplateError) as caught:
        ChatTemplate(source, origin=ORIGIN).render(TURNS)
    message = str(caught.value)
    fragments = (fragment,) if isinstance(fragment, str) else fragment
    assert message.startswith(f"the chat template in {ORIGIN} ") and any(f in message for f in fragments), message
    assert "\n" not in message
    assert time.monotonic() - start < 30  # bounded, not hung (the bound itself is 1 s past the worker's start)
    # the memory went into the worker, not this process (ru_maxrss: KiB on Linux)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - held < 64 << 10


def test_a_worker_that_ran_out_is_replaced_and_the_next_template_renders(tight) -> None:
    bomb, fine = ONE_LONG_STEP["expandtabs"][0], "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
    for _ in range(2):
        with pytest.raises(BrokenChatTemplateError, match="MiB of memory"):
            ChatTemplate(bomb, origin=ORIGIN).render(TURNS)
        assert ChatTemplate(fine, origin=ORIGIN).render(TURNS) == "user=hi;assistant=hello;"


def test_a_killed_worker_is_replaced() -> None:
    template = ChatTemplate("{{ messages | length }}", origin=ORIGIN)
    assert template.render(TURNS) == "2"
    for worker in list(template_worker._pool.idle):
        worker.proc.kill()
        worker.proc.wait()
    assert template.render(TURNS[:1]) == "1"


def test_errors_keep_their_kind_across_the_process() -> None:
    with pytest.raises(ChatTemplateError) as caught:
        ChatTemplate("{{ raise_exception('no system role') }}", origin=ORIGIN).render(TURNS)
    assert not isinstance(caught.value, BrokenChatTemplateError)
    assert str(caught.value) == f"the chat template in {ORIGIN} could not render this conversation: no system role"
    with pytest.raises(BrokenChatTemplateError, match="is not a valid Jinja template: Expected an expression"):
        ChatTemplate("{% if %}", origin=ORIGIN).compile()


# contents with what a pipe of JSON lines must carry intact: newlines, quotes, non-ASCII, lone surrogates
contents = st.text(st.characters(codec=None, exclude_categories=["Cs"]) | st.sampled_from(["\n", '"', "\ud800"]),
                   max_size=40)
conversations = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), contents), min_size=1,
                         max_size=6)
SOURCE = ("{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}]{{ m.content | trim }}{{ eos_token }}"
          "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


@given(conversations)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_worker_renders_what_the_sandbox_renders_in_process(turns) -> None:
    messages = [{"role": r, "content": c} for r, c in turns]
    template = ChatTemplate(SOURCE, bos_token="<s>", eos_token="</s>", origin=ORIGIN)
    local = template_sandbox.compile_template(SOURCE)
    for gen in (False, True):
        context = dict(messages=messages, add_generation_prompt=gen, tools=None, documents=None, bos_token="<s>",
                       eos_token="</s>")
        assert template.render(messages, add_generation_prompt=gen) == template_sandbox.render_all(local,
                                                                                                     [context])[0]
