"""The prefill worker's one engine thread (the engine is not thread-safe), pipelined by one request.

Work runs in the order it was submitted, except that a prefill is done in two halves: ``begin``
issues its pass and returns a ``finish`` that waits for the device, samples the first token and exports
the hand-off. When another prefill is queued, the loop begins it before finishing the earlier one:
the second request's host work (chunk lookups, loads, tables, the eager first layers) then overlaps
the first one's pass on the device instead of following it, and its pass is queued right behind. At
most one prefill waits unfinished; with nothing queued a prefill is finished at once, so a lone
request's first token is not delayed. Any other call (warm-up, reset) finishes the waiting prefill
first and runs alone.

Every error is handed to the future of the call that raised it; the thread itself stops only on
``stop`` or when something escapes that handling, and then ``alive`` turns False, what is queued is
failed and ``on_fatal`` is called (the server reports NOT_SERVING and the worker restarts).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

_STOP = object()


class EngineLoop:
    def __init__(self, name: str = "prefill-engine",
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._stopping = False
        self.on_fatal = on_fatal
        self.failure: BaseException | None = None   # why the thread stopped for good
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], object]) -> Future:
        """``fn()`` on the engine thread, after every earlier submission has finished."""
        fut: Future = Future()
        self._queue.put((False, fn, fut))
        return fut

    def prefill(self, begin: Callable[[], Callable[[], object]]) -> Future:
        """``begin()`` on the engine thread returns ``finish``; the future gets ``finish()``'s result
        (or the exception either half raised)."""
        fut: Future = Future()
        self._queue.put((True, begin, fut))
        return fut

    def waiting(self) -> int:
        """Submissions queued and not yet begun (approximate while other threads submit)."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        """Whether the engine thread still serves (health reports this, not the process's liveness)."""
        return self.failure is None and (self._stopping or self._thread.is_alive())

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what has not started, finish the prefill begun last, end the thread."""
        self._stopping = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the loop is over: say so, and let the worker restart
            self.failure = exc
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP and item[2].set_running_or_notify_cancel():
                    item[2].set_exception(RuntimeError("the engine loop stopped"))
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _serve(self) -> None:
        import torch

        pending = None        # (finish, future) of the prefill begun last
        with torch.no_grad():
            while True:
                try:
                    item = self._queue.get(block=pending is None)
                except queue.Empty:          # nothing behind the waiting prefill: finish it now
                    pending = _finish(pending)
                    continue
                if item is _STOP:
                    _finish(pending)
                    return
                is_prefill, fn, fut = item
                if self._stopping:
                    fut.cancel()
                    continue
                if not fut.set_running_or_notify_cancel():
                    continue
                if is_prefill:
                    try:
                        begun = (fn(), fut)
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)
                        begun = None
                    _finish(pending)             # the earlier pass, this one now queued behind it
                    pending = begun
                else:
                    pending = _finish(pending)
                    _settle(fut, fn)


def _finish(pending) -> None:
    if pending is not None:
        finish, fut = pending
        _settle(fut, finish)
    return None


def _settle(fut: Future, fn) -> None:
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        fut.set_exception(exc)
