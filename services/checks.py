"""Field checks for the config dataclasses' ``__post_init__``: one type-and-range check per field.

Each check raises ValueError naming the field and the value it got, or returns None; nothing is converted
(a check never turns 1.5 into 1 or 'false' into True). The rules:

- an int field takes an int: never a bool (an int to Python), never a float, even 2.0;
- a float field takes an int or a float (never a bool) that is finite, unless the field allows inf;
- a bool field takes True or False only (a truthy 'false' is the mistake this catches);
- a str field takes a str, a path field a str or an os.PathLike (never bytes, never a NUL character);
- ``optional=True``: None is allowed too.

``rule`` replaces the range's wording in a refusal ("positive", ">= 0 (-1: no limit)") where a message is
already known to users and tests.

NOTE: dependency-free on purpose (no torch, no grpc): every layer may import it.
"""

from __future__ import annotations

import math
import os


def _show(value) -> str:
    # NOTE: repr of an int past 4300 digits raises ValueError itself (sys.set_int_max_str_digits)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _got(value) -> str:
    return f"{_show(value)} ({type(value).__name__})"


def _bounds(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is None and hi is None:
        return ""
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{'<' if hi_open else '<='} {hi}"


def check_int(name: str, value, lo: int | None = None, hi: int | None = None, *, optional: bool = False,
              rule: str | None = None) -> None:
    """An int in [lo, hi] (either bound may be None)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_got(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {rule or _bounds(lo, hi)}, got {_show(value)}")


def check_float(name: str, value, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False, finite: bool = True, optional: bool = False, rule: str | None = None) -> None:
    """A real number (int or float) within the bounds (closed unless ``lo_open``/``hi_open``); never NaN, and
    never inf unless ``finite`` is off."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_got(value)}")
    try:
        f = float(value)
    except OverflowError:               # an int beyond any float: infinite for this purpose
        f = math.inf if value > 0 else -math.inf
    below = lo is not None and (f <= lo if lo_open else f < lo)
    above = hi is not None and (f >= hi if hi_open else f > hi)
    if math.isnan(f) or (finite and math.isinf(f)) or below or above:
        what = rule or _bounds(lo, hi, lo_open, hi_open)
        if finite and hi is None:       # a range bounded above says it; one that is not needs the word
            what = f"a finite number {what}".rstrip()
        raise ValueError(f"{name} must be {what}, got {_show(value)}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {_got(value)}")


def check_str(name: str, value, *, choices=None, empty: bool = True, optional: bool = False) -> None:
    """A str; one of ``choices`` when given; not '' unless ``empty``."""
    if optional and value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {_got(value)}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    if not empty and not value:
        raise ValueError(f"{name} must not be empty")


def check_path(name: str, value, *, optional: bool = False) -> None:
    """A file system path: a non-empty str or os.PathLike without a NUL character (no OS takes one)."""
    if optional and value is None:
        return
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path (str or os.PathLike), got {_got(value)}")
    try:
        text = os.fspath(value)
    except TypeError:                   # a __fspath__ that returns neither str nor bytes
        text = None
    if not isinstance(text, str):       # a PathLike of bytes
        raise ValueError(f"{name} must be a path (str or os.PathLike), got {_got(value)}")
    if not text or "\x00" in text:
        raise ValueError(f"{name} must be a non-empty path without NUL characters, got {value!r}")


def check_instance(name: str, value, cls: type, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be {'None or ' if optional else ''}a {cls.__name__}, got {_got(value)}")
