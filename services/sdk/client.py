"""The blocking client of a Tessera cluster.

    from services.sdk import Client
    with Client("127.0.0.1:50051") as c:
        for ev in c.generate(chunks=["doc one ...", "doc two ..."], suffix="Question?", max_new_tokens=32):
            print(ev.text, end="")

Every call carries a deadline (``timeout`` seconds, per call or the client's default). Calls that
can be repeated safely (``stats``, ``register_chunks``, and ``generate`` until its first event
arrived) are retried on UNAVAILABLE with exponential backoff. Failures raise ``TesseraError``
subclasses (``services.sdk.errors``) carrying the server's reason; a value the request cannot carry
(a float token id, a seed past uint64, a NaN temperature, ...) raises ``InvalidArgument`` before
anything is sent (``services.sdk.checks``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc

from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc
from services.sdk import checks
from services.sdk.errors import from_rpc_error
from services.sdk.types import (Chunk, ClusterStats, GenerateEvent, RegisteredChunk, chunk_inputs,
                                generate_request)

T = TypeVar("T")
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.keepalive_time_ms", 30_000)]


def channel_credentials(tls) -> grpc.ChannelCredentials | None:
    """None: plaintext; True: TLS with the system roots; a path: TLS trusting that CA PEM file;
    or ready-made ``grpc.ChannelCredentials``."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    try:
        with open(checks.path(tls, "tls"), "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    except (OSError, ValueError) as exc:       # ValueError: a NUL byte in the path ("ca\x00.pem")
        raise checks.refuse(f"tls: cannot read the CA file {tls!r} ({getattr(exc, 'strerror', None) or exc})") from None


class _Settings:
    def __init__(self, address: str, token: str | None, timeout: float, retries: int, backoff_s: float) -> None:
        if not isinstance(address, str) or ":" not in address:
            raise checks.refuse(f"address must be host:port, got {address!r}")
        if token is not None and not (isinstance(token, str) and token.isascii() and token.isprintable()):
            raise checks.refuse("token must be a str of printable ASCII characters (it travels in a header)")
        self.address, self.timeout = address, checks.seconds(timeout, "timeout")
        self.retries = checks.integer(retries, "retries", 0, 1_000)
        self.backoff_s = checks.number(backoff_s, "backoff_s", limit=3600.0)
        if self.backoff_s < 0:
            raise checks.refuse(f"backoff_s must be >= 0, got {backoff_s!r}")
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def call_timeout(self, timeout: float | None) -> float:
        """A call's deadline in seconds from now: its own ``timeout``, else the client's."""
        return self.timeout if timeout is None else checks.seconds(timeout, "timeout")

    def pause(self, exc: grpc.RpcError, attempt: int, deadline: float) -> float | None:
        """The retry policy of both clients: seconds to wait before trying ``attempt + 1`` after ``exc``, or None
        when the call ends here (not UNAVAILABLE, retries spent, or the pause would pass the deadline)."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
            return None
        pause = min(self.backoff_s * 2 ** attempt, 5.0)
        return None if time.monotonic() + pause >= deadline else pause


class Client:
    def __init__(self, address: str, token: str | None = None, tls=None, *, timeout: float = 60.0,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        self._s = _Settings(address, token, timeout, retries, backoff_s)
        creds = channel_credentials(tls)
        self._channel = (grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS) if creds
                         else grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
        self._stub = pb_grpc.TesseraStub(self._channel)

    # ------------------------------------------------------------------ calls
    def generate(self, chunks: Sequence[Chunk] = (), suffix: str | Sequence[int] = "", *, max_new_tokens: int = 16,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 mode: str = "tessera", recompute_ratio: float | None = None,
                 stop_token_ids: Sequence[int] | None = None, request_id: str | None = None,
                 timeout: float | None = None, decode: str = "dense", budget_tokens: int | None = None,
                 dense_layers: int | None = None, retro_window: int | None = None, retrieval_k: int | None = None,
                 sink_tokens: int | None = None, window_tokens: int | None = None) -> Iterator[GenerateEvent]:
        """Stream the generated tokens. ``stop_token_ids=None`` stops at the model's EOS; a list
        (even empty) stops only at those. ``recompute_ratio=None`` lets the cluster choose. ``decode``: how the
        decode steps attend ("dense"; "quest" with ``budget_tokens`` and ``dense_layers``; "retro" with those and
        ``retro_window``; "retrieval" with ``retrieval_k``, ``sink_tokens`` and ``window_tokens``); the last event's
        ``stats.decode`` says what they read."""
        req = generate_request(chunks, suffix, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               top_k=top_k, seed=seed, mode=mode, recompute_ratio=recompute_ratio,
                               stop_token_ids=stop_token_ids, request_id=request_id, decode=decode,
                               budget_tokens=budget_tokens, dense_layers=dense_layers, retro_window=retro_window,
                               retrieval_k=retrieval_k, sink_tokens=sink_tokens, window_tokens=window_tokens)
        return self._stream(req, self._s.call_timeout(timeout))

    def _stream(self, req: pb.GenerateRequest, timeout: float) -> Iterator[GenerateEvent]:
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            started = False
            try:
                call = self._stub.Generate(req, timeout=max(deadline - time.monotonic(), 0.001),
                                           metadata=self._s.metadata)
                try:
                    for msg in call:
                        started = True
                        yield GenerateEvent.from_proto(msg)
                finally:
                    call.cancel()     # a caller that stops iterating frees the request's decode slot
                return
            except grpc.RpcError as exc:
                if started or not self._retry(exc, attempt, deadline):
                    raise from_rpc_error(exc, "Generate") from None
            attempt += 1

    def complete(self, chunks: Sequence[Chunk] = (), suffix: str | Sequence[int] = "", **kwargs) -> GenerateEvent:
        """``generate`` gathered into one event: every token, the whole text, the stats."""
        tokens, text, last = [], [], GenerateEvent()
        for ev in self.generate(chunks, suffix, **kwargs):
            tokens += ev.token_ids
            text.append(ev.text)
            last = ev
        return GenerateEvent(tuple(tokens), "".join(text), last.finish_reason, last.stats)

    def register_chunks(self, chunks: Sequence[str | Sequence[int]], *, timeout: float | None = None) -> list[RegisteredChunk]:
        """Compute and store the KV of each chunk ahead of time; returns their ids (``ChunkId(id)``
        names them in ``generate``)."""
        req = pb.RegisterChunksRequest(chunks=chunk_inputs(chunks))
        resp = self._unary("RegisterChunks", lambda t: self._stub.RegisterChunks(req, timeout=t, metadata=self._s.metadata),
                           timeout)
        return [RegisteredChunk(c.chunk_id, c.num_tokens, c.stored) for c in resp.chunks]

    def stats(self, *, timeout: float | None = None) -> ClusterStats:
        resp = self._unary("Stats", lambda t: self._stub.Stats(pb.StatsRequest(), timeout=t, metadata=self._s.metadata),
                           timeout)
        return ClusterStats.from_proto(resp)

    def reset_caches(self, *, device_only: bool = False, timeout: float | None = None) -> int:
        """Drop cached chunk KV everywhere (benchmarks start each mode cold), or with ``device_only``
        only the workers' device caches (the KV store keeps its chunks); returns chunks dropped."""
        req = pb.ResetCachesRequest(device_only=checks.flag(device_only, "device_only"))
        resp = self._unary("ResetCaches", lambda t: self._stub.ResetCaches(req, timeout=t, metadata=self._s.metadata),
                           timeout)
        return resp.chunks_dropped

    def wait_ready(self, timeout: float = 30.0) -> None:
        timeout = checks.seconds(timeout, "timeout")
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"the gateway at {self._s.address} did not answer within {timeout} s") from None
        finally:
            # NOTE: a future left subscribed keeps gRPC's polling thread running until close() (which it
            # may then meet as "Channel closed!"); cancelled, the thread ends at its next 0.2 s poll
            ready.cancel()

    # ------------------------------------------------------------------ plumbing
    def _retry(self, exc: grpc.RpcError, attempt: int, deadline: float) -> bool:
        pause = self._s.pause(exc, attempt, deadline)
        if pause is not None:
            time.sleep(pause)
        return pause is not None

    def _unary(self, method: str, call: Callable[[float], T], timeout: float | None) -> T:
        deadline = time.monotonic() + self._s.call_timeout(timeout)
        attempt = 0
        while True:
            try:
                return call(max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as exc:
                if not self._retry(exc, attempt, deadline):
                    raise from_rpc_error(exc, method) from None
            attempt += 1

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
