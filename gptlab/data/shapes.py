"""What one record is: its shape detected from its fields, checked, as a `Record` (`gptlab.data.records` reads the
rows of a file, `gptlab.data.examples` turns records into tokens).

Shapes, detected per record (fields that are null count as absent, as columnar formats fill them):

* ``{"messages": [{"role", "content"}, ...]}`` -- a chat (system, user, assistant, tool messages);
* ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}`` -- ShareGPT, the same chat;
* ``{"prompt": ..., "completion": ...}`` -- strings (one user turn, one assistant turn), or lists of messages;
* ``{"text": ...}`` -- a plain document, like a .txt file; ``--text-field NAME`` reads it from NAME instead;
* ``{"prompt": ..., "chosen": ..., "rejected": ...}`` -- a preference pair, as trl's preference datasets: strings
  (one user turn, two candidate assistant replies) or lists of messages (the prompt's conversation, each reply's
  assistant messages); without a prompt, chosen and rejected as whole conversations whose shared leading
  messages are the prompt (trl's "implicit prompt").

Every error is one line naming `where` (the file and line or row) and the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptlab.errors import GptlabError
from gptlab.tokenizer.chat_template import check_messages

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool"}
SHAPES = ("text", "prompt/completion", "chat", "preference")


@dataclass(frozen=True)
class Record:
    """One example: `text` for the text shape, `messages` (checked) for the others; `where` names it in errors.
    A preference pair's `messages` are its prompt, `chosen` and `rejected` the two replies' messages."""

    where: str
    shape: str
    text: str = ""
    messages: tuple[dict[str, str], ...] = ()
    chosen: tuple[dict[str, str], ...] = ()
    rejected: tuple[dict[str, str], ...] = ()


def _sharegpt(turns: Any, where: str) -> Any:
    """ShareGPT turns as messages: human -> user, gpt -> assistant; turns already in role/content form pass."""
    if not isinstance(turns, list):
        return turns  # check_messages names the fault
    out = []
    for i, t in enumerate(turns):
        if isinstance(t, dict) and "from" in t:
            if not isinstance(t["from"], str):  # a list or an object can't be looked up (unhashable)
                raise GptlabError(f"{where}: conversations[{i}]: field 'from' must be a string, got "
                                  f"{type(t['from']).__name__}")
            role = _SHAREGPT_ROLES.get(t["from"])
            if role is None:
                raise GptlabError(f"{where}: conversations[{i}]: unknown speaker {t['from']!r} (expected human, gpt "
                                  "or system)")
            if "value" not in t:  # named here: check_messages would name 'content', a field the record lacks
                raise GptlabError(f"{where}: conversations[{i}]: has 'from' but no 'value'")
            if not isinstance(t["value"], str):
                raise GptlabError(f"{where}: conversations[{i}]: field 'value' must be a string, got "
                                  f"{type(t['value']).__name__}")
            t = {"role": role, "content": t["value"]}
        out.append(t)
    return out


def _string(row: dict[str, Any], key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise GptlabError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def parse_record(row: Any, where: str, text_field: str | None = None) -> Record:
    """The record in `row`, its shape detected (see the module docstring); GptlabError naming `where`."""
    if not isinstance(row, dict):
        raise GptlabError(f"{where}: expected a JSON object, got {type(row).__name__}")
    present = [k for k, v in row.items() if v is not None]
    if text_field is not None:
        if text_field not in present:
            raise GptlabError(f"{where}: no field {text_field!r} (--text-field; fields: {', '.join(present)})")
        return Record(where, "text", text=_string(row, text_field, where))
    if "chosen" in present or "rejected" in present:
        return _preference(row, present, where)
    if "messages" in present:
        return Record(where, "chat", messages=tuple(check_messages(row["messages"], f"{where}: messages")))
    if "conversations" in present:
        turns = _sharegpt(row["conversations"], where)
        return Record(where, "chat", messages=tuple(check_messages(turns, f"{where}: conversations")))
    if "prompt" in present or "completion" in present:
        if "prompt" not in present or "completion" not in present:
            has, lacks = ("prompt", "completion") if "prompt" in present else ("completion", "prompt")
            raise GptlabError(f"{where}: has {has!r} but no {lacks!r}")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt/completion
            return Record(where, "prompt/completion",
                          messages=tuple(check_messages(prompt + completion, f"{where}: prompt + completion")))
        msgs = [{"role": "user", "content": _string(row, "prompt", where)},
                {"role": "assistant", "content": _string(row, "completion", where)}]
        return Record(where, "prompt/completion", messages=tuple(msgs))
    if "text" in present:
        return Record(where, "text", text=_string(row, "text", where))
    raise GptlabError(f"{where}: matches no record shape: expected a 'text', 'prompt' + 'completion', 'messages', "
                      f"'conversations' or 'chosen' + 'rejected' field (fields: {', '.join(present) or 'none'}; "
                      "--text-field names another)")


def _preference(row: dict[str, Any], present: list[str], where: str) -> Record:
    """A prompt / chosen / rejected pair (see the module docstring); each reply must end on the assistant's turn."""
    missing = [k for k in ("chosen", "rejected") if k not in present]
    if missing:
        raise GptlabError(f"{where}: a preference pair needs 'chosen' and 'rejected', has no {missing[0]!r}")
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" not in present:  # implicit prompt: the leading messages both conversations share
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise GptlabError(f"{where}: has no 'prompt': string replies need one (lists of messages may share "
                              "their leading messages instead)")
        chosen = check_messages(chosen, f"{where}: chosen")
        rejected = check_messages(rejected, f"{where}: rejected")
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    elif isinstance(row["prompt"], list):
        prompt = check_messages(row["prompt"], f"{where}: prompt")
        chosen = check_messages(chosen, f"{where}: chosen") if isinstance(chosen, list) else \
            [{"role": "assistant", "content": _string(row, "chosen", where)}]
        rejected = check_messages(rejected, f"{where}: rejected") if isinstance(rejected, list) else \
            [{"role": "assistant", "content": _string(row, "rejected", where)}]
    else:
        prompt = [{"role": "user", "content": _string(row, "prompt", where)}]
        chosen = [{"role": "assistant", "content": _string(row, "chosen", where)}]
        rejected = [{"role": "assistant", "content": _string(row, "rejected", where)}]
    if not prompt:
        raise GptlabError(f"{where}: the prompt is empty (chosen and rejected share no leading message)")
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if reply[-1]["role"] != "assistant":
            raise GptlabError(f"{where}: field {name!r} must end with an assistant message, ends with "
                              f"{reply[-1]['role']!r}")
    return Record(where, "preference", messages=tuple(prompt), chosen=tuple(chosen), rejected=tuple(rejected))
