"""Engine: one model, one paged KV pool, one chunk cache; prefill in every reuse mode, and decode.

Public API (services, tests and outside checks call exactly this):
    eng = Engine.load(dir, device="cpu", dtype=torch.float32, attention_backend=None)
    r = eng.prefill(chunks=[[ids], ...], suffix=[ids], mode="tessera", recompute_ratio=0.15)
    eng.generate(chunks=..., suffix=..., max_new_tokens=32, temperature=0.0) -> list[int]
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from pathlib import Path

import torch

from kernels.options import using
from kernels.paged_attention import MAX_BLOCK_ID, MAX_BLOCK_SIZE, MAX_OFFSET, check_encodable
from services.engine.decode import (HANDOFF_QUERIES, DecodePolicy, QueryTap, RetrievalDecode, clear_window,
                                    policy_for)
from services.engine.kv.block_pool import BlockPool, block_bytes
from services.engine.kv.block_table import BlockTable
from services.engine.kv.chunk_cache import ChunkCache, chunk_id
from services.engine.kv.chunk_ids import chunk_ids_of, scoped_id
from services.engine.kv.loader import numbered
from services.engine.kv.request_ids import CheckedRequest, KnownChunks, request_ids
from services.engine.model.config import ModelConfig
from services.engine.model.weights import (
    ModelWeights,
    fingerprint,
    load_weights,
    state_fingerprint,
    weights_from_tensors,
)
from services.engine.options import EngineOptions
from services.engine.passes.blend import BlendConfig
from services.engine.passes.forward import Forward
from services.engine.request import MODES, PrefillResult, PrefillStats, Sequence
from services.engine.sampling import SamplingParams, sample
from services.handoff.export import export_sequence, stage_export
from services.handoff.imports import ImportLayout, import_sequence
from services.handoff.wire import Handoff

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def launches(method):
    """A method that launches kernels does so under its engine's kernel options (kernels/options.py)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with using(self.options.kernels):
            return method(self, *args, **kwargs)
    return run


def _default_backend(device: torch.device) -> str:
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return "torch"
    return "triton"


