"""The SDK's checks of what its callers give, made before anything is sent.

The SDK refuses what a message cannot carry as given: a wrong type (a float, bool or str where token
ids go), an integer outside its field's range (token ids and top_k are int32, max_new_tokens uint32,
the seed uint64), a number that is not finite (or overflows the float32 field, or a float: 10**400),
a timeout past one year (gRPC's deadline overflows), text that is not valid Unicode. Left to protobuf
and gRPC these would raise TypeError/ValueError/OverflowError, end DEADLINE_EXCEEDED at once, or be
changed silently (3.7 -> 3, 1e39 -> inf). What the model can serve (vocabulary, modes, the prompt's length, sampling
ranges) is the gateway's to check: one place, one set of messages.

Each refusal is an ``InvalidArgument`` whose message names the field, as the gateway's do.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import sys
from collections.abc import Iterable, Mapping, Set

from services.sdk.errors import InvalidArgument

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_SECONDS = 365 * 24 * 3600      # the longest timeout taken: one year


def refuse(details: str) -> InvalidArgument:
    return InvalidArgument("INVALID_ARGUMENT", details)


def shown(value) -> str:
    """``repr(value)`` cut to a readable length (10**400 has 401 digits; past 4,300 repr() raises)."""
    try:
        r = repr(value)
    except ValueError:
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return r if len(r) <= 60 else f"{r[:40]}... ({len(r)} characters)"


def integer(value, name: str, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi]; a bool or a float is refused, never truncated."""
    if isinstance(value, bool):
        raise refuse(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)       # int, numpy integers, 0-d integer tensors; never a float or a str
    except TypeError:
        raise refuse(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None
    if not lo <= v <= hi:
        raise refuse(f"{name} must be in [{lo}, {hi}], got {shown(v)}")
    return v


def number(value, name: str, limit: float = FLOAT32_MAX) -> float:
    """``value`` as a finite float of magnitude <= ``limit`` (a float32 field's range by default)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise refuse(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        v = float(value)
    except OverflowError:           # an int or Fraction past float's range (10**400)
        v = math.inf
    if not (math.isfinite(v) and abs(v) <= limit):
        raise refuse(f"{name} must be a finite number, got {shown(value)}")
    return v


def seconds(value, name: str) -> float:
    """A duration: a number of seconds in (0, one year]."""
    v = number(value, name, limit=math.inf)
    if v <= 0:
        raise refuse(f"{name} must be a number of seconds > 0, got {shown(value)}")
    # NOTE: gRPC's deadline is now + timeout in int64 nanoseconds since the epoch; past ~7.4e9 s it
    # overflows and the call ends DEADLINE_EXCEEDED at once. A year is far below that: refuse, never clamp.
    if v > MAX_SECONDS:
        raise refuse(f"{name} must be at most one year ({MAX_SECONDS} s), got {shown(value)}")
    return v


def text(value, name: str) -> str:
    """A str that UTF-8 can carry (a lone surrogate cannot)."""
    if not isinstance(value, str):
        raise refuse(f"{name} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise refuse(f"{name} is not valid text: {value[exc.start]!r} at position {exc.start} "
                     "cannot be encoded as UTF-8") from None
    return value


def flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise refuse(f"{name} must be True or False, got {value!r}")
    return value


def token_ids(ids, where: str) -> list[int]:
    """``ids`` as a list of ints in [0, 2**31): token ids are never negative, and the field is int32."""
    if isinstance(ids, (str, bytes, bytearray, Mapping, Set)) or not isinstance(ids, Iterable):
        raise refuse(f"{where} must be a sequence of token ids, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if type(t) is not int:          # the common case costs one type test; the rest is checked in full
            t = integer(t, f"{where}: token {i}", 0, INT32_MAX)
        out.append(t)
    if out and (min(out) < 0 or max(out) > INT32_MAX):
        i, bad = next((i, t) for i, t in enumerate(out) if not 0 <= t <= INT32_MAX)
        raise refuse(f"token id {shown(bad)} in {where} (token {i}) is outside [0, {INT32_MAX}]")
    return out


def path(value, name: str) -> str | os.PathLike:
    if not isinstance(value, (str, os.PathLike)):
        raise refuse(f"{name} must be None, True, a CA file path or grpc.ChannelCredentials, got {value!r}")
    return value
