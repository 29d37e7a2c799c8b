"""Checked dataclasses: the range of a configuration field is written once, beside the field, and checked by one
function.

    n_layer: int = bounded(12, int, low=1, high=MAX_LAYERS)
    top_p: float = bounded(1.0, low=0, high=1, low_open=True)

`check_fields(obj)` checks every bounded field of a dataclass instance and raises `InvalidField` for the first out
of its range, naming the field, what it must be and the value. That one error type is what the command line
turns into an error about a flag (`--top-p`) and the server into a 400 whose `param` is the field. Rules that tie
two fields together (`n_head` divisible by `n_kv_head`) stay hand-written beside their class: a bound is about
one value.

`GPTConfig`, `TrainConfig` and `SamplingParams` use it. Non-finite numbers and booleans never pass a bound: nan
compares false with everything, and True is an int to Python but never meant as one in a recipe.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


class InvalidField(ValueError):
    """A field out of its range: `field` its name (with the owner's prefix, e.g. "rope_scaling.factor"),
    `requirement` what it must be ("must be in (0, 1]"), `value` what it was."""

    def __init__(self, field: str, value: Any, requirement: str) -> None:
        super().__init__(f"{field} {requirement}, got {value!r}")
        self.field, self.value, self.requirement = field, value, requirement


@dataclass(frozen=True)
class Bound:
    """The values one field may take. `kind` int: an integer; float: a finite number (an int is one too).
    `low`/`high` are included unless `low_open`/`high_open`; `optional`: None is allowed (it means "off" or
    "the default", as the field's documentation says)."""

    kind: type = float
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    note: str = ""  # why the bound is where it is, shown after the requirement ("int64")

    def holds(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def requirement(self) -> str:
        """What the field must be, as an error says it: "must be an integer in [1, 65536]", "must be a number >
        0", "must be in [0, 1) or null"."""
        what = "an integer" if self.kind is int else "a number"
        low, high = _shown(self.low), _shown(self.high)
        if self.low is not None and self.high is not None:
            interval = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
            words = [what, interval] if self.kind is int else [interval]  # "must be in (0, 1]": reals say it
        elif self.low is not None:
            words = [what, f"{'>' if self.low_open else '>='} {low}"]
        elif self.high is not None:
            words = [what, f"{'<' if self.high_open else '<='} {high}"]
        else:
            words = [what] if self.kind is int else [what, "(finite)"]
        words += ["or null"] if self.optional else []
        words += [f"({self.note})"] if self.note else []
        return " ".join(["must be", *words])


def _shown(x: float | None) -> str:
    return "" if x is None else f"{x:,}" if isinstance(x, int) and abs(x) >= 10**5 else f"{x:g}"


def bounded(default: Any, kind: type = float, *, low: float | None = None, high: float | None = None,
            low_open: bool = False, high_open: bool = False, optional: bool = False, note: str = "",
            **field_args: Any) -> Any:
    """A dataclass field with its `Bound` (see the module docstring); `field_args` go to `dataclasses.field`."""
    bound = Bound(kind, low, high, low_open, high_open, optional, note)
    return dataclasses.field(default=default, metadata={"bound": bound}, **field_args)


def bounds_of(cls: type) -> dict[str, Bound]:
    """Every bounded field of a dataclass and its bound (the documentation and the sweeps in the tests read them)."""
    return {f.name: f.metadata["bound"] for f in dataclasses.fields(cls) if "bound" in f.metadata}


def check_fields(obj: Any, prefix: str = "", error: type[InvalidField] = InvalidField) -> None:
    """Raise `error` (an InvalidField) for the first bounded field of `obj` outside its bound."""
    for name, bound in bounds_of(type(obj)).items():
        value = getattr(obj, name)
        if not bound.holds(value):
            raise error(prefix + name, value, bound.requirement())
