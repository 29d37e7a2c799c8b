"""The Jinja environment chat templates run in, and the bounds on one rendering.

A chat template comes with a downloaded model, so it is untrusted code. Jinja's ImmutableSandboxedEnvironment
already blocks attribute access to internals and mutation; this module adds what it leaves open:

- loading other templates (`include`, `import`, `extends`): refused when the template is compiled (no loader);
- time: every loop step, call, filter and operator checks a deadline (`MAX_RENDER_SECONDS`), so nested loops of
  1e10 steps stop instead of hanging the command or a server thread;
- size: the output is counted as it streams, and every value an operator, call or filter builds is checked (before
  it is built where its size is known in advance: `'a' * 10**9`, `s.replace(...)`, joins, format widths) against
  `MAX_RENDER_CHARS`; `lipsum` is gone (it writes any amount of text).

A template over a bound raises `TemplateLimitError`; `compile_template` and `render_all` turn every failure into
`TemplateFault`, which `chat_template.ChatTemplate` makes one line naming the template's file. These checks stop
a template between its steps; `template_worker` runs the templates of model directories where one long step is
bounded too.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

MAX_RENDER_SECONDS = 5.0  # a real template renders in milliseconds
MAX_RENDER_CHARS = 8_000_000  # characters of output, and of any value a template builds
_FORMAT_WIDTH = re.compile(r"\d{8,}")  # a width or precision of 10^7+ in a format string: a memory bomb

# (deadline, the seconds it allows) of the rendering under way in this thread or task
_deadline: contextvars.ContextVar[tuple[float, float]] = contextvars.ContextVar(
    "gptlab_template_deadline", default=(float("inf"), 0.0))


class TemplateLimitError(Exception):
    """A template went past a bound of `render_bounded` (time or size) or used something refused."""


class TemplateFault(Exception):
    """What is wrong with a template, as the end of a sentence that names it ("failed: ZeroDivisionError: ...");
    `broken` when it renders no conversation at all (not Jinja, past a bound) rather than only this one."""

    def __init__(self, message: str, broken: bool) -> None:
        super().__init__(message)
        self.broken = broken


def compile_template(source: str) -> Any:
    """`source` compiled in a fresh sandbox, or TemplateFault."""
    from jinja2.exceptions import TemplateError

    try:
        return environment().from_string(source)
    except TemplateLimitError as e:  # {% include %} and kin
        raise TemplateFault(str(e), broken=True) from e
    except (TemplateError, RecursionError) as e:  # a syntax error, an unknown filter, brackets nested too deep
        raise TemplateFault(f"is not a valid Jinja template: {_one_line(e)}", broken=True) from e


def render_all(compiled: Any, contexts: list[dict[str, Any]], seconds: float | None = None,
               max_chars: int | None = None) -> list[str]:
    """`compiled` rendered with each context, all within `seconds` and each within `max_chars` of output (by
    default MAX_RENDER_SECONDS and MAX_RENDER_CHARS, read at the call: tests lower them), or TemplateFault."""
    from jinja2.exceptions import TemplateError

    seconds = MAX_RENDER_SECONDS if seconds is None else seconds
    max_chars = MAX_RENDER_CHARS if max_chars is None else max_chars
    token = _deadline.set((time.monotonic() + seconds, seconds))
    try:
        return [_render_one(compiled, context, max_chars) for context in contexts]
    except TemplateLimitError as e:
        raise TemplateFault(str(e), broken=True) from e
    except MemoryError:
        raise
    except TemplateError as e:
        raise TemplateFault(f"could not render this conversation: {_one_line(e)}", broken=False) from e
    except (Exception, RecursionError) as e:  # the template's own code failed: 1/0, a recursive macro, ...
        raise TemplateFault(f"failed: {type(e).__name__}: {_one_line(e)}", broken=False) from e
    finally:
        _deadline.reset(token)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _tick() -> None:
    deadline, seconds = _deadline.get()
    if time.monotonic() > deadline:
        raise TemplateLimitError(f"takes more than {seconds:g} s to render (a runaway loop?)")


def _size(x: Any, cap: int = MAX_RENDER_CHARS) -> int:
    """About how many characters `x` renders to, without rendering it; stops counting past `cap`."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, (list, tuple, dict)):
        total = 2
        for item in (x.items() if isinstance(x, dict) else x):
            total += _size(item, cap) + 2
            if total > cap:
                break
        return total
    return 24 if isinstance(x, (int, float, bool)) or x is None else len(str(x))


def _check_size(x: Any, what: str = "a value") -> Any:
    if _size(x) > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"builds {what} of more than {MAX_RENDER_CHARS:,} characters")
    return x


