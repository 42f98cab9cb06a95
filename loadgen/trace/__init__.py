"""Traces: the request model, JSONL reading/writing, synthesis and deterministic token ids.

The surface the replay and the cluster demo use::

    from loadgen.trace import SynthConfig, synthesize, read_trace, write_trace, doc_token_ids
"""

from loadgen.trace.dists import LENGTH_SYNTAX, LengthDist
from loadgen.trace.io import parse_lines, read_trace, write_trace
from loadgen.trace.model import MOONCAKE_BLOCK_TOKENS, BlockHasher, Chunk, TraceRequest, served_chunks
from loadgen.trace.synth import SynthConfig, ZipfSampler, arrival_times_ms, synthesize
from loadgen.trace.tokens import doc_token_ids, request_token_ids, suffix_token_ids

__all__ = [
    "LENGTH_SYNTAX", "LengthDist", "parse_lines", "read_trace", "write_trace",
    "MOONCAKE_BLOCK_TOKENS", "BlockHasher", "Chunk", "TraceRequest", "served_chunks",
    "SynthConfig", "ZipfSampler", "arrival_times_ms", "synthesize",
    "doc_token_ids", "request_token_ids", "suffix_token_ids",
]
