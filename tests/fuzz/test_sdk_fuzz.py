"""Fuzzing the SDK's arguments (services/sdk) with random Python values.

Property, for every argument of ``Client``/``AsyncClient`` and of their calls: a value the request cannot carry
as given is refused with ``InvalidArgument`` naming the argument, before anything is sent; a value it can carry
is taken. Never TypeError, ValueError, OverflowError or a protobuf error. The clients point at a port where
nothing listens: a refusal there is the SDK's own (a call that went out ends ``Unavailable``).

What "can carry" means is written out below (``carries``), from services/sdk/checks.py's docstring: token ids
are ints in [0, 2**31), numbers finite and within float32, timeouts at most a year, text valid UTF-8, counts
within their field's range. The inputs of defects found here are kept as tests of their own at the end.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import operator
import os
import struct
from collections.abc import Iterable, Mapping, Set
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.sdk import AsyncClient, ChunkId, Client, InvalidArgument, TesseraError, Unavailable

from .common import FUZZ, expect

INT32_MAX, UINT32_MAX, UINT64_MAX = 2**31 - 1, 2**32 - 1, 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
ONE_YEAR_S = 365 * 24 * 3600


# ---------------------------------------------------------------------------------------------- the oracle
def _index(v) -> int | None:
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def int_in(lo: int, hi: int):
    return lambda v: (i := _index(v)) is not None and lo <= i <= hi


def _float(v) -> float | None:
    """``v`` as a float when it is a real number (not a bool) that a float can hold, else None."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def float32(v) -> bool:
    f = _float(v)
    return f is not None and math.isfinite(f) and abs(f) <= FLOAT32_MAX


def top_p(v) -> bool:
    """A float32 > 0 once stored (1e-46 becomes 0.0, which the wire reads as unset)."""
    return float32(v) and struct.unpack("f", struct.pack("f", float(v)))[0] > 0


def seconds(v) -> bool:
    """A timeout: > 0 and at most a year (past ~7.4e9 s gRPC's int64-nanosecond deadline overflows)."""
    f = _float(v)
    return f is not None and 0 < f <= ONE_YEAR_S


def text(v) -> bool:
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def token_ids(v) -> bool:
    if isinstance(v, (str, bytes, bytearray, Mapping, Set)) or not isinstance(v, Iterable):
        return False
    return all(int_in(0, INT32_MAX)(t) for t in v)


def chunk(v) -> bool:
    if isinstance(v, ChunkId):
        return True
    if isinstance(v, str):
        return text(v)
    return not isinstance(v, (bytes, bytearray)) and token_ids(v)


def chunks(v) -> bool:
    if isinstance(v, (str, ChunkId)):
        return chunk(v)
    if isinstance(v, (bytes, bytearray, Mapping, Set)) or not isinstance(v, Iterable):
        return False
    return all(chunk(c) for c in v)


def optional(ok):
    return lambda v: v is None or ok(v)


def readable_file(v) -> bool:
    return isinstance(v, (str, os.PathLike)) and os.path.isfile(v) and os.access(v, os.R_OK)


GENERATE_ARGS = {
    # argument: (what the message can carry, how a refusal names it)
    "chunks": (chunks, "chunk"),
    "suffix": (lambda v: text(v) if isinstance(v, str) else token_ids(v), "suffix"),
    "max_new_tokens": (int_in(1, UINT32_MAX), "max_new_tokens"),
    "temperature": (float32, "temperature"),
    "top_p": (top_p, "top_p"),
    "top_k": (int_in(-INT32_MAX - 1, INT32_MAX), "top_k"),
    "seed": (optional(int_in(0, UINT64_MAX)), "seed"),
    "mode": (text, "mode"),
    "recompute_ratio": (optional(float32), "recompute_ratio"),
    "stop_token_ids": (optional(token_ids), "stop_token_ids"),
    "request_id": (optional(text), "request_id"),
    "timeout": (optional(seconds), "timeout"),
}
CLIENT_ARGS = {
    "address": (lambda v: isinstance(v, str) and ":" in v, "address"),
    "token": (lambda v: v is None or (isinstance(v, str) and v.isascii() and v.isprintable()), "token"),
    "tls": (lambda v: v is None or isinstance(v, bool) or readable_file(v), "tls"),
    "timeout": (seconds, "timeout"),
    "retries": (int_in(0, 1000), "retries"),
    "backoff_s": (lambda v: (f := _float(v)) is not None and math.isfinite(f) and 0 <= f <= 3600, "backoff_s"),
}


