"""A decode stream sends the tokens that piled up behind a slow event loop as one message (server.coalesce), in
order, never past a failure, and ends with the finish reason when that is queued too."""

import asyncio

from services.cluster.errors import RequestError
from services.decode.server import coalesce


def _queue(*items):
    q: asyncio.Queue = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_tokens_queued_behind_the_first_go_in_one_message():
    q = _queue(([8], None, None), ([9], None, None))
    assert coalesce(([7], None, None), q) == ([7, 8, 9], None, None, None) and q.empty()
    assert coalesce(([7], None, None), _queue()) == ([7], None, None, None)


def test_the_finish_reason_ends_the_message_and_what_follows_waits():
    q = _queue(([8], None, None), ([], "stop", None), ([99], None, None))
    assert coalesce(([7], None, None), q) == ([7, 8], "stop", None, None)
    assert q.qsize() == 1                                   # nothing past the end was taken
    assert coalesce(([], "length", None), _queue(([5], None, None))) == ([], "length", None, None)


def test_a_failure_is_held_until_the_tokens_before_it_are_sent():
    err = RequestError("internal", "a decode step failed")
    q = _queue(([8], None, None), ([], None, err), ([9], None, None))
    toks, reason, got, held = coalesce(([7], None, None), q)
    assert (toks, reason, got) == ([7, 8], None, None) and held == ([], None, err)
    assert coalesce(held, q) == ([], None, err, None)      # the next message is the failure, alone
