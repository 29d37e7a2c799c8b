"""`gptlab chat`: talk with a model in the terminal, the reply streamed as it is generated.

The conversation (rendering, trimming to the context, stop strings) is `gptlab.generation.chat.ChatSession`;
this module is only the terminal around it. Two ways in:

* stdin is a terminal: a `you> ` prompt (line editing and history through readline when Python has it), the
  reply streamed under it. Ctrl-C during a reply stops that reply (what was shown stays in the conversation);
  Ctrl-C at the prompt clears the line; Ctrl-D or /exit ends the session.
* stdin is a pipe or a file: one user message per line, one reply printed per line (no prompt, no notes on
  stdout), so `printf 'hi\\nbye\\n' | gptlab chat RUN` prints two replies. Blank lines are skipped; a message
  that cannot be answered (too long for the context, characters outside a char vocabulary) prints an empty
  line, its error goes to stderr, and the exit status is 1 at the end. A --system message or chat template the
  vocabulary cannot write is refused before the first line is read (every message would fail).

In both, a line that is one word starting with "/" is a command: /reset forgets the conversation (the system
message stays), /exit ends. Notes (turns dropped to fit the context, a stopped reply) go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, TextIO

from gptlab.cli.options import (
    add_device,
    add_dtype,
    add_prefix_cache,
    add_quantize,
    check_text,
    prefix_cache_options,
    quantize_options,
    torch_dtype,
)
from gptlab.cli.sample import add_sampling_flags, check_biased_tokens, sampling_params
from gptlab.errors import GptlabError

if TYPE_CHECKING:
    from gptlab.generation.chat import ChatSession

PROMPT = "you> "
# the names of gptlab.tokenizer.chat_template.BUILTIN_TEMPLATES (a test checks): importing the tokenizer package here
# would load numpy into `gptlab --help`
TEMPLATES = ("chatml", "plain")
COMMANDS = {"/reset": "forget the conversation, keep the system message", "/exit": "end the session"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="chat with a model in the terminal",
        description="Multi-turn chat with streamed replies. At a terminal: a `you> ` prompt; /reset forgets the "
        "conversation, /exit or Ctrl-D ends, Ctrl-C stops a reply. From a pipe: one message per line, one reply "
        "per line. The oldest turns are dropped when the conversation outgrows the model's context.",
    )
    p.add_argument("model", metavar="MODEL",
                   help="a run (its best checkpoint), a checkpoint or a Hugging Face directory")
    p.add_argument("--system", metavar="TEXT", help="system message (kept through /reset and trimming)")
    p.add_argument("--chat-template", choices=TEMPLATES,
                   help="a built-in chat template (default: the tokenizer's own, else plain)")
    add_sampling_flags(p, max_new_tokens=None,
                       max_new_tokens_help="tokens per reply at most (default: 512, or half the context if less)")
    add_device(p)
    add_dtype(p)  # default auto: bf16 on a GPU; on a CPU float32 (bfloat16 is ~2x faster on recent CPUs)
    add_quantize(p)
    add_prefix_cache(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gptlab.generation.chat import ChatSession, default_max_new_tokens
    from gptlab.hardware import resolve_device
    from gptlab.loading import load_model

    # every flag is checked before the (slow) model load; the default reply length needs the model's context
    params = sampling_params(args, **({} if args.max_new_tokens is not None else {"max_new_tokens": 1}))
    prefix_cache = prefix_cache_options(args)
    check_text(args, "--system")
    device = resolve_device(args.device)
    model, tokenizer = load_model(args.model, device=device, dtype=torch_dtype(args.dtype, device),
                                  **quantize_options(args))
    check_biased_tokens(params, model.config.vocab_size)
    if tokenizer is None:
        raise GptlabError(f"{args.model} has no tokenizer: chat needs one to turn text into tokens "
                          "(save the checkpoint with its tokenizer)")
    if args.max_new_tokens is None:
        params = dataclasses.replace(params, max_new_tokens=default_max_new_tokens(model.config.block_size))
    session = ChatSession(model, tokenizer, params, system=args.system, template=args.chat_template,
                          on_notice=_note, **prefix_cache)
    _check_flag_text(session, args.chat_template)
    if sys.stdin.isatty():
        return _interactive(session, args.model)
    return _piped(session, sys.stdin)


def _check_flag_text(session: ChatSession, template_flag: str | None) -> None:
    """The system message and the template's own text come from flags, known before the first line: text the
    vocabulary cannot encode is refused once, now, instead of failing every message (the user's lines still fail
    one by one)."""
    from gptlab.tokenizer import UnknownCharacters

    if session.system:
        try:
            session.tokenizer.encode(session.system)
        except UnknownCharacters as e:
            raise GptlabError(e.of("--system")) from None
    try:
        session.prompt_ids(session.messages + [{"role": "user", "content": ""}])
    except UnknownCharacters as e:
        name = f"--chat-template {template_flag}" if template_flag else f"{session.template.label} (the default)"
        raise GptlabError(f"{name} writes {e.count} character(s) not in the model's char vocabulary: {e.shown}"
                          + ("" if template_flag else "; choose another with --chat-template")) from None


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def _command(line: str, session: ChatSession) -> str | None:
    """"exit", "done" (a command was run, or was unknown), or None when `line` is a message."""
    word = line.strip()
    if not word.startswith("/") or " " in word:
        return None
    if word == "/exit":
        return "exit"
    if word == "/reset":
        session.reset()
        _note("the conversation was reset" + (" (the system message stays)" if session.system else ""))
    else:
        listed = ", ".join(f"{name} ({what})" for name, what in COMMANDS.items())
        _note(f"unknown command {word}: the commands are {listed}")
    return "done"


def _answer(session: ChatSession, text: str, out: TextIO, piped: bool) -> bool:
    """Stream the reply to `text` to `out`, then a newline; False when it could not be answered (an error line
    on stderr, and from a pipe an empty reply line). Ctrl-C stops the reply, not the session."""
    from gptlab.tokenizer import UnknownCharacters

    reply = None
    try:
        reply = session.send(text)
        for delta in reply:
            out.write(delta)
            out.flush()  # stream: the reader sees each piece as soon as it is decoded
    except GptlabError as e:  # too long for the context, or characters the tokenizer cannot encode
        message = str(e)
        if isinstance(e, UnknownCharacters):  # its own message advises prepare's --tokenizer: no use here
            message = e.of("the message")
        print(f"error: {message}", file=sys.stderr, flush=True)
        if piped:  # the replies stay one per message line
            out.write("\n")
            out.flush()
        return False
    except KeyboardInterrupt:
        if reply is not None:
            reply.close()  # records the reply as far as it was shown
        out.write("\n")
        out.flush()
        _note("reply stopped")
        return True
    out.write("\n")
    out.flush()
    return True


def _interactive(session: ChatSession, name: str) -> int:
    try:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    except ImportError:
        pass
    print(f"chatting with {name} ({session.template.name} chat template). /reset forgets the conversation, "
          "/exit or Ctrl-D ends, Ctrl-C stops a reply.", file=sys.stderr, flush=True)
    while True:
        try:
            line = input(PROMPT)
        except EOFError:  # Ctrl-D
            print()
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print()
            continue
        if not line.strip():
            continue
        command = _command(line, session)
        if command == "exit":
            return 0
        if command is None:
            _answer(session, line, sys.stdout, piped=False)


def _piped(session: ChatSession, lines: TextIO) -> int:
    failed = False
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        command = _command(line, session)
        if command == "exit":
            break
        if command is None:
            failed = not _answer(session, line, sys.stdout, piped=True) or failed
    return 1 if failed else 0
