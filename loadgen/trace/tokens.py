"""Deterministic token ids for the documents and suffixes of a synthetic trace.

A trace names documents by id only; replay needs real token ids. The ids of document
``doc`` are drawn from a generator seeded by (seed, "doc", doc), so the same document has
the same tokens in every request, every process and every run, and hence the same chunk
hash in the cluster. A suffix is seeded by (seed, "suffix", request index): private to its
request, yet reproducible across replays of the same trace.
"""

from __future__ import annotations

import numpy as np

from loadgen.trace.model import TraceRequest

_DOC, _SUFFIX = 0x646F63, 0x737566  # "doc", "suf": keep the two seed domains apart


def _draw(domain: int, key: int, n_tokens: int, vocab_size: int, seed: int, low: int) -> np.ndarray:
    if not 0 <= low < vocab_size:
        raise ValueError(f"need 0 <= low < vocab_size, got low={low}, vocab_size={vocab_size}")
    if n_tokens < 0 or key < 0 or seed < 0:
        raise ValueError("n_tokens, ids and seed must be >= 0")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, domain, key])))
    return rng.integers(low, vocab_size, size=n_tokens, dtype=np.int64)


def doc_token_ids(doc: int, n_tokens: int, vocab_size: int, *, seed: int = 0, low: int = 0) -> np.ndarray:
    """Token ids of document ``doc``: int64 [n_tokens], each in [low, vocab_size).

    ``low`` keeps special tokens (often the first ids of a vocabulary) out of documents.
    """
    return _draw(_DOC, doc, n_tokens, vocab_size, seed, low)


def suffix_token_ids(request_index: int, n_tokens: int, vocab_size: int, *, seed: int = 0,
                     low: int = 0) -> np.ndarray:
    """Token ids of the private suffix of request number ``request_index``: int64 [n_tokens]."""
    return _draw(_SUFFIX, request_index, n_tokens, vocab_size, seed, low)


def request_token_ids(request: TraceRequest, request_index: int, vocab_size: int, *, seed: int = 0,
                      low: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """(one int64 array per chunk in prompt order, suffix ids) for one trace request."""
    chunks = [doc_token_ids(c.doc, c.tokens, vocab_size, seed=seed, low=low) for c in request.chunks]
    return chunks, suffix_token_ids(request_index, request.suffix_tokens, vocab_size, seed=seed, low=low)
