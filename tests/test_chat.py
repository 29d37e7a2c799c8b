"""`ChatSession` (gptlab.generation.chat) and `gptlab chat`: trimming to the context, stop strings, /reset, replies
equal to plain generation, and the terminal both from a pipe and from a pseudo-terminal, as a person types."""

from __future__ import annotations

import contextlib
import io
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, ByteTokenizer, one_line_error, scripted_model, tiny_model

from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.generation import ChatSession, MessageTooLongError, SamplingParams, generate
from gptlab.generation.prefix_cache import DEFAULT_BLOCK_TOKENS
from gptlab.tokenizer import CharTokenizer
from gptlab.tokenizer.chat_template import BUILTIN_TEMPLATES, chat_template_for, turn_end_stops

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 .,:!?'\n"
TOK = CharTokenizer.from_text(VOCAB)
# after the "plain" template's "Assistant:" the model writes " ok\nUser: ok\nUser: ..." (its next token depends
# only on the last one), so every reply is "ok" once the stop string "\nUser:" is cut
OK_LOOP = ":", " ", "o", "k", "\n", "U", "s", "e", "r"


def loop_model(tokenizer, text, vocab_size: int, block_size: int = 96):
    """A scripted model that writes the characters of `text` in a loop, each one after the one before it; its
    logits are scaled so that sampling at any usual temperature picks the scripted token too."""
    ids = [tokenizer.encode(c)[0] for c in text]
    model = scripted_model({a: b for a, b in zip(ids, ids[1:] + ids[:1], strict=True)}, vocab_size, block_size)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


@pytest.fixture(scope="module")
def ok_model():
    return loop_model(TOK, OK_LOOP, TOK.vocab_size)


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory, ok_model):
    root = tmp_path_factory.mktemp("chat")
    return save_model(root / "ok", ok_model, TOK), save_model(root / "no-tok", ok_model)


def greedy(max_new_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens)


# ---------------------------------------------------------------------------------------------------------
# The library
# ---------------------------------------------------------------------------------------------------------
def test_replies_stop_before_the_stop_string_and_reset_keeps_the_system_message(ok_model):
    session = ChatSession(ok_model, TOK, greedy(), system="Be brief.")
    assert session.template.name == "plain" and "\nUser:" in session.params.stop
    deltas = list(session.send("hi"))
    assert "".join(deltas) == "ok" and all(deltas)
    assert session.ask("and now?") == "ok"
    assert session.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and now?"}, {"role": "assistant", "content": "ok"},
    ]
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]
    assert session.ask("hi") == "ok"


def test_trimming_drops_the_oldest_turns_and_keeps_the_system_message(ok_model):
    notices: list[str] = []
    session = ChatSession(ok_model, TOK, greedy(10), system="Be brief.", on_notice=notices.append)
    budget = session.block_size - session.params.max_new_tokens
    for i in range(1, 7):
        assert session.ask(f"msg {i}") == "ok"
        messages = session.messages
        assert messages[0] == {"role": "system", "content": "Be brief."}
        users = [m["content"] for m in messages if m["role"] == "user"]
        assert users == [f"msg {j}" for j in range(i - len(users) + 1, i + 1)]  # the latest ones
        # the prompt this reply had fitted; with one more (older) turn it would not have
        assert len(session.prompt_ids(messages[:-1])) <= budget
    assert 1 < len(users) < 6 and len(notices) >= 1
    assert all(n.startswith("dropped the") and "96 tokens" in n and "\n" not in n for n in notices)
    full = [{"role": "system", "content": "Be brief."}]
    for j in range(i - len(users), i + 1):
        full += [{"role": "user", "content": f"msg {j}"}, {"role": "assistant", "content": "ok"}]
    assert len(session.prompt_ids(full[:-1])) > budget


