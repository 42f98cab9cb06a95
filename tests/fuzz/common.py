"""What every fuzz test shares: bounded, derandomized settings and the checks of a status message.

Settings are an object each test applies (``@FUZZ`` or ``settings(FUZZ, max_examples=...)``), never a
loaded profile: a profile is global and would change other suites' hypothesis tests in the same run.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, settings

# derandomize: the same examples every run (CI must not flake); no example database on disk either
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])

# A Python traceback, an exception's class name as its text starts ("TypeError: ..."), or a repr of a class
# ("<class 'google.protobuf.message.DecodeError'>"): what a status message must never show a client.
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*(?:Error|Exception)\b'?>?:|<class '")


def leaked_traceback(details: str, *sent: str) -> str | None:
    """The traceback-like text in ``details``, unless the caller sent that text itself (a refusal may quote
    the input: "unknown mode 'ValueError: x'")."""
    m = TRACEBACK.search(details or "")
    if m is None or any(m.group(0) in s for s in sent if isinstance(s, str)):
        return None
    return m.group(0)


def expect(ok: bool, message: str) -> None:
    """Fail with ``message`` alone: the xfail tests pin a known defect with it.

    NOTE: no traceback on purpose. pytest parses the source of every traceback entry (``ast.parse``), and
    under CPython 3.11 that parse at times raises ``SystemError: AST constructor recursion depth mismatch``
    after a gRPC failure, which ends the whole session as INTERNALERROR; an expected failure needs no
    traceback."""
    if not ok:
        pytest.fail(message, pytrace=False)