# ---------------------------------------------------------------------------------------------- values
SPECIAL = st.sampled_from([
    0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64, -(2**31) - 1, 10**30, 10**400, -(10**400),
    0.0, -0.0, 1e-46, 1e-320, 31536000, 31536000.5, 1e10, 3.4028234663852886e38, 3.5e38, 1e39, math.nan, math.inf,
    -math.inf, 0.5, 3.7,
    Fraction(1, 3), Fraction(10**400), np.int64(5), np.int32(-1), np.uint64(2**64 - 1), np.int64(2**40), np.float32("nan"),
    np.float64(0.5), np.float16(1e-8), np.bool_(True), "", " ", "x", "\x00", "é🙂", "\ud800", "a\udc80b", "127.0.0.1:1",
    ":", "Bearer x", "a\nb", b"", b"abc", bytearray(b"1"), 1 + 0j, ChunkId("x"), ChunkId(""), range(3), np.array([1, 2]),
    np.array([1.5]), np.array([[1, 2]]), np.array([], dtype=np.int64), object(),
])
SCALARS = st.one_of(SPECIAL, st.none(), st.booleans(), st.integers(), st.integers(-3, 400), st.floats(), st.floats(-2, 2),
                    st.text(max_size=8), st.binary(max_size=4), st.fractions(), st.decimals(), st.complex_numbers(),
                    st.builds(ChunkId, st.text(max_size=4)))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                      | st.frozensets(st.integers(0, 3), max_size=2)
                      | st.dictionaries(st.text(max_size=2), inner, max_size=2), max_leaves=8)
# a valid-looking value of each argument now and then, so that acceptance is exercised too
NEAR = {
    "chunks": st.lists(st.text(max_size=5) | st.lists(st.integers(-2, 2**31 + 1), max_size=3) | st.builds(ChunkId, st.text(max_size=3)),
                       max_size=3),
    "suffix": st.text(max_size=5) | st.lists(st.integers(-2, 2**31 + 1), max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, 2**31 + 1), max_size=3),
    "tls": st.sampled_from([True, False, None, "/", "/nonexistent.pem", "/etc/hostname", "ca\x00.pem"]),
    "address": st.sampled_from(["127.0.0.1:1", "host", "h:p", ""]),
}


def value_of(arg: str):
    return st.one_of(VALUES, NEAR.get(arg, SCALARS))