def test_a_message_too_long_for_the_context_is_refused_and_not_stored(ok_model):
    session = ChatSession(ok_model, TOK, greedy(), system="Be brief.")
    session.ask("hi")
    before = session.messages
    with pytest.raises(MessageTooLongError, match="does not fit the model's context: .* > 96; it was dropped"):
        session.send("x" * 90)
    assert session.messages == before
    assert session.ask("hi again") == "ok"
    with pytest.raises(GptlabError, match="leaves no room"):
        ChatSession(ok_model, TOK, greedy(96))


def test_a_message_longer_than_any_context_is_refused_before_it_is_tokenized(ok_model, monkeypatch):
    """A text of more characters than the context can hold whatever its tokens (`prompts.prompt_char_limit`) is
    refused as the sample command and the server refuse it: not tokenized, once per turn it would drop."""
    session = ChatSession(ok_model, TOK, greedy())
    for _ in range(3):
        session.ask("hi")
    before = session.messages
    encoded, encode = [], TOK.encode
    monkeypatch.setattr(TOK, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    with pytest.raises(MessageTooLongError, match=r"the message has 98,305 characters, more than the model's "
                                                  r"context of 96 tokens can hold; it was dropped"):
        session.send("x" * (96 * 1024 + 1))
    assert encoded == [] and session.messages == before


def test_a_reply_equals_generate_on_the_rendered_prompt():
    model = tiny_model(vocab_size=TOK.vocab_size, block_size=128)
    session = ChatSession(model, TOK, greedy(24), system="You are terse.")
    template = chat_template_for(TOK)
    for text in ("Hello there", "Why?"):
        messages = session.messages + [{"role": "user", "content": text}]
        ids = TOK.encode(template.render(messages, add_generation_prompt=True))
        out = generate(model, torch.tensor([ids]), 24, temperature=0)
        expected = TOK.decode(out[0, len(ids) :].tolist()).split("\nUser:")[0].strip()
        assert session.ask(text) == expected
        assert session.messages[-1] == {"role": "assistant", "content": expected}


@pytest.mark.parametrize("scripted", [True, False])
def test_a_turn_prefills_only_what_the_turn_before_did_not_compute(scripted, monkeypatch):
    """The prefix cache keeps each turn's prompt and reply: the next turn prefills neither again (but for the
    last partial block), and replies are those of a session without it, which prefills the whole conversation."""
    model = (loop_model(TOK, OK_LOOP, TOK.vocab_size, block_size=256) if scripted
             else tiny_model(vocab_size=TOK.vocab_size, block_size=256))
    prefilled: list[int] = []  # tokens per forward through the model (its first one in a turn: the prefill)
    forward = model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda idx, **kw: prefilled.append(idx.shape[1]) or forward(idx, **kw))
    system = "You are a terse assistant who answers in as few words as anyone can."
    cached, uncached = (ChatSession(model, TOK, greedy(16), system=system, prefix_cache_mb=mb) for mb in (512, 0))
    assert uncached.prefix_cache is None
    before = []
    for turn, text in enumerate(("Hello there", "Why is that?", "Thanks")):
        ids = cached.prompt_ids(cached.messages + [{"role": "user", "content": text}])
        prefilled.clear()
        reply = cached.ask(text)
        if turn == 0:
            assert prefilled[0] == len(ids)
        else:  # the turn before: its prompt, and its reply as generated (" ok\nUser" before the stop's last ":")
            done = len(before) + (len(" ok\nUser") if scripted else 0)
            assert prefilled[0] <= len(ids) - done + DEFAULT_BLOCK_TOKENS - 1
        prefilled.clear()
        assert uncached.ask(text) == reply
        assert prefilled[0] == len(ids)
        before = ids
    stats = cached.prefix_cache.stats()
    assert stats.hit_tokens > 0 and stats.hit_rate > 0.5


def test_closing_a_reply_keeps_what_was_shown():
    session = ChatSession(loop_model(TOK, OK_LOOP, TOK.vocab_size), TOK, greedy())
    stream = session.send("hi")
    assert next(stream) == "o"
    stream.close()  # what Ctrl-C does
    assert session.messages[-1] == {"role": "assistant", "content": "o"}
    session.send("unread").close()  # never started: no turn
    assert len(session.messages) == 2
    assert session.ask("again") == "ok"


