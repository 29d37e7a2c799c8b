"""`gptlab.tokenizer.chat_template`: rendering equals transformers' `apply_chat_template` on real-looking templates
(loaded through gptlab's own Hugging Face directory reader), and `segments` finds exactly the assistant's replies."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import GPT2_SKIP_REASON, gpt2_bpe_files, hf_tokenizer_dir

from gptlab.errors import GptlabError
from gptlab.tokenizer import load_tokenizer
from gptlab.tokenizer.chat_template import ChatTemplate, ChatTemplateError, chat_template_for, check_messages

# ChatML as Qwen writes it: a default system message, and a namespace to find out whether there is one
QWEN = """{%- set ns = namespace(has_system=false) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- set ns.has_system = true %}
    {%- endif %}
{%- endfor %}
{%- if not ns.has_system %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3: bos_token once, headers, trimmed content
LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Llama 3 again, the assistant's content in transformers' {% generation %} markers
LLAMA3_GENERATION = LLAMA3.replace(
    "  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}",
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{- message['content'] | trim + '<|eot_id|>' }}{% endif %}",
)

# Mistral-style [INST] turns: only user and assistant, anything else is rejected with raise_exception
MISTRAL = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, got ' + message['role']) }}
    {%- endif %}
{%- endfor %}
"""

# Zephyr-style: block tags on their own lines (trim_blocks / lstrip_blocks matter), tojson, loop.last
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'system' %}
<|system|>
{{ message['content'] | tojson }}{{ eos_token }}
{% else %}
<|{{ message['role'] }}|>
{{ message['content'] }}{{ eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
<|assistant|>
{% endif %}
{% endfor %}
"""

# name -> (template, bos, eos, end-of-turn marker after each reply, takes a system message)
TEMPLATES = {
    "qwen": (QWEN, None, "<|im_end|>", "<|im_end|>", True),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", True),
    "llama3-generation": (LLAMA3_GENERATION, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", True),
    "mistral": (MISTRAL, "<s>", "</s>", "</s>", False),
    "zephyr": (ZEPHYR, None, "</s>", "</s>", True),
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
           "<|end_header_id|>", "<s>", "</s>"]

SYSTEM = {"role": "system", "content": "Réponds brièvement, s'il te plaît 😀 \"quoted\""}
TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?\nOne word."},
    {"role": "assistant", "content": "Rome, the eternal city."},
]


