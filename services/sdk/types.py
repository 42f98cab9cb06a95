"""What the SDK takes and returns: plain, typed values (no protobuf in the public surface)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

from services.rpc import tessera_pb2 as pb
from services.sdk.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class ChunkId:
    """A chunk named by the id ``register_chunks`` returned."""

    id: str


# A chunk: text (the gateway tokenizes it), token ids, or a registered id.
Chunk = Union[str, Sequence[int], ChunkId]


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """Per-request outcome, on the last event. chunk_tokens_by_tier: gpu | dram | rocksdb | s3 | computed."""

    chunk_tokens_by_tier: dict[str, int]
    recomputed_tokens: int
    prompt_tokens: int
    output_tokens: int
    queue_seconds: float
    prefill_seconds: float
    load_wait_seconds: float
    loaded_bytes: int
    handoff_bytes: int
    transport: str
    prefill_worker: str
    decode_worker: str
    recompute_ratio: float
    chunk_ids: tuple[str, ...]
    load_seconds: float = 0.0        # store streaming time; load_seconds - load_wait_seconds overlapped compute
    first_token_seconds: float = 0.0  # prefill worker: taking the request to sampling its first token
    handoff_seconds: float = 0.0      # prefill worker: serialising and pushing the hand-off (0: none needed)
    chunk_compute_seconds: float = 0.0  # prefill worker: computing missing chunks alone
    forward_seconds: float = 0.0      # prefill worker: the pass over placed chunks and suffix

    @classmethod
    def from_proto(cls, s: pb.RequestStats) -> "GenerationStats":
        return cls(dict(s.chunk_tokens_by_tier), s.recomputed_tokens, s.prompt_tokens, s.output_tokens,
                   s.queue_seconds, s.prefill_seconds, s.load_wait_seconds, s.loaded_bytes, s.handoff_bytes,
                   s.transport, s.prefill_worker, s.decode_worker, s.recompute_ratio, tuple(s.chunk_ids), s.load_seconds,
                   s.first_token_seconds, s.handoff_seconds, s.chunk_compute_seconds, s.forward_seconds)


@dataclass(frozen=True, slots=True)
class GenerateEvent:
    """One streamed message: new tokens (and their text); the last has finish_reason and stats."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None      # "stop" (a stop token was produced) or "length"
    stats: GenerationStats | None = None

    @classmethod
    def from_proto(cls, m: pb.GenerateResponse) -> "GenerateEvent":
        return cls(tuple(m.token_ids), m.text, m.finish_reason or None,
                   GenerationStats.from_proto(m.stats) if m.HasField("stats") else None)


@dataclass(frozen=True, slots=True)
class RegisteredChunk:
    chunk_id: str
    num_tokens: int
    stored: bool          # its KV is in the cluster's KV store


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    name: str
    role: str
    address: str
    healthy: bool
    in_flight: int
    resident_chunks: int
    metrics_url: str


@dataclass(frozen=True, slots=True)
class ClusterStats:
    model: str
    vocab_size: int
    max_position_embeddings: int
    transport: str
    workers: tuple[WorkerInfo, ...]
    requests_total: int
    registered_chunks: int
    metrics_url: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_proto(cls, s: pb.StatsResponse) -> "ClusterStats":
        workers = tuple(WorkerInfo(w.name, w.role, w.address, w.healthy, w.in_flight, w.resident_chunks, w.metrics_url)
                        for w in s.workers)
        return cls(s.model, s.vocab_size, s.max_position_embeddings, s.transport, workers, s.requests_total,
                   s.registered_chunks, s.metrics_url)


def chunk_input(c: Chunk, where: str) -> pb.ChunkInput:
    if isinstance(c, ChunkId):
        return pb.ChunkInput(chunk_id=c.id)
    if isinstance(c, str):
        return pb.ChunkInput(text=c)
    if isinstance(c, (bytes, bytearray)):
        raise TypeError(f"{where}: give text as str, not bytes")
    try:
        return pb.ChunkInput(tokens=pb.TokenIds(ids=[int(t) for t in c]))
    except (TypeError, ValueError):
        raise TypeError(f"{where} must be text, a sequence of token ids or a ChunkId, got {type(c).__name__}") from None


def generate_request(chunks: Sequence[Chunk], suffix: str | Sequence[int], *, max_new_tokens: int, temperature: float,
                     top_p: float, top_k: int, seed: int | None, mode: str, recompute_ratio: float | None,
                     stop_token_ids: Sequence[int] | None, request_id: str | None) -> pb.GenerateRequest:
    """The GenerateRequest for ``Client.generate``'s arguments. Values are checked by the gateway
    (one place, one set of messages); only types are checked here."""
    if isinstance(chunks, (str, ChunkId)):
        chunks = [chunks]
    req = pb.GenerateRequest(chunks=[chunk_input(c, f"chunk {i}") for i, c in enumerate(chunks)], mode=mode,
                             request_id=request_id or "")
    if isinstance(suffix, str):
        req.suffix_text = suffix
    else:
        req.suffix_tokens.ids.extend(int(t) for t in suffix)
    # proto3 reads 0 as "unset" and cannot carry a negative count: these two are refused here,
    # with the exception the gateway would raise; every other value is checked by the gateway.
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidArgument("INVALID_ARGUMENT", f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not top_p > 0:
        raise InvalidArgument("INVALID_ARGUMENT", f"top_p must be in (0, 1], got {top_p}")
    s = req.sampling
    s.temperature, s.top_p, s.top_k, s.max_new_tokens = temperature, top_p, top_k, max_new_tokens
    if seed is not None:
        s.seed = seed
    if stop_token_ids is not None:
        s.stop_token_ids.extend(int(t) for t in stop_token_ids)
        s.ignore_eos = True
    if recompute_ratio is not None:
        req.recompute_ratio = recompute_ratio
    return req