class HashEot(ByteTokenizer):
    eot_id = ord("#")


class TildeTemplate(ByteTokenizer):
    chat_template = ("{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}~\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant>{% endif %}")


@pytest.mark.parametrize("tokenizer, script", [(HashEot(), ": yo#"), (TildeTemplate(), "> yo~\n")])
def test_replies_end_at_the_end_of_turn_token_or_the_templates_turn_end(tokenizer, script):
    model = loop_model(tokenizer, script, 256, block_size=64)
    session = ChatSession(model, tokenizer, greedy(16))
    assert session.ask("hi") == "yo"
    assert session.messages[-1]["content"] == "yo"
    if tokenizer.chat_template:
        assert turn_end_stops(session.template) == ["~"] and "~" in session.params.stop
    assert turn_end_stops(chat_template_for(tokenizer, "chatml")) == ["<|im_end|>"]
    assert turn_end_stops(chat_template_for(tokenizer, "plain")) == []


@pytest.mark.parametrize("tokenizer, script, stop", [
    (TildeTemplate(), "> yo~\n", None),  # the template's turn end, which the server used to miss
    (TildeTemplate(), "> yQZk~\n", "Z"),  # the user's stop string with the template's
    (ByteTokenizer(), "yo\nUser:", None),  # "plain": the user's next line
    (ByteTokenizer(), "yo\nUser:", "o"),  # "plain" with a stop of the user's: both kept (the server dropped one)
])
def test_the_chat_command_and_the_server_stop_a_reply_alike(tokenizer, script, stop) -> None:
    """One policy (`reply_stops`): `gptlab chat`'s session and /v1/chat/completions end the same reply at the
    same place, the user's stop strings and the template's together."""
    pytest.importorskip("fastapi")
    import httpx

    from gptlab.serve import ServerThread, create_app

    model = loop_model(tokenizer, script, 256, block_size=64)
    session = ChatSession(model, tokenizer, SamplingParams(temperature=0, max_new_tokens=16,
                                                           stop=(stop,) if stop else ()))
    want = session.ask("hi")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0,
            **({"stop": stop} if stop else {})}
    with ServerThread(create_app(model, tokenizer, model_name="m", max_batch=1, ui=False)) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    # the same reply; the session keeps it without the whitespace a template puts before it, the server as is
    assert r.json()["choices"][0]["message"]["content"].strip() == want and want