# ---------------------------------------------------------------------------------------------- clients
@pytest.fixture(scope="module")
def nowhere():
    """An address nothing listens on."""
    from services.cluster.serving import free_port

    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def loop():
    """The event loop AsyncClients are built and called on (grpc.aio binds a channel to its loop)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def in_loop(loop, fn):
    """``fn()`` run inside ``loop`` (an AsyncClient is built and its calls made from a coroutine)."""
    async def run():
        return fn()
    return loop.run_until_complete(run())


@pytest.fixture(scope="module")
def clients(nowhere, loop):
    sync, aio = Client(nowhere, retries=0, timeout=5), in_loop(loop, lambda: AsyncClient(nowhere, retries=0, timeout=5))
    yield sync, aio
    sync.close()
    loop.run_until_complete(aio.close())


def check_refusal(exc: BaseException, name: str, arg: str, value) -> None:
    assert isinstance(exc, InvalidArgument), f"{arg}={value!r}: {type(exc).__name__}: {exc}"
    assert name in exc.details, f"{arg}={value!r}: the refusal does not name {name!r}: {exc.details}"


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
@pytest.mark.parametrize("arg", list(GENERATE_ARGS))
def test_generate_takes_what_the_request_carries_and_refuses_the_rest(arg, kind, clients, loop):
    client = clients[0] if kind == "Client" else clients[1]
    run = (lambda fn: fn()) if kind == "Client" else (lambda fn: in_loop(loop, fn))
    carries, name = GENERATE_ARGS[arg]
    base = {"chunks": [[1, 2]], "suffix": [3]}

    @settings(FUZZ, max_examples=40)
    @given(value_of(arg))
    def call(value):
        try:
            stream = run(lambda: client.generate(**{**base, arg: value}))   # checked now; sent once iterated
        except Exception as exc:  # noqa: BLE001 - the exception's type is what is checked
            check_refusal(exc, name, arg, value)
            assert not carries(value), f"{arg}={value!r} can be carried but was refused: {exc}"
        else:
            stream.close() if kind == "Client" else loop.run_until_complete(stream.aclose())
            assert carries(value), f"{arg}={value!r} was taken, but the request cannot carry it as given"

    call()


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
@pytest.mark.parametrize("arg", list(CLIENT_ARGS))
def test_a_client_is_built_from_valid_settings_only(arg, kind, nowhere, loop):
    carries, name = CLIENT_ARGS[arg]
    make = Client if kind == "Client" else (lambda **kw: in_loop(loop, lambda: AsyncClient(**kw)))
    base = {"address": nowhere}

    @settings(FUZZ, max_examples=40)
    @given(value_of(arg))
    def build(value):
        try:
            client = make(**{**base, arg: value})
        except Exception as exc:  # noqa: BLE001
            check_refusal(exc, name, arg, value)
            assert not carries(value), f"{arg}={value!r} is a valid setting but was refused: {exc}"
        else:
            client.close() if kind == "Client" else loop.run_until_complete(client.close())
            assert carries(value), f"{arg}={value!r} was taken as a setting"

    build()


def _sent(exc: BaseException) -> bool:
    """The call went out (and found nothing listening)."""
    return isinstance(exc, Unavailable)


CALLS = {
    # call: (argument, what it takes, how a refusal names it, the call)
    "register_chunks": ("chunks", chunks, "chunk", lambda c, v: c.register_chunks(v)),
    "register_chunks-timeout": ("timeout", optional(seconds), "timeout", lambda c, v: c.register_chunks(["a"], timeout=v)),
    "reset_caches": ("device_only", lambda v: isinstance(v, bool), "device_only", lambda c, v: c.reset_caches(device_only=v)),
    "reset_caches-timeout": ("timeout", optional(seconds), "timeout", lambda c, v: c.reset_caches(timeout=v)),
    "stats-timeout": ("timeout", optional(seconds), "timeout", lambda c, v: c.stats(timeout=v)),
}


@pytest.mark.parametrize("call_name", list(CALLS))
def test_a_unary_call_refuses_a_bad_value_before_sending(call_name, clients):
    arg, carries, name, call = CALLS[call_name]
    client = clients[0]

    @settings(FUZZ, max_examples=30)
    @given(value_of(arg))
    def once(value):
        try:
            call(client, value)
        except TesseraError as exc:
            if _sent(exc):
                assert carries(value), f"{arg}={value!r} was sent, but the request cannot carry it"
            else:
                check_refusal(exc, name, arg, value)
                assert not carries(value), f"{arg}={value!r} can be carried but was refused: {exc}"
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{call_name}({arg}={value!r}) raised {type(exc).__name__}: {exc}")
        else:
            pytest.fail(f"{call_name}({arg}={value!r}) answered, with nothing listening")

    once()


def test_wait_ready_refuses_a_bad_timeout(clients):
    client = clients[0]

    @settings(FUZZ, max_examples=30)
    @given(value_of("timeout"))
    def once(value):
        # a valid timeout waits: refusals only here
        assume(not seconds(value))
        try:
            client.wait_ready(timeout=value)
        except Exception as exc:  # noqa: BLE001
            check_refusal(exc, "timeout", "timeout", value)
        else:
            pytest.fail(f"wait_ready(timeout={value!r}) returned, with nothing listening")

    once()


def test_chunk_id_takes_text_only():
    @FUZZ
    @given(VALUES)
    def build(value):
        try:
            ChunkId(value)
        except Exception as exc:  # noqa: BLE001
            check_refusal(exc, "ChunkId.id", "id", value)
            assert not text(value)
        else:
            assert text(value)

    build()


# ---------------------------------------------------------------------------------------------- defects found, fixed
def test_a_number_too_large_for_a_float_is_refused(nowhere, clients):
    """float(10**400) raises OverflowError: checks.number() once let it out of every float argument."""
    client = clients[0]
    sites = {
        "generate(temperature)": lambda v: client.generate([[1]], [2], temperature=v),
        "generate(top_p)": lambda v: client.generate([[1]], [2], top_p=v),
        "generate(recompute_ratio)": lambda v: client.generate([[1]], [2], recompute_ratio=v),
        "generate(timeout)": lambda v: client.generate([[1]], [2], timeout=v),
        "stats(timeout)": lambda v: client.stats(timeout=v),
        "wait_ready(timeout)": lambda v: client.wait_ready(timeout=v),
        "Client(timeout)": lambda v: Client(nowhere, timeout=v),
        "Client(backoff_s)": lambda v: Client(nowhere, backoff_s=v),
    }
    wrong = []
    for site, call in sites.items():
        for value in (10**400, -(10**400), Fraction(10**400)):
            try:
                call(value)
                wrong.append(f"{site} took {value!r:.20}")
            except InvalidArgument:
                pass
            except Exception as exc:  # noqa: BLE001
                wrong.append(f"{site} with {value!r:.20}...: {type(exc).__name__}: {exc}")
    expect(not wrong, "\n".join(wrong))


def test_a_ca_path_with_a_nul_byte_is_refused(nowhere, loop):
    """open() raises ValueError (not OSError) for a NUL byte: channel_credentials() once let it out."""
    for make in (Client, lambda *a, **kw: in_loop(loop, lambda: AsyncClient(*a, **kw))):
        try:
            make(nowhere, tls="ca\x00.pem")
        except InvalidArgument as exc:
            expect("tls" in exc.details, f"the refusal does not name tls: {exc}")
        except Exception as exc:  # noqa: BLE001 - the defect: ValueError from open()
            expect(False, f"{type(exc).__name__}: {exc}")
        else:
            expect(False, "a CA path with a NUL byte was taken")


def test_a_timeout_past_a_year_is_refused(nowhere, clients):
    """gRPC's deadline (now + timeout in int64 nanoseconds) overflows past ~7.4e9 s: stats(timeout=1e10) once
    ended DEADLINE_EXCEEDED at once, with a live gateway too. Past a year a timeout is refused, naming the bound."""
    client = clients[0]
    sites = {
        "stats(timeout)": lambda v: client.stats(timeout=v),
        "generate(timeout)": lambda v: client.generate([[1]], [2], timeout=v),
        "wait_ready(timeout)": lambda v: client.wait_ready(timeout=v),
        "Client(timeout)": lambda v: Client(nowhere, timeout=v),
    }
    wrong = []
    for site, call in sites.items():
        for timeout in (ONE_YEAR_S + 1, 1e10, 1e300):
            try:
                call(timeout)
                wrong.append(f"{site} took {timeout}")
            except InvalidArgument as exc:
                if "timeout" not in exc.details or "one year" not in exc.details:
                    wrong.append(f"{site} with {timeout}: the refusal names no field or bound: {exc.details}")
            except Exception as exc:  # noqa: BLE001 - the defect: DeadlineExceeded at once
                wrong.append(f"{site} with {timeout}: {type(exc).__name__}: {exc}")
    expect(not wrong, "\n".join(wrong))


def test_wait_ready_gives_up_without_leaving_a_thread_behind(nowhere):
    """wait_ready() once left its channel-ready future subscribed: gRPC's polling thread ran on until close()."""
    import threading
    import time

    before = set(threading.enumerate())
    client = Client(nowhere, retries=0)
    try:
        with pytest.raises(TimeoutError):
            client.wait_ready(timeout=0.05)
        time.sleep(0.3)
        left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    finally:
        client.close()
    expect(not left, f"threads still running after wait_ready gave up: {left}")
