"""What the SDK takes and returns: plain, typed values (no protobuf in the public surface)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Union

from services.rpc import tessera_pb2 as pb
from services.sdk import checks


@dataclass(frozen=True, slots=True)
class ChunkId:
    """A chunk named by the id ``register_chunks`` returned."""

    id: str

    def __post_init__(self) -> None:
        checks.text(self.id, "ChunkId.id")


@dataclass(frozen=True, slots=True)
class Shared:
    """A chunk (text or token ids) placed in a namespace the cluster declares shared (a public corpus): one
    copy of its KV serves every tenant that may read ``namespace``. Plain chunks stay in the caller's own."""

    chunk: Union[str, Sequence[int]]
    namespace: str

    def __post_init__(self) -> None:
        checks.text(self.namespace, "Shared.namespace")
        if not self.namespace:
            raise checks.refuse("Shared.namespace must name a shared namespace")
        if isinstance(self.chunk, (Shared, ChunkId)):
            raise checks.refuse("Shared.chunk must be text or token ids")


# A chunk: text (the gateway tokenizes it), token ids, a registered id, or one of those in a shared namespace.
Chunk = Union[str, Sequence[int], ChunkId, Shared]


@dataclass(frozen=True, slots=True)
class DecodeStats:
    """The request's decode policy and what its decode steps read, in pages (KV blocks) per KV head and layer summed
    over its steps. pages_visible: what dense steps would have read; pages_read: what its policy read for the current
    token (``pages_read / pages_visible`` is the share of the KV it attended); pages_corrected (retro): pages read
    for the current token and reused to correct past tokens' attention; keys_scanned, retrieval_seconds (retrieval):
    the keys its CPU index searches scored and the time its steps spent in them (pages_read then counts the static
    set's pages). steps 0: the first token, sampled by the prefill worker, ended the request."""

    policy: str = "dense"
    steps: int = 0
    pages_visible: int = 0
    pages_read: int = 0
    pages_corrected: int = 0
    keys_scanned: int = 0
    retrieval_seconds: float = 0.0

    @classmethod
    def from_proto(cls, s: pb.DecodeStats) -> "DecodeStats":
        return cls(s.policy or "dense", s.steps, s.pages_visible, s.pages_read, s.pages_corrected, s.keys_scanned,
                   s.retrieval_seconds)


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """Per-request outcome, on the last event. chunk_tokens_by_tier: keyed by ``Tier`` values (gpu | host | dram |
    rocksdb | s3 | computed; a ``Tier`` looks a key up, the keys are plain text)."""

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
    decode: DecodeStats = DecodeStats()   # decode worker: the policy and what its steps read

    @classmethod
    def from_proto(cls, s: pb.RequestStats) -> "GenerationStats":
        return cls(dict(s.chunk_tokens_by_tier), s.recomputed_tokens, s.prompt_tokens, s.output_tokens,
                   s.queue_seconds, s.prefill_seconds, s.load_wait_seconds, s.loaded_bytes, s.handoff_bytes,
                   s.transport, s.prefill_worker, s.decode_worker, s.recompute_ratio, tuple(s.chunk_ids), s.load_seconds,
                   s.first_token_seconds, s.handoff_seconds, s.chunk_compute_seconds, s.forward_seconds,
                   DecodeStats.from_proto(s.decode))


@dataclass(frozen=True, slots=True)
class GenerateEvent:
    """One streamed message: new tokens and the text they complete; the last has finish_reason and stats.

    ``text`` is whole characters: one whose bytes span tokens comes with the event of its last token
    (the last event brings any still held back), so a stream's texts add up to the decode of its tokens."""

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
    tenant: str = ""            # the tenant the caller's token names; workers are listed for an admin only

    @classmethod
    def from_proto(cls, s: pb.StatsResponse) -> "ClusterStats":
        workers = tuple(WorkerInfo(w.name, w.role, w.address, w.healthy, w.in_flight, w.resident_chunks, w.metrics_url)
                        for w in s.workers)
        return cls(s.model, s.vocab_size, s.max_position_embeddings, s.transport, workers, s.requests_total,
                   s.registered_chunks, s.metrics_url, tenant=s.tenant)


