"""The trace request: what one line of a trace JSONL file means.

A request's prompt is ``chunks`` (retrieved documents, in prompt order) followed by
``suffix_tokens`` private tokens (the user's question). ``hash_ids`` keeps the Mooncake
meaning so that Mooncake tools read our traces: one id per 512-token block of the whole
prompt (the last block may be partial), prefix-chained, so two requests share the id of
block b exactly when their first min(512*(b+1), input_length) tokens are identical. Ids
are small integers numbered in order of first appearance in the trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

# Mooncake's block size; hash_ids are computed over blocks of this many tokens.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Chunk:
    """One reusable chunk of a prompt: document ``doc`` (an id in the corpus), ``tokens`` long."""

    doc: int
    tokens: int


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    timestamp_ms: arrival time in milliseconds from the start of the trace.
    input_length: prompt tokens == sum(c.tokens for c in chunks) + suffix_tokens.
    output_length: tokens to generate.
    hash_ids: Mooncake block ids, len == ceil(input_length / 512) (see module docstring).
    chunks: the prompt's chunks in order; the same ``doc`` always has the same tokens.
    suffix_tokens: private tokens after the chunks (never shared between requests).
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    suffix_tokens: int

    @property
    def chunk_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    def chunk_offsets(self) -> list[int]:
        """Start position of each chunk in the prompt (the position its KV is computed at)."""
        offsets, pos = [], 0
        for c in self.chunks:
            offsets.append(pos)
            pos += c.tokens
        return offsets


def served_chunks(chunks: Sequence[Chunk], suffix_tokens: int) -> tuple[tuple[Chunk, ...], int]:
    """(the chunks the cluster caches, chunk tokens it computes privately: 0 or 1) for one request.

    The first output token follows the prompt's last token, which the cluster computes for the
    request alone. With a suffix that token is the suffix's. A request of chunks only (every
    plain Mooncake line) is served with its last chunk's last token computed privately, never
    cached and never a hit: the chunk cached is the rest of it, one token shorter, which is
    another chunk than the whole one (a chunk is its tokens), and none if it had one token.
    The simulator and the fake replay target both count a request this way.
    """
    if suffix_tokens or not chunks:
        return tuple(chunks), 0
    *head, last = chunks
    rest = (Chunk(last.doc, last.tokens - 1),) if last.tokens > 1 else ()
    return (*head, *rest), 1


class BlockHasher:
    """Assigns Mooncake-style prefix-chained block ids across the requests of one trace.

    A block's identity is the identity of the whole prompt prefix that ends with it:
    (chain node of the complete chunks before the chunk it ends in, that chunk's doc, how
    far into it the block ends), or, if it ends in the suffix, (request, block) because a
    suffix is private to its request. Keys are interned to ids in first-seen order.
    """

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[Hashable, int] = {}
        self._chain: dict[tuple[int, int], int] = {}  # (parent node, doc) -> node
        self._requests = 0

    def _id(self, key: Hashable) -> int:
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found

    def hash_ids(self, chunks: Iterable[Chunk], suffix_tokens: int) -> tuple[int, ...]:
        chunks = list(chunks)
        request = self._requests
        self._requests += 1
        total = sum(c.tokens for c in chunks) + suffix_tokens
        # Chain node before each chunk: node 0 is the empty prefix.
        nodes, node = [], 0
        for c in chunks:
            nodes.append(node)
            node = self._chain.setdefault((node, c.doc), len(self._chain) + 1)
        ids: list[int] = []
        j, start = 0, 0  # chunk holding the current block end, and its start position
        n_blocks = -(-total // self.block_tokens)
        for b in range(n_blocks):
            end = min((b + 1) * self.block_tokens, total)
            while j < len(chunks) and start + chunks[j].tokens < end:
                start += chunks[j].tokens
                j += 1
            if j < len(chunks):
                key: Hashable = ("c", nodes[j], chunks[j].doc, end - start)
            else:
                key = ("s", request, b)
            ids.append(self._id(key))
        return tuple(ids)
