"""Reading and writing trace JSONL files (ours and plain Mooncake lines).

Our line:   {"timestamp": 0, "input_length": 1056, "output_length": 64, "hash_ids": [0, 1, 2],
             "chunks": [{"doc": 3, "tokens": 512}, {"doc": 0, "tokens": 512}], "suffix_tokens": 32}
Mooncake:   the same without "chunks" and "suffix_tokens". Such a line is read with each
            hash_ids block as a chunk (doc = the block id, 512 tokens, the last one what is
            left of input_length), so the simulator and replay treat a Mooncake trace's blocks
            as its reusable units; its hash_ids must cover input_length exactly
            (ceil(input_length / 512) of them), so it has no suffix.
Blank lines are skipped. A file may be gzip-compressed (read by its magic bytes, whatever its
name). Any defect is refused with a ValueError naming the file and line, never repaired; a
Git-LFS pointer (a clone without ``git lfs pull``) is named as one. A length (input_length,
output_length, a chunk's tokens, suffix_tokens) past ``MAX_TOKENS`` (2**24) is a defect too.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from pathlib import Path
from typing import Iterable, Iterator

from loadgen.trace.model import MOONCAKE_BLOCK_TOKENS, BlockHasher, Chunk, TraceRequest

_REQUIRED = ("timestamp", "input_length", "output_length")
_GZIP_MAGIC = b"\x1f\x8b"
_LFS_POINTER = "version https://git-lfs.github.com/spec/v1"
# NOTE: reading a line costs work in its lengths (one hash id per 512-token block of a prompt without
# hash_ids): a 120-byte line claiming 10**12 tokens would take minutes and gigabytes. No model addresses
# more than 16M tokens, so a length past that is refused before any work proportional to it.
MAX_TOKENS = 1 << 24


def _count(obj: dict, key: str, minimum: int = 0, maximum: int | None = None) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{key!r} is {value}, past the limit of {maximum:,} tokens a trace line may hold "
                         "(no model addresses more)")
    return value


def _blocks(n_tokens: int) -> int:
    return -(-n_tokens // MOONCAKE_BLOCK_TOKENS)


def _parse(obj: object, hasher: BlockHasher) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    missing = [k for k in _REQUIRED if k not in obj]
    if "hash_ids" not in obj and "chunks" not in obj:
        missing.append("hash_ids (or chunks)")
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"'timestamp' must be a finite number >= 0 (ms), got {ts!r}")
    n_in = _count(obj, "input_length", maximum=MAX_TOKENS)
    n_out = _count(obj, "output_length", maximum=MAX_TOKENS)
    hash_ids = None
    if "hash_ids" in obj:
        raw = obj["hash_ids"]
        if not isinstance(raw, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0
                                            for h in raw):
            raise ValueError("'hash_ids' must be a list of integers >= 0")
        hash_ids = tuple(raw)
    if "chunks" in obj:
        raw = obj["chunks"]
        if not isinstance(raw, list):
            raise ValueError("'chunks' must be a list of {\"doc\": id, \"tokens\": n}")
        chunks = []
        for i, c in enumerate(raw):
            if not isinstance(c, dict):
                raise ValueError(f"chunks[{i}] must be an object {{\"doc\": id, \"tokens\": n}}")
            try:
                chunks.append(Chunk(_count(c, "doc"), _count(c, "tokens", minimum=1, maximum=MAX_TOKENS)))
            except ValueError as exc:
                raise ValueError(f"chunks[{i}]: {exc}") from None
        if "suffix_tokens" not in obj:
            raise ValueError("missing field(s): suffix_tokens (a line with chunks needs it)")
        suffix = _count(obj, "suffix_tokens", maximum=MAX_TOKENS)
        total = sum(c.tokens for c in chunks) + suffix
        if total != n_in:
            raise ValueError(f"input_length {n_in} != chunk tokens + suffix_tokens = {total}")
        if hash_ids is None:
            hash_ids = hasher.hash_ids(chunks, suffix)
        elif len(hash_ids) != _blocks(n_in):
            raise ValueError(f"{len(hash_ids)} hash_ids for input_length {n_in}; "
                             f"expected {_blocks(n_in)} blocks of {MOONCAKE_BLOCK_TOKENS}")
    else:
        # Plain Mooncake: every block is a chunk, the last one what is left of input_length.
        assert hash_ids is not None
        if len(hash_ids) != _blocks(n_in):
            few = len(hash_ids) < _blocks(n_in)
            raise ValueError(
                f"{len(hash_ids)} hash_ids (blocks of {MOONCAKE_BLOCK_TOKENS} tokens) "
                f"{'do not cover' if few else 'are more than'} input_length {n_in}, which takes "
                f"{_blocks(n_in)}")
        sizes = [MOONCAKE_BLOCK_TOKENS] * len(hash_ids)
        if sizes:
            sizes[-1] = n_in - (len(hash_ids) - 1) * MOONCAKE_BLOCK_TOKENS
        chunks = [Chunk(h, s) for h, s in zip(hash_ids, sizes)]
        suffix = 0
    return TraceRequest(float(ts), n_in, n_out, hash_ids, tuple(chunks), suffix)


def parse_lines(lines: Iterable[str | bytes], source: str = "<trace>") -> list[TraceRequest]:
    """Parse JSONL lines (text, or UTF-8 bytes); errors name ``source`` and the 1-based line number."""
    trace: list[TraceRequest] = []
    hasher, last_ts = BlockHasher(), -math.inf
    for lineno, line in enumerate(lines, start=1):
        try:
            if isinstance(line, bytes):
                try:
                    line = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start + 1}); "
                                     "a trace is JSONL, plain or gzip-compressed") from None
            if lineno == 1 and line.startswith(_LFS_POINTER):
                raise ValueError("a Git-LFS pointer, not the trace itself: run `git lfs pull` "
                                 "in its repository to fetch the file")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"bad JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:      # '[' * 100000: json's parser recurses once per level
                raise ValueError("JSON nested too deeply to read (a trace line is a flat object)") from None
            req = _parse(obj, hasher)
            if req.timestamp_ms < last_ts:
                raise ValueError(f"timestamp {req.timestamp_ms:g} ms is before the previous "
                                 f"line's {last_ts:g} ms (timestamps must not decrease)")
        except ValueError as exc:
            raise ValueError(f"{source}, line {lineno}: {exc}") from None
        last_ts = req.timestamp_ms
        trace.append(req)
    if not trace:
        raise ValueError(f"{source}: the trace has no requests")
    return trace


def _gunzipped(f, source: str) -> Iterator[bytes]:
    """The lines of gzip file ``f``; a corrupt or truncated stream is refused at the line it breaks."""
    lineno = 0
    try:
        for lineno, line in enumerate(gzip.GzipFile(fileobj=f), start=1):
            yield line
    except (OSError, EOFError, zlib.error) as exc:   # gzip.BadGzipFile is an OSError
        raise ValueError(f"{source}, line {lineno + 1}: corrupt or truncated gzip ({exc})") from None


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a trace file (ours or Mooncake, plain or gzip). Raises FileNotFoundError or ValueError."""
    path = Path(path)
    try:
        f = path.open("rb")
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not a trace file") from None
    except FileNotFoundError:
        raise
    except OSError as exc:      # a file it may not read, a loop of links, ...: one line naming the path
        raise ValueError(f"{path}: cannot open the trace ({exc.strerror or exc})") from None
    with f:
        gzipped = f.read(2) == _GZIP_MAGIC
        f.seek(0)
        return parse_lines(_gunzipped(f, str(path)) if gzipped else f, source=str(path))


def request_to_json(req: TraceRequest) -> str:
    ts = req.timestamp_ms
    return json.dumps({
        "timestamp": int(ts) if float(ts).is_integer() else ts,
        "input_length": req.input_length,
        "output_length": req.output_length,
        "hash_ids": list(req.hash_ids),
        "chunks": [{"doc": c.doc, "tokens": c.tokens} for c in req.chunks],
        "suffix_tokens": req.suffix_tokens,
    }, separators=(", ", ": "))


def write_trace(path: str | Path, trace: Iterable[TraceRequest]) -> int:
    """Write ``trace`` as JSONL; returns the number of requests written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for req in trace:
            f.write(request_to_json(req) + "\n")
            n += 1
    return n