class Engine:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, fingerprint: str, device: torch.device,
                 dtype: torch.dtype, attention_backend: str, block_size: int, kv_cache_bytes: int,
                 chunk_cache_bytes: int, blend: BlendConfig, model_dir: Path | None = None,
                 static_tails: bool | None = None, options: EngineOptions | None = None):
        if attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {attention_backend!r}")
        if attention_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the Triton attention backend runs on CUDA, or on {device.type} only under Triton's "
                             "interpreter (TRITON_INTERPRET=1, set before triton is imported)")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {block_size}")
        options = EngineOptions() if options is None else options
        if not isinstance(options, EngineOptions):
            raise ValueError(f"options must be an EngineOptions, got {type(options).__name__}")
        self.options = options
        self.cfg = cfg
        self.model_dir = model_dir
        self.device = device
        self.dtype = dtype
        self.backend = attention_backend
        self.block_size = block_size
        self.blend = blend
        self.fingerprint = fingerprint
        self.known_chunks = KnownChunks()  # chunk token lists already checked and hashed (request_ids.py)
        # static tails (CUDA graphs) by default on CUDA; on the CPU they run eagerly and only tests ask
        self.forward = Forward(cfg, weights, attention_backend,
                               static_tails=device.type == "cuda" if static_tails is None else static_tails,
                               options=options)
        # every block costs its K and V and its page bounds (sparse decode's metadata, kv/block_pool.py)
        kv_bytes, bounds_bytes = block_bytes(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                             torch.finfo(dtype).bits // 8)
        block_bytes_all = kv_bytes + bounds_bytes
        num_blocks = max(kv_cache_bytes // block_bytes_all, 1)
        if num_blocks - 1 > MAX_BLOCK_ID:
            raise ValueError(f"kv_cache_bytes {kv_cache_bytes} makes {num_blocks} blocks of {block_bytes_all} bytes; "
                             f"the kernels' metadata addresses {MAX_BLOCK_ID + 1} (give at most "
                             f"{(MAX_BLOCK_ID + 1) * block_bytes_all} bytes, or a larger block_size)")
        self.pool = BlockPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, device, dtype)
        self.cache = ChunkCache(self.pool, min(chunk_cache_bytes, num_blocks * kv_bytes))
        self.forward.bind(self.pool, self.cache, block_size, self.fingerprint)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
             attention_backend: str | None = None, block_size: int = 16, kv_cache_bytes: int | None = None,
             chunk_cache_bytes: int | None = None, check_layer: int = 1, deviation: str = "kv",
             static_tails: bool | None = None, options: EngineOptions | None = None) -> "Engine":
        """Load a Hugging Face Llama-family directory (config.json, *.safetensors, tokenizer.json).

        kv_cache_bytes: the paged KV pool (default 256 MiB on CPU, 60% of free memory on CUDA);
        chunk_cache_bytes: the part of it cached chunks may hold (default 80%); options: EngineOptions
        (default: every measured winner on).
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist")
        dev = torch.device(device)
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        cfg = ModelConfig.from_dir(path)
        if kv_cache_bytes is None:
            if dev.type == "cuda":
                free, _ = torch.cuda.mem_get_info(dev)
                weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
                kv_cache_bytes = int(0.6 * max(free - weight_bytes, 1 << 28))
            else:
                kv_cache_bytes = 256 << 20
        if chunk_cache_bytes is None:
            chunk_cache_bytes = int(0.8 * kv_cache_bytes)
        return cls(cfg, load_weights(path, cfg, dev, dtype), fingerprint(path), dev, dtype,
                   attention_backend or _default_backend(dev), block_size, kv_cache_bytes, chunk_cache_bytes,
                   BlendConfig(check_layer, deviation), model_dir=path, static_tails=static_tails, options=options)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, tensors: dict, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, attention_backend: str | None = None,
                        block_size: int = 16, kv_cache_bytes: int = 256 << 20, chunk_cache_bytes: int | None = None,
                        check_layer: int = 1, deviation: str = "kv", static_tails: bool | None = None,
                        options: EngineOptions | None = None) -> "Engine":
        """An engine over in-memory Hugging Face-named weights (shared, not copied, when already on
        ``device`` in ``dtype``, except q|k|v and gate|up, which are concatenated into one new tensor
        each: a caller that keeps its own tensors holds those twice): benchmarks and the quality
        testbed build models this way."""
        dev = torch.device(device)
        weights = weights_from_tensors(tensors, cfg, dev, dtype)
        return cls(cfg, weights, state_fingerprint(cfg, tensors), dev, dtype,
                   attention_backend or _default_backend(dev), block_size, kv_cache_bytes,
                   chunk_cache_bytes or int(0.8 * kv_cache_bytes), BlendConfig(check_layer, deviation),
                   static_tails=static_tails, options=options)

    # ------------------------------------------------------------------ validation
    def check(self, chunks, suffix, mode: str = "tessera", extra_tokens: int = 0,
              with_chunk_ids: bool = True, namespaces=None) -> CheckedRequest:
        """A request's token ids read once: a ``CheckedRequest`` that the prefill calls take in place of
        (chunks, suffix), with every chunk's id (``chunk_id``, in every mode). A serving worker that needs the
        ids before the pass (to look its chunks up) converts and hashes the request once this way
        (``with_chunk_ids=False``: no ids, for ``full`` and ``prefix``, which never look them up). A clear
        ValueError for bad input: unknown mode, empty parts, ids outside the vocabulary or not integers,
        past the model's length limit (``extra_tokens``: the tokens to be generated after it), a chunk
        offset the kernels' metadata cannot encode (tessera). ``namespaces``: each chunk's namespace (its id is
        then ``scoped_id(namespace, content id)``: tenants' chunks never share an id); None: all plain."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        chunks = list(chunks if chunks is not None else [])
        namespaces = tuple(namespaces) if namespaces is not None and any(namespaces) else ()
        if namespaces and len(namespaces) != len(chunks):
            raise ValueError(f"{len(namespaces)} namespaces for {len(chunks)} chunks")
        known = self.known_chunks
        keys, cids = known.lookup(chunks)  # chunks seen before: checked and hashed already
        new = [i for i, cid in enumerate(cids) if cid is None]
        parts, suffix, flat = request_ids([chunks[i] for i in new], [] if suffix is None else suffix,
                                          names=[f"chunk {i}" for i in new])
        for i, ids in zip(new, parts):
            chunks[i] = ids
        for i, cid in enumerate(cids):
            if cid is not None and type(chunks[i]) is not list:
                chunks[i] = list(keys[i].ids)
        if not suffix:
            raise ValueError("empty request: the suffix must hold at least one token" if not any(chunks)
                             else "the suffix must hold at least one token (logits are taken after it)")
        for i, c in enumerate(chunks):
            if not c:
                raise ValueError(f"chunk {i} is empty")
        vocab = self.cfg.vocab_size
        if flat is None or flat.min() < 0 or flat.max() >= vocab:  # the offender is looked up only then
            for where, ids in [*((f"chunk {i}", c) for i, c in enumerate(chunks)), ("suffix", suffix)]:
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ValueError(f"token id {bad} in {where} is outside the vocabulary [0, {vocab})")
        total = sum(map(len, chunks)) + len(suffix) + extra_tokens
        limit = self.cfg.max_position_embeddings
        if self.cfg.sliding_window:
            limit = min(limit, self.cfg.sliding_window)
        if total > limit:
            raise ValueError(f"request of {total} tokens is past the model's limit of {limit}")
        # a chunk's start is its offset in the kernels' metadata (tessera): checked on the host, and by
        # check_encodable (for its message) only when it does not fit
        last_start = total - len(suffix) - extra_tokens - (len(chunks[-1]) if chunks else 0)
        if mode == "tessera" and last_start > MAX_OFFSET:
            starts = torch.tensor([sum(map(len, chunks[:i])) for i in range(len(chunks))], dtype=torch.int64)
            check_encodable(self.block_size, torch.zeros(0, dtype=torch.int32), starts)
        ids = None
        if with_chunk_ids:
            for i, cid in zip(new, chunk_ids_of(self.fingerprint, flat, [len(chunks[i]) for i in new])):
                cids[i] = cid
                known.put(keys[i], cid)         # the memo holds content ids; namespaces apply after it
            ids = [scoped_id(ns, cid) for ns, cid in zip(namespaces, cids)] if namespaces else cids
        return CheckedRequest(chunks, suffix, ids, mode, extra_tokens, self.fingerprint, namespaces)

    def _validate(self, chunks, suffix, mode: str, recompute_ratio: float, extra_tokens: int = 0):
        """-> (chunks, suffix) as lists of ints, the chunks' ids (None in ``full`` and ``prefix``, which
        never look them up) and the request's scope (its chunks' namespaces, which prefix caching hashes
        with its prefixes); ``chunks`` may be a CheckedRequest (``check``) made for this mode and
        extra_tokens, suffix then None. A clear ValueError for bad input."""
        if not 0.0 <= float(recompute_ratio) <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
        if float(recompute_ratio) > 0 and mode in ("tessera", "blend_copy", "position_aware") \
                and self.blend.check_layer >= self.cfg.num_layers:
            raise ValueError(f"recompute needs a check layer below the model's {self.cfg.num_layers} layers "
                             f"(check_layer is {self.blend.check_layer}); use recompute_ratio=0 or a lower check_layer")
        if isinstance(chunks, CheckedRequest):
            req = chunks
            if suffix is not None:
                raise ValueError("a CheckedRequest carries its suffix: pass suffix=None")
            if (req.fingerprint, req.mode, req.extra_tokens) != (self.fingerprint, mode, extra_tokens):
                raise ValueError(f"request checked for mode {req.mode!r}, {req.extra_tokens} extra tokens on model "
                                 f"{req.fingerprint[:12]}, used for mode {mode!r}, {extra_tokens} extra tokens on "
                                 f"{self.fingerprint[:12]}: check it again")
        else:
            req = self.check(chunks, suffix, mode, extra_tokens, with_chunk_ids=mode not in ("full", "prefix"))
        if req.chunk_ids is None and mode not in ("full", "prefix"):
            raise ValueError(f"mode {mode!r} looks chunks up by id: check the request with_chunk_ids=True")
        # chunk ids name cached chunks in the reuse modes only (prefix hashes whole prefixes itself)
        return (req.chunks, req.suffix, None if mode in ("full", "prefix") else req.chunk_ids,
                "|".join(req.namespaces))

    # ------------------------------------------------------------------ public API
    def chunk_id(self, tokens, namespace: str = "") -> str:
        return scoped_id(namespace, chunk_id(self.fingerprint, tokens))

    @torch.no_grad()
    @launches
    def prefill(self, chunks, suffix, mode: str = "tessera", recompute_ratio: float = 0.15) -> PrefillResult:
        """Next-token logits after chunks + suffix; the request's private KV is freed afterwards."""
        chunks, suffix, ids, scope = self._validate(chunks, suffix, mode, recompute_ratio)
        logits, seq, stats = self._prefill(chunks, suffix, mode, float(recompute_ratio), ids=ids, keep_tables=False,
                                           scope=scope)
        self.release(seq)
        return PrefillResult(logits, stats)

    @torch.no_grad()
    @launches
    def generate(self, chunks, suffix, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, mode: str = "tessera", recompute_ratio: float = 0.15,
                 stop_token_ids: list[int] | None = None, decode: str = "dense", budget_tokens: int | None = None,
                 dense_layers: int | None = None, retro_window: int | None = None, retrieval_k: int | None = None,
                 sink_tokens: int | None = None, window_tokens: int | None = None,
                 stats: dict | None = None) -> list[int]:
        """``decode``: the decode policy of its steps (services/engine/decode: "dense"; "quest" with
        ``budget_tokens`` and ``dense_layers``; "retro" with those and ``retro_window``; "retrieval" with
        ``retrieval_k``, ``sink_tokens`` and ``window_tokens``). ``stats``: a dict that receives what the decode
        steps read (DecodeStats.as_dict)."""
        policy = self.decode_policy(decode, budget_tokens=budget_tokens, dense_layers=dense_layers,
                                    retro_window=retro_window, retrieval_k=retrieval_k, sink_tokens=sink_tokens,
                                    window_tokens=window_tokens)
        params = SamplingParams(temperature, top_p, top_k, seed, max_new_tokens)
        stops = set(self._stop_ids() if stop_token_ids is None else stop_token_ids)
        logits, seq = self.prefill_sequence(chunks, suffix, mode, recompute_ratio, policy, max_new_tokens)
        out: list[int] = []
        try:
            gen = params.generator(self.device)
            while True:
                tok = sample(logits, params, gen)
                out.append(tok)
                if tok in stops or len(out) >= max_new_tokens:
                    return out
                logits = self.decode_step([seq], [tok])[0]
        finally:
            if stats is not None:
                stats.update(seq.decode_stats.as_dict())
            self.release(seq)

    @torch.no_grad()
    @launches
    def prefill_sequence(self, chunks, suffix, mode: str = "tessera", recompute_ratio: float = 0.15,
                         decode: str | DecodePolicy = "dense", extra_tokens: int = 0,
                         **decode_params) -> tuple[torch.Tensor, Sequence]:
        """Prefill a request and keep it for decoding here: (next-token logits [vocab], the sequence, started under
        the decode policy ``decode`` names with ``decode_params``, or is). ``decode_step`` continues it; the caller
        releases it (``release``). ``extra_tokens``: the tokens it may generate (checked against the model's
        positions now)."""
        policy = decode if isinstance(decode, DecodePolicy) else self.decode_policy(decode, **decode_params)
        chunks, suffix, ids, scope = self._validate(chunks, suffix, mode, recompute_ratio, extra_tokens=extra_tokens)
        if self._layered(policy, mode, chunks, suffix):
            logits, seq = self._layered_prefill(chunks, suffix, policy)
        else:
            # a retrieval index is built from the pass's queries
            logits, seq, _ = self._tapped_prefill(QueryTap() if policy.taps_queries else None, chunks, suffix, mode,
                                                  float(recompute_ratio), ids=ids, scope=scope)
        try:
            self.start_decode(seq, policy)
        except BaseException:
            self.release(seq)
            raise
        return logits, seq

    @torch.no_grad()
    @launches
    def prefill_handoff(self, chunks, suffix, mode: str = "tessera", recompute_ratio: float = 0.15,
                        fetch=None, on_computed=None, extra_tokens: int = 0, on_logits=None,
                        kv_on_device: bool = False, tap_queries: bool = False):
        """Prefill for a disaggregated decode: returns (PrefillResult, Handoff) and keeps nothing private.

        fetch(chunk_id) -> iterator of (layer, k, v) or None: the KV store, streamed layer by layer while
        earlier layers compute. on_computed(chunk_id, [(k, v), ...]): chunks computed here, to be stored.
        on_logits(logits [vocab]): called as soon as the pass is done, before the hand-off is exported
        (a serving worker samples and sends the first token from there). ``kv_on_device``: the hand-off's
        private K/V stay on this engine's device (see ``export_sequence``). ``tap_queries``: the pass's queries
        travel with the hand-off (a sample per layer: ``HANDOFF_QUERIES``), for a decode policy that builds on them
        (retrieval).
        """
        return self.begin_prefill_handoff(chunks, suffix, mode, recompute_ratio, fetch, on_computed,
                                          extra_tokens, kv_on_device, tap_queries).finish(on_logits)

    @launches
    def begin_prefill_handoff(self, chunks, suffix, mode: str = "tessera", recompute_ratio: float = 0.15,
                              fetch=None, on_computed=None, extra_tokens: int = 0,
                              kv_on_device: bool = False, tap_queries: bool = False) -> "PendingHandoff":
        """``prefill_handoff`` in two halves: this one issues the pass (and the export's first copies)
        and returns without waiting for the device; ``finish(on_logits)`` on the result waits, calls
        ``on_logits``, exports and releases. A serving worker issues the next request's pass between the
        two, so that its host work overlaps this pass on the device. Nothing else may use the engine
        until ``finish`` is called, but another ``begin_prefill_handoff``."""
        chunks, suffix, ids, scope = self._validate(chunks, suffix, mode, recompute_ratio, extra_tokens=extra_tokens)
        logits, seq, stats = self._tapped_prefill(QueryTap(HANDOFF_QUERIES) if tap_queries else None, chunks, suffix,
                                                  mode, float(recompute_ratio), fetch, on_computed, ids, scope=scope)
        try:
            # what the export reads on the host starts on its way first: reading the first token (a sync)
            # then delivers it, and the export after the first token waits for nothing on the device
            staged = stage_export(self.forward, seq, logits)
        except BaseException:
            self.release(seq)
            raise
        return PendingHandoff(self, logits, seq, stats, staged, kv_on_device)

    @torch.no_grad()
    @launches
    def import_handoff(self, handoff: Handoff, fetch=None, decode: str | DecodePolicy = "dense",
                       layout: ImportLayout | None = None,
                       **decode_params) -> Sequence:
        """Rebuild a prefilled request here: shared chunks from this cache, ``fetch``, or recompute; its decode
        steps attend by the policy ``decode`` names with ``decode_params`` (services/engine/decode), or by the
        policy ``decode`` is (one ``decode_policy`` made). ``layout``: ``services.handoff.imports.import_layout(
        handoff)`` made ahead on another thread (None: made here)."""
        policy = decode if isinstance(decode, DecodePolicy) else self.decode_policy(decode, **decode_params)
        if handoff.model_fingerprint != self.fingerprint:
            raise ValueError(f"hand-off was made by model {handoff.model_fingerprint}, this engine runs {self.fingerprint}")
        seq = import_sequence(self.forward, handoff, fetch, layout)
        try:
            self.start_decode(seq, policy)
        except BaseException:
            self.release(seq)
            raise
        return seq

    @launches
    def start_decode(self, seq: Sequence, policy: DecodePolicy) -> None:
        """``seq``'s decode steps attend by ``policy`` from now on: what the policy reads is made ready (a sparse
        policy's page bounds) and its stats start."""
        clear_window(self.forward, seq)          # a window of an earlier policy's steps is not this one's
        seq.decode = policy
        seq.decode_stats.table_pages = sum(t.num_entries for t in seq.layer_tables)
        policy.prepare(self.forward, seq)

    def decode_policy(self, decode: str = "dense", **params) -> DecodePolicy:
        """The decode policy ``decode`` names with its parameters (None: the policy's default), checked against this
        engine (a quest or retro budget of at least one page, no more dense layers than the model has, a retro
        window in 1..16); ValueError naming the field otherwise."""
        policy = policy_for(decode, **{k: v for k, v in params.items() if v is not None})
        policy.check(self.block_size, self.cfg.num_layers)
        return policy

    @launches
    def insert_chunk(self, chunk_id: str, tokens, layers) -> None:
        """Make a chunk resident from its KV [(k, v) per layer, keys at local positions]."""
        if chunk_id in self.cache:
            return
        self.cache.release(self.forward.insert_chunk(chunk_id, tokens, numbered(layers)))

    @launches
    def export_chunk(self, chunk_id: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A resident chunk's KV per layer (copies); KeyError if it is not resident."""
        entry = self.cache.acquire(chunk_id)
        if entry is None:
            raise KeyError(f"chunk {chunk_id} is not resident")
        try:
            return self.forward.export_chunk(entry)
        finally:
            self.cache.release(entry)

    def export_chunk_index(self, chunk_id: str) -> bytes | None:
        """The bytes of a chunk's retrieval indexes (``ChunkIndex.to_bytes``: checksummed), None if none is built."""
        held = self.forward.chunk_indexes
        index = None if held is None else held.get(chunk_id)
        return None if index is None else index.to_bytes()

    def holds_chunk_index(self, chunk_id: str) -> bool:
        """Whether this engine keeps the chunk's retrieval indexes (a hint from any thread: it may change)."""
        held = self.forward.chunk_indexes
        return held is not None and chunk_id in held

    def adopt_chunk_index(self, chunk_id: str, blob: bytes, length: int) -> bool:
        """Keep a chunk's retrieval indexes fetched from the store ahead of its sequence (on the engine thread); False
        when the bytes are not an intact index of this chunk and model: refused as a stored copy is
        (``retrieval.adopt_chunk_index``), and built again when a sequence needs it."""
        from services.engine.decode.retrieval import adopt_chunk_index

        return adopt_chunk_index(self.forward, chunk_id, length, blob) is not None

    def insert_chunk_index(self, chunk_id: str, blob: bytes) -> None:
        """Keep a chunk's retrieval indexes from their bytes (the store's copy), for its next retrieval decode.
        ValueError (IndexFormatError) for bytes that are not an intact chunk index of this model's shape: nothing
        is kept then, and the chunk's indexes are built again when a sequence needs them."""
        from services.index.chunks import ChunkIndex, ChunkIndexCache

        index = ChunkIndex.from_bytes(blob)
        cfg = self.cfg
        if (index.num_layers, index.num_heads) != (cfg.num_layers, cfg.num_kv_heads):
            raise ValueError(f"chunk index of {index.num_layers} layers x {index.num_heads} KV heads, the model has "
                             f"{cfg.num_layers} x {cfg.num_kv_heads}")
        fwd = self.forward
        if fwd.chunk_indexes is None:
            fwd.chunk_indexes = ChunkIndexCache(self.options.chunk_index_bytes)
        fwd.chunk_indexes.put(chunk_id, index)

    def _layered(self, policy: DecodePolicy, mode: str, chunks, suffix) -> bool:
        """Whether this request is prefilled layer by layer (passes/layered.py; ``EngineOptions.layered_prefill``): a
        retrieval decode that retrieves keys, in mode ``full``, "always" or when its context needs more blocks than the
        pool can give it now ("auto"). Such a context in another mode is refused: ValueError saying so."""
        choice = self.options.layered_prefill
        if not (isinstance(policy, RetrievalDecode) and policy.retrieval_k) or choice == "never":
            return False
        tokens = sum(map(len, chunks)) + len(suffix)
        need, available = -(-tokens // self.block_size), self.cache.available_blocks()
        if mode != "full":
            if choice == "auto" and need > available:
                raise ValueError(f"a context of {tokens} tokens needs {need} KV blocks, the pool can give {available}: "
                                 "decode='retrieval' serves one larger than the pool in mode 'full' (every token "
                                 f"computed, layer by layer), not in mode {mode!r}")
            return False
        return choice == "always" or need > available

    def _layered_prefill(self, chunks, suffix, policy) -> tuple[torch.Tensor, Sequence]:
        from services.engine.passes.layered import layered_prefill

        stats = PrefillStats(mode="full", recompute_ratio=0.0, check_layer=self.blend.check_layer, chunks=len(chunks),
                             chunk_tokens=sum(map(len, chunks)), suffix_tokens=len(suffix))
        t0 = time.perf_counter()
        logits, seq = layered_prefill(self.forward, [t for c in chunks for t in c] + list(suffix), policy,
                                      QueryTap(), stats)
        stats.total_seconds = time.perf_counter() - t0
        return logits, seq

    def _tapped_prefill(self, tap: QueryTap | None, *args, **kwargs):
        """``_prefill(*args, **kwargs)`` with ``tap`` (None: none) taking the pass's queries; the sequence keeps
        it as its ``prefill_queries``."""
        self.forward.query_tap = tap
        try:
            logits, seq, stats = self._prefill(*args, **kwargs)
        finally:
            self.forward.query_tap = None
        seq.prefill_queries = tap
        return logits, seq, stats

    def _stop_ids(self) -> list[int]:
        eos = self.cfg.eos_token_id
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [eos]

    @launches  # (the warm-up calls it directly: its captures must see the engine's options too)
    def _prefill(self, chunks, suffix, mode, ratio, fetch=None, on_computed=None, ids=None, keep_tables=True,
                 scope: str = ""):
        stats = PrefillStats(mode=mode, recompute_ratio=ratio, check_layer=self.blend.check_layer,
                             chunks=len(chunks), chunk_tokens=sum(map(len, chunks)), suffix_tokens=len(suffix))
        t0 = time.perf_counter()
        logits, seq = self.forward.prefill(chunks, suffix, mode, ratio, self.blend, stats, fetch, on_computed, ids,
                                           keep_tables, scope)
        stats.total_seconds = time.perf_counter() - t0
        return logits, seq, stats

    @torch.no_grad()
    @launches
    def decode_step(self, seqs: list[Sequence], tokens: list[int]) -> torch.Tensor:
        """Append one token to each sequence and return the next-token logits [B, vocab]."""
        return self.forward.decode_step(seqs, tokens)

    def release(self, seq: Sequence) -> None:
        """Free a sequence's private blocks and unpin its chunks (idempotent)."""
        if seq.released:
            return
        seq.released = True
        seq.decode.release(self.forward, seq)   # first: what its policy still reads of its blocks (an offload's copy)
        for entry in seq.pinned:
            self.cache.release(entry)
        self.pool.free(seq.private_blocks + seq.gen_blocks)
        clear_window(self.forward, seq)
        seq.prefill_queries = None

    def describe_memory(self) -> dict:
        """Bytes of KV: per block, resident in the chunk cache, free in the pool; and of Retro's windows."""
        return {
            "block_bytes": self.pool.block_bytes,
            "page_bounds_bytes_per_block": self.pool.bounds_bytes,
            "kv_bytes_per_token": self.pool.block_bytes // self.block_size,
            "chunk_cache_resident_bytes": self.cache.resident_bytes,
            "chunk_cache_budget_bytes": self.cache.budget_bytes,
            "chunks_resident": len(self.cache),
            "free_blocks": self.pool.num_free,
            "total_blocks": self.pool.usable_blocks,
            # RetroAttention's windows (decode/retro.py RetroRecords), on the device beside the pool
            "retro_records_bytes": sum(r.nbytes for r in self.forward.retro_records.values()),
        }


__all__ = ["Engine", "BlockTable"]


class PendingHandoff:
    """A prefill whose pass is issued (``Engine.begin_prefill_handoff``); ``finish`` completes it once."""

    def __init__(self, engine: Engine, logits, seq, stats, staged, kv_on_device: bool) -> None:
        self.engine, self.logits, self.seq, self.stats = engine, logits, seq, stats
        self.staged, self.kv_on_device = staged, kv_on_device

    @property
    def options(self) -> EngineOptions:
        return self.engine.options

    @launches
    def finish(self, on_logits=None):
        """(PrefillResult, Handoff): ``on_logits(logits)`` first (its read of the logits waits for the pass)."""
        eng = self.engine
        if self.seq.released:
            raise RuntimeError("this prefill was finished already")
        try:
            if on_logits is not None:
                on_logits(self.logits)
            handoff = export_sequence(eng.forward, self.seq, self.logits, eng.fingerprint, self.kv_on_device,
                                      self.staged)
        finally:
            eng.release(self.seq)
        return PrefillResult(self.logits, self.stats), handoff
