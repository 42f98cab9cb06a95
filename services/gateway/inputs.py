"""Turning a GenerateRequest into token ids, and refusing bad input with a reason.

Chunks come as text (tokenized with the model's tokenizer.json), token ids, or ids returned by
RegisterChunks. Every refusal is an ``InvalidRequest`` (a ValueError) whose message is sent to the
client as INVALID_ARGUMENT; a request past its tenant's quotas is ``QuotaExceeded``
(RESOURCE_EXHAUSTED), a namespace the tenant may not use ``PermissionError`` (PERMISSION_DENIED).

Everything is per tenant (services/gateway/tenants.py): each chunk's namespace and so its id, the
registered ids it may name (another tenant's is "unknown", as one never registered), and the text
cache (a text another tenant sent is tokenized again: its time would tell). Quotas are checked before
the work they bound: the chunk count and the text's bytes before anything is tokenized, and tokens
of a refused request are not kept.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.cluster.sampling import DEFAULT_MAX_NEW_TOKENS, read_sampling
from services.engine.model.config import ModelConfig
from services.engine.sampling import SamplingParams
from services.gateway.tenants import DEFAULT, QuotaExceeded, Tenant
from services.modes import DECODE_FIELDS, DECODE_PARAMS, DECODE_POLICIES, MAX_RETRIEVAL_K, MAX_RETRO_WINDOW, MODES
from services.rpc import tessera_pb2 as pb


# no token of any tokenizer we serve covers more than this many bytes of text: a text longer than this many
# bytes per token of the model's limit cannot fit, and is refused before it is tokenized
MAX_BYTES_PER_TOKEN = 64


class InvalidRequest(ValueError):
    """Input the cluster refuses; the message says why."""




@dataclass(frozen=True, slots=True)
class ResolvedRequest:
    """A request in token ids. chunks[i] has chunk_ids[i] (content hash with the model fingerprint)."""

    chunks: tuple[Sequence[int], ...]  # tuples, or the request message's repeated fields (read-only)
    chunk_ids: tuple[str, ...]
    suffix: Sequence[int]
    mode: str
    recompute_ratio: float | None
    sampling: SamplingParams
    namespaces: tuple[str, ...] = ()   # each chunk's namespace, () when all are plain (no tenants)
    decode: pb.DecodePolicy | None = None  # checked names and counts; None: dense

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.chunks)) + len(self.suffix)


class ChunkRegistry:
    """Chunk ids handed out by RegisterChunks -> (namespace, token ids).

    Kept in the gateway's memory and, when ``backing`` is given (an object with ``put(key, bytes)``
    and ``get(key) -> bytes | None``, e.g. Ray's internal KV), written through to it, so that a
    restarted gateway still knows the ids it handed out. An entry is the namespace, a NUL, then the
    token ids as int32.
    """

    def __init__(self, backing=None) -> None:
        self._entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self._backing = backing

    def add(self, chunk_id: str, tokens, namespace: str = "") -> None:
        tokens = tuple(tokens)  # its own copy: a message's repeated field would keep the whole request alive
        with self._lock:
            self._entries[chunk_id] = (namespace, tokens)
        if self._backing is not None:
            self._backing.put(chunk_id, namespace.encode() + b"\0" + np.asarray(tokens, dtype=np.int32).tobytes())

    def get(self, chunk_id: str) -> tuple[str, tuple[int, ...]] | None:
        """(namespace, token ids) of a registered id, None when it is not."""
        entry = self._entries.get(chunk_id)
        if entry is None and self._backing is not None:
            raw = self._backing.get(chunk_id)
            if raw:
                ns, _, ids = raw.partition(b"\0")
                entry = ns.decode(), tuple(np.frombuffer(ids, dtype=np.int32).tolist())
                with self._lock:
                    self._entries[chunk_id] = entry
        return entry

    def count(self, namespaces) -> int:
        """Registered ids in these namespaces."""
        names = set(namespaces)
        return sum(ns in names for ns, _ in list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)


class TextTokens:
    """Token ids of chunk texts seen lately, the least recently used dropped past ``max_tokens`` in all;
    keyed by (tenant, text): one tenant never finds another's texts here (its time would tell).

    RAG prompts send the same documents again and again, and tokenizing is a BPE's ~2 us a token on the
    gateway's event loop (bench/serving_host/serving_host.py): a 6 x 512-token prompt's chunks ~6 ms, more than the GPU
    pass that reuses their KV. Entries are TokenIds messages (4 bytes a token) keyed by the exact text;
    their ids are shared by every request that hits them and never written. 0 turns the cache off."""

    def __init__(self, max_tokens: int = 8 << 20) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[str, pb.TokenIds] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text) -> Sequence[int] | None:
        with self._lock:
            entry = self._entries.get(text)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(text)
            self.hits += 1
            return entry.ids

    def count(self, hits: int = 0, misses: int = 0) -> None:
        """Count lookups made outside ``get``: texts tokenized in a batch (misses), a text a request repeats (hits)."""
        with self._lock:
            self.hits += hits
            self.misses += misses

    def put(self, text, ids: Sequence[int], missed: bool = False) -> Sequence[int]:
        """Keep ids for text (unless they alone exceed the budget); returns the ids to use. ``missed``: count a
        miss (text tokenized without a ``get`` first)."""
        if missed:
            with self._lock:
                self.misses += 1
        if len(ids) > self.max_tokens:
            return ids
        entry = pb.TokenIds(ids=ids)
        with self._lock:
            old = self._entries.pop(text, None)
            self.tokens -= len(old.ids) if old is not None else 0
            self._entries[text] = entry
            self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                _, dropped = self._entries.popitem(last=False)
                self.tokens -= len(dropped.ids)
        return entry.ids

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, text) -> bool:
        return text in self._entries  # a peek: no hit or miss counted, no recency


class Fresh(dict):
    """Texts one request tokenized, {(scope, text): ids}, cached once it is accepted; ``single``: those tokenized
    one at a time, not in the request's batch (a repeat of one counts as a hit)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.single: set = set()


