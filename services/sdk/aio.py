"""The asyncio twin of ``Client``: the same calls, awaited (``generate`` is an async iterator).

    async with AsyncClient("127.0.0.1:50051") as c:
        async for ev in c.generate(chunks=[...], suffix="...", max_new_tokens=32):
            ...
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc
from services.sdk import checks
from services.sdk.client import CHANNEL_OPTIONS, _Settings, channel_credentials
from services.sdk.errors import from_rpc_error
from services.sdk.types import (Chunk, ClusterStats, GenerateEvent, RegisteredChunk, chunk_inputs,
                                generate_request)


class AsyncClient:
    def __init__(self, address: str, token: str | None = None, tls=None, *, timeout: float = 60.0,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        self._s = _Settings(address, token, timeout, retries, backoff_s)
        creds = channel_credentials(tls)
        self._channel = (grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS) if creds
                         else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
        self._stub = pb_grpc.TesseraStub(self._channel)

    def generate(self, chunks: Sequence[Chunk] = (), suffix: str | Sequence[int] = "", *, max_new_tokens: int = 16,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 mode: str = "tessera", recompute_ratio: float | None = None,
                 stop_token_ids: Sequence[int] | None = None, request_id: str | None = None,
                 timeout: float | None = None, decode: str = "dense", budget_tokens: int | None = None,
                 dense_layers: int | None = None, retro_window: int | None = None, retrieval_k: int | None = None,
                 sink_tokens: int | None = None, window_tokens: int | None = None) -> AsyncIterator[GenerateEvent]:
        """As ``Client.generate``: retried on UNAVAILABLE until the first event arrived."""
        req = generate_request(chunks, suffix, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               top_k=top_k, seed=seed, mode=mode, recompute_ratio=recompute_ratio,
                               stop_token_ids=stop_token_ids, request_id=request_id, decode=decode,
                               budget_tokens=budget_tokens, dense_layers=dense_layers, retro_window=retro_window,
                               retrieval_k=retrieval_k, sink_tokens=sink_tokens, window_tokens=window_tokens)
        return self._stream(req, self._s.call_timeout(timeout))

    async def _stream(self, req: pb.GenerateRequest, timeout: float) -> AsyncIterator[GenerateEvent]:
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            started = False
            try:
                call = self._stub.Generate(req, timeout=max(deadline - time.monotonic(), 0.001),
                                           metadata=self._s.metadata)
                try:
                    async for msg in call:
                        started = True
                        yield GenerateEvent.from_proto(msg)
                finally:
                    call.cancel()     # a caller that stops iterating frees the request's decode slot
                return
            except grpc.aio.AioRpcError as exc:
                if started or not await self._retry(exc, attempt, deadline):
                    raise from_rpc_error(exc, "Generate") from None
            attempt += 1

    async def register_chunks(self, chunks: Sequence[str | Sequence[int]], *,
                              timeout: float | None = None) -> list[RegisteredChunk]:
        req = pb.RegisterChunksRequest(chunks=chunk_inputs(chunks))
        resp = await self._unary("RegisterChunks", self._stub.RegisterChunks, req, timeout)
        return [RegisteredChunk(c.chunk_id, c.num_tokens, c.stored) for c in resp.chunks]

    async def stats(self, *, timeout: float | None = None) -> ClusterStats:
        return ClusterStats.from_proto(await self._unary("Stats", self._stub.Stats, pb.StatsRequest(), timeout))

    async def reset_caches(self, *, device_only: bool = False, timeout: float | None = None) -> int:
        req = pb.ResetCachesRequest(device_only=checks.flag(device_only, "device_only"))
        resp = await self._unary("ResetCaches", self._stub.ResetCaches, req, timeout)
        return resp.chunks_dropped

    async def _retry(self, exc: grpc.aio.AioRpcError, attempt: int, deadline: float) -> bool:
        pause = self._s.pause(exc, attempt, deadline)
        if pause is not None:
            await asyncio.sleep(pause)
        return pause is not None

    async def _unary(self, method: str, rpc, req, timeout: float | None):
        deadline = time.monotonic() + self._s.call_timeout(timeout)
        attempt = 0
        while True:
            try:
                return await rpc(req, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._s.metadata)
            except grpc.aio.AioRpcError as exc:
                if not await self._retry(exc, attempt, deadline):
                    raise from_rpc_error(exc, method) from None
            attempt += 1

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
