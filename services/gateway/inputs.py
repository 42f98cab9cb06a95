"""Turning a GenerateRequest into token ids, and refusing bad input with a reason.

Chunks come as text (tokenized with the model's tokenizer.json), token ids, or ids returned by
RegisterChunks. Every refusal is an ``InvalidRequest`` (a ValueError) whose message is sent to the
client as INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.cluster.sampling import DEFAULT_MAX_NEW_TOKENS
from services.engine.config import ModelConfig
from services.rpc import tessera_pb2 as pb

MODES = ("full", "prefix", "position_aware", "blend_copy", "tessera")


class InvalidRequest(ValueError):
    """Input the cluster refuses; the message says why."""


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool

    def to_proto(self) -> pb.SamplingParams:
        p = pb.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos)
        if self.seed is not None:
            p.seed = self.seed
        return p


@dataclass(frozen=True, slots=True)
class ResolvedRequest:
    """A request in token ids. chunks[i] has chunk_ids[i] (content hash with the model fingerprint)."""

    chunks: tuple[Sequence[int], ...]  # tuples, or the request message's repeated fields (read-only)
    chunk_ids: tuple[str, ...]
    suffix: Sequence[int]
    mode: str
    recompute_ratio: float | None
    sampling: Sampling

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.chunks)) + len(self.suffix)


class ChunkRegistry:
    """Chunk ids handed out by RegisterChunks -> their token ids.

    Kept in the gateway's memory and, when ``backing`` is given (an object with ``put(key, bytes)``
    and ``get(key) -> bytes | None``, e.g. Ray's internal KV), written through to it, so that a
    restarted gateway still knows the ids it handed out.
    """

    def __init__(self, backing=None) -> None:
        self._tokens: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self._backing = backing

    def add(self, chunk_id: str, tokens) -> None:
        tokens = tuple(tokens)  # its own copy: a message's repeated field would keep the whole request alive
        with self._lock:
            self._tokens[chunk_id] = tokens
        if self._backing is not None:
            self._backing.put(chunk_id, np.asarray(tokens, dtype=np.int32).tobytes())

    def get(self, chunk_id: str) -> tuple[int, ...] | None:
        tokens = self._tokens.get(chunk_id)
        if tokens is None and self._backing is not None:
            raw = self._backing.get(chunk_id)
            if raw:
                tokens = tuple(np.frombuffer(raw, dtype=np.int32).tolist())
                with self._lock:
                    self._tokens[chunk_id] = tokens
        return tokens

    def __len__(self) -> int:
        return len(self._tokens)


class TextTokens:
    """Token ids of chunk texts seen lately, the least recently used dropped past ``max_tokens`` in all.

    RAG prompts send the same documents again and again, and tokenizing is a BPE's ~2 us a token on the
    gateway's event loop (bench/serving_host.py): a 6 x 512-token prompt's chunks ~6 ms, more than the GPU
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

    def get(self, text: str) -> Sequence[int] | None:
        with self._lock:
            entry = self._entries.get(text)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(text)
            self.hits += 1
            return entry.ids

    def put(self, text: str, ids: Sequence[int], missed: bool = False) -> Sequence[int]:
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

    def __contains__(self, text: str) -> bool:
        return text in self._entries  # a peek: no hit or miss counted, no recency


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

        from services.engine.chunk_cache import chunk_id

        path = Path(model_dir)
        self.cfg = ModelConfig.from_dir(path)
        tok_file = path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
        self.fingerprint = fingerprint
        self.registry = registry
        self.text_cache = text_cache if text_cache is not None else TextTokens()
        self._chunk_id = chunk_id
        limit = self.cfg.max_position_embeddings
        self.limit = min(limit, self.cfg.sliding_window) if self.cfg.sliding_window else limit

    def chunk_id(self, tokens) -> str:
        return self._chunk_id(self.fingerprint, tokens)

    def _text(self, text: str, where: str, cache: bool = False) -> Sequence[int]:
        """Token ids of text; ``cache``: through the text cache (chunks, which repeat; not a suffix)."""
        if self.tokenizer is None:
            raise InvalidRequest(f"{where} is text, but the model has no tokenizer.json: send token ids")
        if cache:
            ids = self.text_cache.get(text)
            if ids is not None:
                return ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.text_cache.put(text, ids) if cache else tuple(ids)

    def _ids(self, ids, where: str) -> Sequence[int]:
        """``ids`` as given (a message's repeated field stays one: read-only, it reaches the prefill request
        without a copy), checked against the vocabulary by one numpy conversion."""
        arr = np.asarray(ids, dtype=np.int64)
        vocab = self.cfg.vocab_size
        if arr.size and (arr.min() < 0 or arr.max() >= vocab):
            bad = int(arr[(arr < 0) | (arr >= vocab)][0])
            raise InvalidRequest(f"token id {bad} in {where} is outside the vocabulary [0, {vocab})")
        return ids

    def _new_texts(self, chunks) -> list[str]:
        """The distinct chunk texts among ``chunks`` (ChunkInput) that the text cache lacks, in order (none
        without a tokenizer: each text chunk is then refused by name)."""
        if self.tokenizer is None:
            return []
        texts = dict.fromkeys(c.text for c in chunks if c.WhichOneof("source") == "text")
        return [t for t in texts if t not in self.text_cache]

    def tokenize_chunks(self, chunks) -> dict[str, Sequence[int]]:
        """Token ids of the chunk texts among ``chunks`` that the text cache lacks, tokenized in one batch (the
        tokenizer spreads a batch over its threads) and kept: {text: ids}."""
        missing = self._new_texts(chunks)
        if len(missing) < 2:
            return {}
        encoded = self.tokenizer.encode_batch(missing, add_special_tokens=False)
        return {t: self.text_cache.put(t, e.ids, missed=True) for t, e in zip(missing, encoded)}

    def tokenizes(self, chunks) -> bool:
        """Whether some chunk text among ``chunks`` is not in the text cache: resolving them then takes
        milliseconds (the gateway does it off its event loop)."""
        return bool(self._new_texts(chunks))

    def chunk(self, c: pb.ChunkInput, where: str, allow_id: bool = True,
              fresh: dict[str, Sequence[int]] | None = None) -> Sequence[int]:
        """One chunk's token ids; ``fresh``: texts ``tokenize_chunks`` just tokenized."""
        kind = c.WhichOneof("source")
        if kind == "text":
            tokens = fresh.get(c.text) if fresh else None
            if tokens is None:
                tokens = self._text(c.text, where, cache=True)
        elif kind == "tokens":
            tokens = self._ids(c.tokens.ids, where)
        elif kind == "chunk_id" and allow_id:
            tokens = self.registry.get(c.chunk_id)
            if tokens is None:
                raise InvalidRequest(f"unknown chunk id {c.chunk_id!r} in {where}: register it with RegisterChunks first")
        elif kind == "chunk_id":
            raise InvalidRequest(f"{where} names a chunk id; RegisterChunks takes text or token ids")
        else:
            raise InvalidRequest(f"{where} is empty: give text, token ids or a registered chunk id")
        if not tokens:
            raise InvalidRequest(f"{where} holds no token")
        return tokens

    def sampling(self, s: pb.SamplingParams) -> Sampling:
        temperature, top_p = float(s.temperature), float(s.top_p) if s.top_p else 1.0
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {s.temperature}")
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {s.top_p}")
        if s.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {s.top_k}")
        n = s.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        stops = tuple(self._ids(s.stop_token_ids, "stop_token_ids"))
        return Sampling(temperature, top_p, s.top_k, s.seed if s.HasField("seed") else None, n, stops, s.ignore_eos)

    def resolve(self, req: pb.GenerateRequest) -> ResolvedRequest:
        mode = req.mode or "tessera"
        if mode not in MODES:
            raise InvalidRequest(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        ratio = None
        if req.HasField("recompute_ratio"):
            ratio = float(req.recompute_ratio)
            if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
                raise InvalidRequest(f"recompute_ratio must be in [0, 1], got {req.recompute_ratio}")
        which = req.WhichOneof("suffix")
        if not req.chunks and (which is None or (which == "suffix_text" and not req.suffix_text)
                               or (which == "suffix_tokens" and not req.suffix_tokens.ids)):
            raise InvalidRequest("empty request: no chunk and no suffix")
        fresh = self.tokenize_chunks(req.chunks)
        chunks = tuple(self.chunk(c, f"chunk {i}", fresh=fresh) for i, c in enumerate(req.chunks))
        if which == "suffix_text":
            suffix = self._text(req.suffix_text, "the suffix")
        elif which == "suffix_tokens":
            suffix = self._ids(req.suffix_tokens.ids, "the suffix")
        else:
            suffix = ()
        if not suffix:
            chunks, suffix = served_without_suffix(chunks)
        sampling = self.sampling(req.sampling)
        total = sum(map(len, chunks)) + len(suffix)
        if total + sampling.max_new_tokens > self.limit:
            raise InvalidRequest(f"prompt of {total} tokens plus max_new_tokens {sampling.max_new_tokens} is past "
                                 f"the model's limit of {self.limit} tokens")
        return ResolvedRequest(chunks, tuple(self.chunk_id(c) for c in chunks), suffix, mode, ratio, sampling)