def served_without_suffix(chunks: tuple[Sequence[int], ...]) -> tuple[tuple[Sequence[int], ...], tuple[int, ...]]:
    """A request of chunks only, as it is served: the first output token follows the prompt's last token, which
    is computed for the request alone, so the last chunk's last token becomes the suffix and the rest of that
    chunk is cached as a chunk (another one than the whole: a chunk is its tokens; none when it had one token).
    loadgen's simulator and fake target count such a request the same way (loadgen/trace/model.py)."""
    *head, last = chunks
    rest = (last[:-1],) if len(last) > 1 else ()
    return (*head, *rest), (int(last[-1]),)


class InputResolver:
    def __init__(self, model_dir: str | Path, fingerprint: str, registry: ChunkRegistry,
                 text_cache: TextTokens | None = None) -> None:
        from tokenizers import Tokenizer

        from services.engine.kv.chunk_ids import checked_chunk_id

        path = Path(model_dir)
        self.cfg = ModelConfig.from_dir(path)
        tok_file = path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
        self.fingerprint = fingerprint
        self.registry = registry
        self.text_cache = text_cache if text_cache is not None else TextTokens()
        self._chunk_id = checked_chunk_id
        limit = self.cfg.max_position_embeddings
        self.limit = min(limit, self.cfg.sliding_window) if self.cfg.sliding_window else limit

    def chunk_id(self, tokens, namespace: str = "") -> str:
        """The chunk's id: ``tokens`` are ids this resolver checked (no torch here: numpy hashes them)."""
        return self._chunk_id(self.fingerprint, tokens, namespace)

    def _text(self, text: str, where: str, scope: str | None, fresh: dict) -> Sequence[int]:
        """Token ids of text. ``scope``: through the text cache under that key (a tenant's chunks, which repeat;
        None for a suffix); a text tokenized here goes into ``fresh`` (cached once the request is accepted)."""
        if self.tokenizer is None:
            raise InvalidRequest(f"{where} is text, but the model has no tokenizer.json: send token ids")
        if scope is not None:
            ids = fresh.get((scope, text))
            if ids is not None:            # tokenized for this request (cached once it is accepted)
                if (scope, text) in fresh.single:
                    self.text_cache.count(hits=1)     # a repeat of a text tokenized alone: a hit, as a cached one is
                return ids
            ids = self.text_cache.get((scope, text))
            if ids is not None:
                return ids
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if scope is not None:
            fresh[(scope, text)] = ids
            fresh.single.add((scope, text))
        return ids

    def _ids(self, ids, where: str) -> Sequence[int]:
        """``ids`` as given (a message's repeated field stays one: read-only, it reaches the prefill request
        without a copy), checked against the vocabulary by one numpy conversion."""
        arr = np.asarray(ids, dtype=np.int64)
        vocab = self.cfg.vocab_size
        if arr.size and (arr.min() < 0 or arr.max() >= vocab):
            bad = int(arr[(arr < 0) | (arr >= vocab)][0])
            raise InvalidRequest(f"token id {bad} in {where} is outside the vocabulary [0, {vocab})")
        return ids

    def _new_texts(self, chunks, scope: str) -> list[str]:
        """The distinct chunk texts among ``chunks`` (ChunkInput) that the text cache lacks for ``scope``, in
        order (none without a tokenizer: each text chunk is then refused by name)."""
        if self.tokenizer is None:
            return []
        texts = dict.fromkeys(c.text for c in chunks if c.WhichOneof("source") == "text")
        return [t for t in texts if (scope, t) not in self.text_cache]

    def tokenize_chunks(self, chunks, tenant: Tenant = DEFAULT) -> dict:
        """Token ids of the chunk texts among ``chunks`` that the tenant's text cache lacks, tokenized in one
        batch (the tokenizer spreads a batch over its threads): {(scope, text): ids}, not cached yet."""
        missing = self._new_texts(chunks, tenant.name)
        if len(missing) < 2:
            return {}
        encoded = self.tokenizer.encode_batch(missing, add_special_tokens=False)
        self.text_cache.count(misses=len(missing))
        return {(tenant.name, t): tuple(e.ids) for t, e in zip(missing, encoded)}

    def tokenizes(self, chunks, tenant: Tenant = DEFAULT) -> bool:
        """Whether some chunk text among ``chunks`` is not in the tenant's text cache: resolving them then takes
        milliseconds (the gateway does it off its event loop)."""
        return bool(self._new_texts(chunks, tenant.name))

    def keep(self, fresh: dict) -> None:
        """Cache the texts an accepted request tokenized (a refused one's are not kept)."""
        for key, ids in fresh.items():
            self.text_cache.put(key, ids)

    def check_text(self, chunks, suffix_text: str, tenant: Tenant) -> None:
        """The request's text, before any of it is tokenized: the tenant's byte quota, and what the model's limit
        can hold at all."""
        nbytes = len(suffix_text) + sum(len(c.text) for c in chunks if c.WhichOneof("source") == "text")
        if nbytes > tenant.quotas.max_text_bytes:
            raise QuotaExceeded(f"{nbytes} bytes of text is past tenant {tenant.name}'s quota max_text_bytes "
                                f"({tenant.quotas.max_text_bytes})")
        if nbytes > self.limit * MAX_BYTES_PER_TOKEN:
            raise InvalidRequest(f"{nbytes} bytes of text cannot fit the model's limit of {self.limit} tokens")

    def chunk(self, c: pb.ChunkInput, where: str, tenant: Tenant = DEFAULT, allow_id: bool = True,
              fresh: dict | None = None) -> tuple[Sequence[int], str]:
        """One chunk's token ids and namespace; ``fresh``: texts tokenized for this request (added to)."""
        fresh = fresh if isinstance(fresh, Fresh) else Fresh(fresh or {})
        kind = c.WhichOneof("source")
        if kind == "chunk_id" and allow_id:
            if c.namespace:
                raise InvalidRequest(f"{where} names a registered chunk id: its namespace is the one it was "
                                     "registered in, give none")
            entry = self.registry.get(c.chunk_id)
            # another tenant's id reads as one never registered: its existence is not this tenant's to learn
            if entry is None or not tenant.may_read(entry[0]):
                raise InvalidRequest(f"unknown chunk id {c.chunk_id!r} in {where}: register it with RegisterChunks first")
            namespace, tokens = entry
        else:
            namespace = tenant.chunk_namespace(c.namespace)      # PermissionError: not one it may use
            if kind == "text":
                tokens = self._text(c.text, where, tenant.name, fresh)
            elif kind == "tokens":
                tokens = self._ids(c.tokens.ids, where)
            elif kind == "chunk_id":
                raise InvalidRequest(f"{where} names a chunk id; RegisterChunks takes text or token ids")
            else:
                raise InvalidRequest(f"{where} is empty: give text, token ids or a registered chunk id")
        if not tokens:
            raise InvalidRequest(f"{where} holds no token")
        return tokens, namespace

    def sampling(self, s: pb.SamplingParams, default_max: int = DEFAULT_MAX_NEW_TOKENS) -> SamplingParams:
        """``default_max``: max_new_tokens when the request leaves it unset (0)."""
        temperature, top_p = float(s.temperature), float(s.top_p) if s.top_p else 1.0
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {s.temperature}")
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {s.top_p}")
        if s.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {s.top_k}")
        self._ids(s.stop_token_ids, "stop_token_ids")  # ids of this model's vocabulary
        try:
            return read_sampling(s, None, default_max)  # the workers add the model's end-of-sequence tokens
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def decode_policy(self, req: pb.GenerateRequest) -> pb.DecodePolicy | None:
        """The request's decode policy, its name and counts checked (what the decode worker's engine must also allow,
        a budget of at least one page, it checks itself); None for dense. A parameter of another policy than the
        one named is refused, not ignored."""
        if not req.HasField("decode"):
            return None
        d = req.decode
        name = d.name or "dense"
        if name not in DECODE_POLICIES:
            raise InvalidRequest(f"decode must be one of {', '.join(DECODE_POLICIES)}, got {d.name!r}")
        foreign = [f for f in DECODE_FIELDS if d.HasField(f) and f not in DECODE_PARAMS[name]]
        if foreign:
            raise InvalidRequest(f"decode {name!r} takes no {' or '.join(foreign)}")
        if name == "dense":
            return None
        if name == "retrieval" and d.HasField("retrieval_k") and d.retrieval_k > MAX_RETRIEVAL_K:
            raise InvalidRequest(f"retrieval_k must be in 0..{MAX_RETRIEVAL_K}, got {d.retrieval_k}")
        if d.HasField("budget_tokens") and d.budget_tokens < 1:
            raise InvalidRequest(f"budget_tokens must be at least 1, got {d.budget_tokens}")
        if d.HasField("dense_layers") and d.dense_layers > self.cfg.num_layers:
            raise InvalidRequest(f"dense_layers must be at most the model's {self.cfg.num_layers} layers, "
                                 f"got {d.dense_layers}")
        if name == "retro":
            if d.HasField("dense_layers") and d.dense_layers >= self.cfg.num_layers:
                raise InvalidRequest(f"dense_layers must leave a sparse layer of the model's {self.cfg.num_layers} "
                                     f"for retro, got {d.dense_layers}")
            if d.HasField("retro_window") and not 1 <= d.retro_window <= MAX_RETRO_WINDOW:
                raise InvalidRequest(f"retro_window must be in 1..{MAX_RETRO_WINDOW}, got {d.retro_window}")
        out = pb.DecodePolicy()
        out.CopyFrom(d)
        out.name = name
        return out

    def resolve(self, req: pb.GenerateRequest, tenant: Tenant = DEFAULT,
                fresh: dict | None = None) -> ResolvedRequest:
        """The request in token ids, its chunks in the tenant's namespaces, within its quotas. ``fresh``: chunk
        texts ``tokenize_chunks`` just tokenized; what this request tokenized is cached once it is accepted."""
        mode = req.mode or "tessera"
        if mode not in MODES:
            raise InvalidRequest(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        decode = self.decode_policy(req)
        ratio = None
        if req.HasField("recompute_ratio"):
            ratio = float(req.recompute_ratio)
            if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
                raise InvalidRequest(f"recompute_ratio must be in [0, 1], got {req.recompute_ratio}")
        which = req.WhichOneof("suffix")
        if not req.chunks and (which is None or (which == "suffix_text" and not req.suffix_text)
                               or (which == "suffix_tokens" and not req.suffix_tokens.ids)):
            raise InvalidRequest("empty request: no chunk and no suffix")
        q = tenant.quotas
        if len(req.chunks) > q.max_chunks_per_request:
            raise QuotaExceeded(f"{len(req.chunks)} chunks is past tenant {tenant.name}'s quota "
                                f"max_chunks_per_request ({q.max_chunks_per_request})")
        self.check_text(req.chunks, req.suffix_text if which == "suffix_text" else "", tenant)
        # unset, max_new_tokens is the default, or the tenant's quota when that is lower (not a refusal)
        sampling = self.sampling(req.sampling, min(DEFAULT_MAX_NEW_TOKENS, q.max_new_tokens or DEFAULT_MAX_NEW_TOKENS))
        if q.max_new_tokens is not None and sampling.max_new_tokens > q.max_new_tokens:
            raise QuotaExceeded(f"max_new_tokens {sampling.max_new_tokens} is past tenant {tenant.name}'s quota "
                                f"max_new_tokens ({q.max_new_tokens})")
        fresh = Fresh(fresh if fresh is not None else self.tokenize_chunks(req.chunks, tenant))
        parts = [self.chunk(c, f"chunk {i}", tenant, fresh=fresh) for i, c in enumerate(req.chunks)]
        chunks = tuple(p[0] for p in parts)
        namespaces = tuple(p[1] for p in parts)
        if which == "suffix_text":
            suffix = self._text(req.suffix_text, "the suffix", None, fresh)
        elif which == "suffix_tokens":
            suffix = self._ids(req.suffix_tokens.ids, "the suffix")
        else:
            suffix = ()
        if not suffix:
            chunks, suffix = served_without_suffix(chunks)
            namespaces = namespaces[:len(chunks)]
        chunk_tokens = sum(map(len, chunks))
        total = chunk_tokens + len(suffix)
        if q.max_chunk_tokens is not None and chunk_tokens > q.max_chunk_tokens:
            raise QuotaExceeded(f"{chunk_tokens} chunk tokens is past tenant {tenant.name}'s quota max_chunk_tokens "
                                f"({q.max_chunk_tokens})")
        if q.max_prompt_tokens is not None and total > q.max_prompt_tokens:
            raise QuotaExceeded(f"a prompt of {total} tokens is past tenant {tenant.name}'s quota max_prompt_tokens "
                                f"({q.max_prompt_tokens})")
        if total + sampling.max_new_tokens > self.limit:
            raise InvalidRequest(f"prompt of {total} tokens plus max_new_tokens {sampling.max_new_tokens} is past "
                                 f"the model's limit of {self.limit} tokens")
        self.keep(fresh)
        ids = tuple(self.chunk_id(c, ns) for c, ns in zip(chunks, namespaces))
        return ResolvedRequest(chunks, ids, suffix, mode, ratio, sampling,
                               namespaces if any(namespaces) else (), decode)
