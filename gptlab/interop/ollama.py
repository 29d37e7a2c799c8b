"""An ollama model directory: the GGUF file and a Modelfile (`gptlab convert SRC OUTDIR --to ollama`, then
`ollama create NAME -f OUTDIR/Modelfile`).

ollama formats a chat with a Go template, not the Jinja one in the GGUF file: without a TEMPLATE line it only
recognizes a few well-known Jinja templates, and a model whose template it misses gets the bare prompt, which is
why fine-tunes answered in garbage there (ollama issue 1110). gptlab's built-in templates are written here in Go
form, rendering the same text as their Jinja; a tokenizer's own template is left to ollama's recognition from the
GGUF's tokenizer.chat_template, and `modelfile` says so in its note. The stop strings are gptlab chat's own
(`reply_stops`), and the sampling parameters gptlab's defaults, so `ollama run` samples as `gptlab chat` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptlab.tokenizer.chat_template import BUILTIN_TEMPLATES, chat_template_for, reply_stops

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

MODELFILE = "Modelfile"
GGUF_NAME = "model.gguf"

# gptlab's built-in templates in ollama's Go template form: the same text for the same messages
GO_TEMPLATES = {
    "plain": (
        '{{- range .Messages }}{{ if eq .Role "system" }}System{{ else if eq .Role "user" }}User'
        '{{ else if eq .Role "assistant" }}Assistant{{ else }}Tool{{ end }}: {{ .Content }}\n'
        "{{ end }}Assistant:"
    ),
    "chatml": (
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
        "{{ end }}<|im_start|>assistant\n"
    ),
}


def modelfile(tokenizer: TextTokenizer, temperature: float = 1.0) -> tuple[str, str]:
    """(the Modelfile's text, a note for the user: empty, or why it has no TEMPLATE)."""
    template = chat_template_for(tokenizer)
    builtin = next((name for name, source in BUILTIN_TEMPLATES.items() if source == template.source), None)
    lines = [f"FROM ./{GGUF_NAME}"]
    note = ""
    if builtin is not None:
        lines.append(f'TEMPLATE """{GO_TEMPLATES[builtin]}"""')
    else:
        note = ("the tokenizer's own chat template has no Go form here: ollama takes it from the GGUF's "
                "tokenizer.chat_template when it recognizes it; otherwise add a TEMPLATE line to the Modelfile")
    for stop in reply_stops(template):
        lines.append(f"PARAMETER stop {_quoted(stop)}")
    lines.append(f"PARAMETER temperature {temperature:g}")
    return "\n".join(lines) + "\n", note


def _quoted(text: str) -> str:
    """A Modelfile argument: double-quoted, or triple-quoted (taken literally) with a newline or a quote."""
    if "\n" in text or '"' in text:
        return f'"""{text}"""'
    return f'"{text}"'
