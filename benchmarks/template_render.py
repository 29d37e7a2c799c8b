"""What rendering a model directory's chat template in a worker process costs (`tokenizer.template_worker`),
against the same sandbox rendering in process: one chat prompt (a server's or `gptlab chat`'s request) and one
record's `segments` (`gptlab prepare`: every prefix of an 8-turn conversation, one trip to the worker).

Run it in a session of its own, so that `timing.raise_priority` gives it the machine: `setsid python
benchmarks/template_render.py`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from timing import raise_priority  # benchmarks/ is on sys.path when a benchmark runs as a script

from gptlab.tokenizer import template_sandbox
from gptlab.tokenizer.chat_template import ChatTemplate

# Qwen2.5's ChatML with a default system message (the shape of most templates in use)
QWEN = """{%- set ns = namespace(has_system=false) %}
{%- for message in messages %}{%- if message.role == 'system' %}{%- set ns.has_system = true %}{%- endif %}
{%- endfor %}
{%- if not ns.has_system %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
TURN = "Tell me more about the history of the city, its rivers and its bridges, in a few sentences. " * 3
CONVERSATION = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {TURN}"} for i in range(8)]


def median_us(step: Callable[[], object], repeats: int = 300) -> float:
    step()  # warm: compiled, worker started
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    raise_priority()
    t0 = time.perf_counter()
    ChatTemplate("{{ messages | length }}", origin="model/chat_template.jinja").compile()
    print(f"a worker's start (once per process and busy worker): {(time.perf_counter() - t0) * 1e3:.0f} ms")
    isolated = ChatTemplate(QWEN, origin="model/tokenizer_config.json")  # a file's template: the worker
    in_process = ChatTemplate(QWEN, origin="model/tokenizer_config.json")
    in_process._compiled = template_sandbox.compile_template(QWEN)  # the same sandbox, here
    prompt = CONVERSATION[:3]
    print(f"{'case':34s} {'in process':>12s} {'worker':>12s} {'ratio':>7s}")
    for name, run in [("chat prompt (3 messages)", lambda t: t.render(prompt, add_generation_prompt=True)),
                      ("record segments (8 turns, 9 renders)", lambda t: t.segments(CONVERSATION))]:
        assert run(isolated) == run(in_process)
        local, worker = median_us(lambda r=run: r(in_process)), median_us(lambda r=run: r(isolated))
        print(f"{name:34s} {local:10.0f} us {worker:10.0f} us {worker / local:6.2f}x")


if __name__ == "__main__":
    main()