# ---------------------------------------------------------------------------------------------------------
# gptlab chat
# ---------------------------------------------------------------------------------------------------------
def test_piped_chat_answers_one_line_per_message(chat_dirs):
    proc = subprocess.run(
        [sys.executable, "-m", "gptlab.cli", "chat", str(chat_dirs[0]), "--system", "Be brief."],
        input="hi\nbye\n", capture_output=True, text=True, cwd=REPO, timeout=600,  # a hang, not a speed bound
        env={**os.environ, "GPTLAB_NO_KERNELS": "1"},  # a first run would build the kernels: not what this tests
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\nok\n"


def test_piped_chat_commands_errors_and_interrupted_replies(chat_dirs, monkeypatch, capsys):
    import gptlab.generation.chat as chat

    real, calls = chat.stream_deltas, []

    def interrupted_once(engine, gen):  # Ctrl-C after the first piece of the first reply
        calls.append(1)
        for i, delta in enumerate(real(engine, gen)):
            yield delta
            if len(calls) == 1 and i == 1:
                raise KeyboardInterrupt

    monkeypatch.setattr(chat, "stream_deltas", interrupted_once)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n\n/reset\n" + "x" * 200 + "\n/what\nbye\n/exit\nignored\n"))
    assert main(["chat", str(chat_dirs[0]), "--max-new-tokens", "16"]) == 1  # one message failed
    out, err = capsys.readouterr()
    assert out == "o\n\nok\n"  # stopped reply, the empty line of the refused message, a whole reply
    assert "reply stopped" in err and "conversation was reset" in err and "unknown command /what" in err
    assert "error: the message does not fit" in err
    assert len(calls) == 2


def test_the_template_flag_lists_the_built_in_templates():
    from gptlab.cli.chat import TEMPLATES

    assert TEMPLATES == tuple(sorted(BUILTIN_TEMPLATES))


@pytest.mark.parametrize("args, message", [
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--max-new-tokens", "200"], "leaves no room for the conversation"),
    (["--prefix-cache-mb", "-1"], "--prefix-cache-mb must be 0 (off) or a size in MB"),
    # text from flags, known before the first line: refused once, not at every message
    (["--chat-template", "chatml"], "--chat-template chatml writes 4 character(s) not in the model's char "
                                    "vocabulary: '<', '>', '_', '|'"),
    (["--system", "Be <brief>"], "--system has 2 character(s) not in the model's char vocabulary: '<', '>'"),
])
def test_chat_errors_are_one_line(chat_dirs, monkeypatch, capsys, args, message):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nbye\n"))
    rc = main(["chat", str(chat_dirs[0]), *args])
    out, err = capsys.readouterr()
    assert message in one_line_error(rc, err) and out == ""
    assert main(["chat", str(chat_dirs[1])]) == 2
    assert "no tokenizer" in one_line_error(2, capsys.readouterr().err)


def test_a_piped_line_the_vocabulary_cannot_encode_fails_alone(chat_dirs, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("caf\u00e9\nhi\n"))
    assert main(["chat", str(chat_dirs[0]), "--max-new-tokens", "16"]) == 1  # the session goes on
    out, err = capsys.readouterr()
    # said of the line, without prepare's advice (another --tokenizer), which a chat with a trained model cannot take
    assert out == "\nok\n" and err == "error: the message has 1 character(s) not in the model's char vocabulary: 'é'\n"


def test_interactive_chat_in_a_terminal(chat_dirs):
    """Drive `gptlab chat` in a pseudo-terminal (its controlling terminal, so Ctrl-C is a signal) as a person
    would: a message, Ctrl-C at the prompt, /reset, /exit."""
    argv = [sys.executable, "-m", "gptlab.cli", "chat", str(chat_dirs[0]), "--temperature", "0"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: become gptlab chat (exec at once: nothing of the test runs here)
        os.chdir(REPO)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as at a shell's prompt (a runner may ignore it)
        os.execve(sys.executable, argv, {**os.environ, "TERM": "dumb"})
    seen = ""

    def expect(*texts: str, timeout: float = 90.0) -> str:
        """Read the terminal until every one of `texts` appeared in what was read since the last call."""
        nonlocal seen
        got, deadline = "", time.monotonic() + timeout
        while not all(t in got for t in texts):
            assert time.monotonic() < deadline, f"waited for {texts}, got {got!r}"
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    got += os.read(fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    break
        seen += got
        return got

    try:
        expect("/reset forgets", "you> ")
        os.write(fd, b"hello\r")
        assert "ok" in expect("ok", "you> ").split("hello", 1)[-1]
        # a Ctrl-C between readline printing the prompt and waiting for a key is only seen at the next key (a race in
        # CPython's readline loop; no person types that fast): send it once the process sleeps in that wait
        deadline = time.monotonic() + 30
        while not any(w in Path(f"/proc/{pid}/wchan").read_text() for w in ("poll", "select")):
            assert time.monotonic() < deadline, "the prompt never waited for a key"
            time.sleep(0.01)
        os.write(fd, b"\x03")  # Ctrl-C at the prompt: a fresh prompt, the session goes on
        expect("you> ")
        os.write(fd, b"/reset\r")
        expect("conversation was reset", "you> ")
        os.write(fd, b"/exit\r")
        deadline = time.monotonic() + 60
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, seen
            if select.select([fd], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):
                    seen += os.read(fd, 4096).decode(errors="replace")
        pid = 0
        assert os.waitstatus_to_exitcode(status[1]) == 0, seen
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