def chunk_input(c: Chunk, where: str) -> pb.ChunkInput:
    if isinstance(c, Shared):
        out = chunk_input(c.chunk, where)
        out.namespace = c.namespace
        return out
    if isinstance(c, ChunkId):
        return pb.ChunkInput(chunk_id=c.id)
    if isinstance(c, str):
        return pb.ChunkInput(text=checks.text(c, where))
    if isinstance(c, (bytes, bytearray)):
        raise checks.refuse(f"{where}: give text as str, not bytes")
    if not isinstance(c, Iterable):
        raise checks.refuse(f"{where} must be text, a sequence of token ids or a ChunkId, got {type(c).__name__}")
    return pb.ChunkInput(tokens=pb.TokenIds(ids=checks.token_ids(c, where)))


def chunk_inputs(chunks) -> list[pb.ChunkInput]:
    """The ChunkInputs of a call's ``chunks``: one text or ChunkId, or a sequence of chunks."""
    if isinstance(chunks, (str, ChunkId, Shared)):
        chunks = [chunks]
    if isinstance(chunks, (bytes, bytearray, Mapping, Set)) or not isinstance(chunks, Iterable):
        raise checks.refuse("chunks must be a list of chunks (text, token ids or ChunkId), "
                            f"got {type(chunks).__name__}")
    return [chunk_input(c, f"chunk {i}") for i, c in enumerate(chunks)]


def generate_request(chunks: Sequence[Chunk], suffix: str | Sequence[int], *, max_new_tokens: int, temperature: float,
                     top_p: float, top_k: int, seed: int | None, mode: str, recompute_ratio: float | None,
                     stop_token_ids: Sequence[int] | None, request_id: str | None, decode: str = "dense",
                     budget_tokens: int | None = None, dense_layers: int | None = None,
                     retro_window: int | None = None, retrieval_k: int | None = None, sink_tokens: int | None = None,
                     window_tokens: int | None = None) -> pb.GenerateRequest:
    """The GenerateRequest for ``Client.generate``'s arguments. Here each value is checked against what
    the message can carry (``checks``); what the model can serve is checked by the gateway."""
    req = pb.GenerateRequest(chunks=chunk_inputs(chunks), mode=checks.text(mode, "mode"),
                             request_id="" if request_id is None else checks.text(request_id, "request_id"))
    if isinstance(suffix, str):
        req.suffix_text = checks.text(suffix, "suffix")
    else:
        req.suffix_tokens.ids.extend(checks.token_ids(suffix, "suffix"))
    s = req.sampling
    # proto3 reads 0 as "unset" and cannot carry a negative count: max_new_tokens >= 1 and top_p > 0
    # are refused here, with the exception the gateway would raise; their other bounds are the gateway's
    s.max_new_tokens = checks.integer(max_new_tokens, "max_new_tokens", 1, checks.UINT32_MAX)
    s.top_p = checks.number(top_p, "top_p")
    if not s.top_p > 0:
        raise checks.refuse(f"top_p must be in (0, 1], got {top_p}")
    s.temperature = checks.number(temperature, "temperature")
    s.top_k = checks.integer(top_k, "top_k", -checks.INT32_MAX - 1, checks.INT32_MAX)
    if seed is not None:
        s.seed = checks.integer(seed, "seed", 0, checks.UINT64_MAX)
    if stop_token_ids is not None:
        s.stop_token_ids.extend(checks.token_ids(stop_token_ids, "stop_token_ids"))
        s.ignore_eos = True
    if recompute_ratio is not None:
        req.recompute_ratio = checks.number(recompute_ratio, "recompute_ratio")
    params = {"budget_tokens": budget_tokens, "dense_layers": dense_layers, "retro_window": retro_window,
              "retrieval_k": retrieval_k, "sink_tokens": sink_tokens, "window_tokens": window_tokens}
    if decode != "dense" or any(v is not None for v in params.values()):
        req.decode.name = checks.text(decode, "decode")
        for name, value in params.items():      # which policy takes which, and their ranges, are the gateway's
            if value is not None:
                setattr(req.decode, name, checks.integer(value, name, 0, checks.UINT32_MAX))
    return req