def _check_args(args: Iterable[Any]) -> None:
    """Every argument of a call or filter: no huge number (a width, a count) and no value too large to render."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"passes the number {a} to a function: more than {MAX_RENDER_CHARS:,}")
        _check_size(a)


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _FORMAT_WIDTH.search(fmt):
        raise TemplateLimitError("formats with a width or precision of 10 million or more")


def _check_method(obj: Any, args: tuple[Any, ...]) -> None:
    """The str methods whose result can be far larger than their arguments, estimated before they run."""
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("format", "format_map"):
        _check_format(owner)
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1])
    elif name == "join" and args:
        _check_join(args[0], owner)


def _check_replace(s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        count = len(s) + 1 if not old else s.count(old)
        _check_size_estimate(len(s) + count * max(len(new) - len(old), 0))


def _check_join(items: Any, sep: Any) -> None:
    if isinstance(items, (list, tuple, str)) and isinstance(sep, str):
        _check_size_estimate(_size(items) + len(items) * len(sep))


def _check_size_estimate(n: int) -> None:
    if n > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"builds a value of more than {MAX_RENDER_CHARS:,} characters")


def _binop_estimate(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _check_size_estimate(_size(seq) * max(n, 0))
    elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
        if abs(left) > 1 and right * max(abs(int(left)).bit_length(), 1) > 4096:
            raise TemplateLimitError(f"computes {left} ** {right}: a number of more than 4096 bits")
    elif operator == "+":
        _check_size_estimate(_size(left) + _size(right))
    elif operator == "%" and isinstance(left, str):
        _check_format(left)
        _check_args(right if isinstance(right, tuple) else [right])  # `'%*s' % (10**9, x)`: a width as an argument
        _check_size_estimate(len(left) + _size(right))


def _render_one(compiled: Any, context: dict[str, Any], max_chars: int) -> str:
    """`compiled.render(**context)`, stopped with TemplateLimitError past the deadline or `max_chars` of output."""
    chunks, total = [], 0
    for chunk in compiled.generate(**context):  # streamed: a runaway output stops at the bound, not at OOM
        total += len(chunk)
        if total > max_chars:
            raise TemplateLimitError(f"writes more than {max_chars:,} characters")
        _tick()
        chunks.append(chunk)
    return "".join(chunks)


def _bounded_steps(iterable: Any) -> Iterator[Any]:
    for item in iterable:  # every loop of the template runs through here: its steps see the deadline
        _tick()
        yield item


def _bounded_concat(*parts: Any) -> str:  # the `~` operator
    _check_size_estimate(sum(_size(p) for p in parts))
    return "".join(str(p) for p in parts)


def _checked_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        _tick()
        values = [a for a in args if not _is_jinja_internal(a)]
        _check_args([*values, *kwargs.values()])
        if name == "replace" and len(values) >= 3:
            _check_replace(values[0], values[1], values[2])
        elif name == "join" and values:
            _check_join(values[0], values[1] if len(values) > 1 else kwargs.get("d", ""))
        elif name == "format" and values:
            _check_format(values[0])
        return _check_size(f(*args, **kwargs))

    return run


def _is_jinja_internal(a: Any) -> bool:
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(a, (Context, EvalContext, Environment))


def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
           sort_keys: bool = False) -> str:
    """transformers' `tojson`: non-ASCII kept."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def environment() -> Any:
    """A fresh sandboxed environment as transformers' apply_chat_template builds it, plus the bounds above."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers): render the body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _tick()
            _binop_estimate(operator, left, right)
            return _check_size(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _tick()
            _check_args([*args, *kwargs.values()])
            _check_method(__obj, args)
            return _check_size(super().call(__context, __obj, *args, **kwargs))

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for node in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
                tag = type(node).__name__.lower().replace("fromimport", "from ... import")
                raise TemplateLimitError(f"uses {{% {tag} %}} (line {node.lineno}): a chat template may not load "
                                         "other templates")
            _rewrite(tree)
            tree.set_environment(self)
            return tree

    def _rewrite(node: Any) -> Any:
        """Every loop's iterable through `_bounded_steps` and every `~` through `_bounded_concat`."""
        for name, value in node.iter_fields():
            if isinstance(value, nodes.Node):
                setattr(node, name, _rewrite(value))
            elif isinstance(value, list):
                setattr(node, name, [_rewrite(v) if isinstance(v, nodes.Node) else v for v in value])
        if isinstance(node, nodes.For):
            node.iter = nodes.Call(nodes.Name("__bounded_steps", "load", lineno=node.lineno), [node.iter], [],
                                   None, None, lineno=node.lineno)
        if isinstance(node, nodes.Concat):
            return nodes.Call(nodes.Name("__bounded_concat", "load", lineno=node.lineno), list(node.nodes), [],
                              None, None, lineno=node.lineno)
        return node

    def raise_exception(message: str) -> None:  # templates call it to reject a conversation
        raise TemplateError(message)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # writes any amount of text
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt),
                       __bounded_steps=_bounded_steps, __bounded_concat=_bounded_concat)
    return env