def conversations(system: bool) -> list[list[dict[str, str]]]:
    """Single-turn, multi-turn, and (where the template takes one) multi-turn after a system message."""
    out = [TURNS[:2], TURNS, TURNS[:3]]
    return out + [[SYSTEM, *TURNS], [SYSTEM, TURNS[0]]] if system else out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    """name -> (transformers tokenizer with the template, the directory it saved): GPT-2's BPE plus the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    files = gpt2_bpe_files()
    if files is None:
        pytest.skip(GPT2_SKIP_REASON)
    base = Tokenizer(models.BPE.from_file(*map(str, files)))
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.decoder = decoders.ByteLevel()
    base.add_special_tokens(SPECIAL)
    out = {}
    for name, (template, bos, eos, _, _) in TEMPLATES.items():
        hf = PreTrainedTokenizerFast(tokenizer_object=base, bos_token=bos, eos_token=eos)
        hf.chat_template = template
        d = tmp_path_factory.mktemp(name)
        hf.save_pretrained(d)
        out[name] = (hf, d)
    return out


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_render_equals_transformers(hf_dirs, name: str) -> None:
    hf, d = hf_dirs[name]
    tok = load_tokenizer(d)  # gptlab's reader of a Hugging Face directory: template, bos and eos from its files
    template = chat_template_for(tok)
    assert template.name == "tokenizer" and template.source == TEMPLATES[name][0]
    for messages in conversations(TEMPLATES[name][4]):
        for k in range(1, len(messages) + 1):
            for gen in (False, True):
                ours = template.render(messages[:k], add_generation_prompt=gen)
                theirs = hf.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=gen)
                assert ours == theirs, (name, k, gen)


def test_raise_exception_rejects_like_transformers(hf_dirs) -> None:
    hf, d = hf_dirs["mistral"]
    template = chat_template_for(load_tokenizer(d))
    with pytest.raises(Exception, match="Only user and assistant roles are supported, got system"):
        hf.apply_chat_template([SYSTEM, *TURNS], tokenize=False)
    with pytest.raises(ChatTemplateError, match="could not render.*Only user and assistant roles are supported, got "
                       "system"):
        template.render([SYSTEM, *TURNS])
    with pytest.raises(ChatTemplateError, match="got system"):
        template.segments([SYSTEM, *TURNS])


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_segments_are_the_replies_and_their_end_of_turn_marker(hf_dirs, name: str) -> None:
    template = chat_template_for(load_tokenizer(hf_dirs[name][1]))
    marker = TEMPLATES[name][3]
    for messages in conversations(TEMPLATES[name][4]):
        pieces = template.segments(messages)
        assert "".join(text for text, _ in pieces) == template.render(messages)
        replies = [text for text, is_reply in pieces if is_reply]
        assert replies == [m["content"] + marker for m in messages if m["role"] == "assistant"]
        # the text before each reply is the prompt inference renders for it (the generation prompt included)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                prompt = template.render(messages[:i], add_generation_prompt=True)
                at = len(prompt)
                assert template.render(messages)[at : at + len(m["content"])] == m["content"]


@pytest.mark.parametrize(
    "name, reply",
    [("plain", lambda c: " " + c + "\n"), ("chatml", lambda c: c + "<|im_end|>")],
)
def test_builtin_segments(gpt2, name: str, reply) -> None:
    template = chat_template_for(gpt2, name)
    for messages in ([SYSTEM, *TURNS], TURNS[:2], TURNS[:3]):
        pieces = template.segments(messages)
        assert "".join(text for text, _ in pieces) == template.render(messages)
        assert [t for t, a in pieces if a] == [reply(m["content"]) for m in messages if m["role"] == "assistant"]
        assert all(a != b for (_, a), (_, b) in zip(pieces, pieces[1:], strict=False))  # neighbours merged
    assert template.segments(TURNS[:1]) == [(template.render(TURNS[:1]), False)]  # no reply: nothing to train on


def test_segments_of_a_conversation_opening_with_the_assistant(gpt2) -> None:
    pieces = chat_template_for(gpt2, "chatml").segments([{"role": "assistant", "content": "Hi!"}, TURNS[0]])
    assert pieces[:2] == [("<|im_start|>assistant\n", False), ("Hi!<|im_end|>", True)]


def test_segments_refuse_a_template_that_rewrites_earlier_turns() -> None:
    # renders the last message differently: a prefix of the conversation is not a prefix of its text
    template = ChatTemplate("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.content }}|{% endfor %}")
    with pytest.raises(ChatTemplateError, match="differently inside the conversation"):
        template.segments(TURNS)


def test_check_messages_errors() -> None:
    assert check_messages([{"role": "user", "content": "hi", "name": "x"}]) == [{"role": "user", "content": "hi"}]
    for bad, expected in [
        ([], "chat: the conversation is empty"),
        ({"role": "user"}, "expected a list of messages"),
        (["hi"], r"chat\[0\]: expected an object"),
        ([{"role": "bot", "content": "x"}], r"chat\[0\]: unknown role 'bot'"),
        ([{"role": "user", "content": ["x"]}], r"chat\[0\]: content must be a string, got list"),
    ]:
        with pytest.raises(GptlabError, match=expected):
            check_messages(bad, "chat")


# --- templates that are not what they seem: each one line naming the file, quickly ---------------------------------
NS = "{% set ns = namespace(s='ab') %}"
HOSTILE = {
    "include": ("{% include 'other.jinja' %}", "uses {% include %} (line 1): a chat template may not load other"),
    "import": ("{% import 'other.jinja' as x %}", "uses {% import %}"),
    "from-import": ("{% from 'other.jinja' import x %}", "uses {% from ... import %}"),
    "extends": ("{% extends 'other.jinja' %}", "uses {% extends %}"),
    "syntax": ("{% for m in messages %}{{ m.content }}", "is not a valid Jinja template: Unexpected end of template"),
    "unknown-filter": ("{{ messages | shout }}", "is not a valid Jinja template: No filter named 'shout'"),
    "unknown-filter-late": ("{% if messages %}{{ messages | shout }}{% endif %}", "No filter named 'shout'"),
    "division-by-zero": ("{{ messages | length // 0 }}", "failed: ZeroDivisionError"),
    "range-over-the-cap": ("{% for i in range(1000000) %}{% endfor %}", "failed: OverflowError: Range too big"),
    "tojson-unserialisable": ("{{ namespace(a=1) | tojson }}", "failed: TypeError: Object of type Namespace"),
    "recursive-macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "failed: RecursionError"),
    "gigabyte-string": ("{{ 'a' * 1000000000 }}", "builds a value of more than"),
    "doubling-concat": (NS + "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "builds a value"),
    "doubling-plus": (NS + "{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "builds a value"),
    "huge-replace": ("{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}", "builds a value"),
    "huge-join": ("{% set s = 'a' * 100000 %}{{ ([s] * 100000) | join }}", "more than"),
    "huge-width": ("{{ 'a' | center(10000000000) }}", "passes the number 10000000000"),
    "huge-format": ("{{ '{:>10000000000}'.format(1) }}", "a width or precision of 10 million"),
    "huge-printf": ("{{ '%*s' % (1000000000, 'a') }}", "passes the number 1000000000"),
    "huge-power": ("{{ 10 ** 1000000000 }}", "a number of more than 4096 bits"),
    "nested-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "takes more than 0.5 s to render"),
    "endless-output": ("{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 1000
                       + "{% endfor %}{% endfor %}", "writes more than"),
    "lipsum": ("{{ lipsum(100000) * 1000 }}", "'lipsum' is undefined"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_one_line_naming_its_file(name: str, monkeypatch) -> None:
    import time

    from gptlab.tokenizer import template_sandbox

    monkeypatch.setattr(template_sandbox, "MAX_RENDER_SECONDS", 0.5)
    source, fragment = HOSTILE[name]
    template = ChatTemplate(source, origin="/models/m/chat_template.jinja")
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as caught:
        template.render(TURNS, add_generation_prompt=True)
    message = str(caught.value)
    assert message.startswith("the chat template in /models/m/chat_template.jinja "), message
    assert fragment in message and "\n" not in message, message
    assert time.monotonic() - start < 10  # bounded: no hang, no gigabytes built


def test_the_sandbox_still_renders_what_real_templates_use() -> None:
    source = ("{% for m in messages %}{{ m.role ~ ': ' ~ m.content }}{% if not loop.last %}|{% endif %}{% endfor %}"
              "{{ '%s=%d' | format('n', messages | length) }} {{ [1, 2] | join(',') }} {{ '-' * 3 }} {{ 2 ** 10 }}"
              " {{ '{}!'.format('ok') }} {{ messages[0] | tojson }}")
    text = ChatTemplate(source).render(TURNS[:2])
    assert text == ('user: What is the capital of France?|assistant: Paris.n=2 1,2 --- 1024 ok! '
                    '{"role": "user", "content": "What is the capital of France?"}')


@pytest.mark.parametrize("value, message", [
    (3, "chat_template must be a Jinja template string, got int"),
    ({"template": "x"}, "chat_template must be a Jinja template string, got dict"),
    (["x"], "chat_template is a list whose items are not all {name, template} objects"),
    ([{"name": "tool_use", "template": "x"}], "lists templates named 'tool_use' but none named 'default'"),
    ([{"name": "default", "template": 7}], "chat_template[name='default'] must be a Jinja template string, got int"),
])
def test_a_chat_template_field_that_is_not_a_string_is_refused(tmp_path: Path, value, message: str) -> None:
    d = hf_tokenizer_dir(tmp_path / "m", {"chat_template": value})
    with pytest.raises(GptlabError) as caught:
        load_tokenizer(d)
    assert str(caught.value).startswith(f"{d / 'tokenizer_config.json'}: chat_template") and message in str(
        caught.value)


def test_the_default_of_a_list_of_templates_is_used_and_errors_name_its_file(tmp_path: Path) -> None:
    d = hf_tokenizer_dir(tmp_path / "m", {"chat_template": [{"name": "tool_use", "template": "T"},
                                                         {"name": "default", "template": "{{ 1 / 0 }}"}]})
    template = chat_template_for(load_tokenizer(d))
    assert template.source == "{{ 1 / 0 }}"
    with pytest.raises(ChatTemplateError, match=f"the chat template in {d / 'tokenizer_config.json'} failed"):
        template.render(TURNS)
    (d / "chat_template.jinja").write_text("{% include 'x' %}")
    with pytest.raises(ChatTemplateError, match=f"the chat template in {d / 'chat_template.jinja'} uses"):
        chat_template_for(load_tokenizer(d)).render(TURNS)


def test_a_chat_template_jinja_linking_outside_the_model_is_refused(tmp_path: Path) -> None:
    d = hf_tokenizer_dir(tmp_path / "m", {})
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (d / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(GptlabError, match="chat_template.jinja is a link to .*secret.txt, outside the model"):
        load_tokenizer(d)
    (d / "chat_template.jinja").unlink()
    (d / "inside.jinja").write_text("{{ messages[0].content }}")
    (d / "chat_template.jinja").symlink_to(d / "inside.jinja")  # a link within the directory is fine
    assert chat_template_for(load_tokenizer(d)).render(TURNS) == TURNS[0]["content"]
