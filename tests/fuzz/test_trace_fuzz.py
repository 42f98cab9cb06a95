"""Fuzzing the trace reader (loadgen/trace/io.py: what ``tessera replay`` and ``tessera simulate`` read).

Property: a file of any bytes (random bytes, random JSON lines, our lines and Mooncake lines with wrong types,
gzip streams cut short or damaged) is either read into requests that keep the trace's invariants, or refused
with a ValueError whose message starts with the file's name and, for a defect of one line, says which
(``<file>, line N: ...``); a missing file is a FileNotFoundError naming it. Never another exception type.

The line a refusal names is checked against the reader itself: the lines before it are read (or are no
request at all), and those lines with it are refused with the same message.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.trace import MOONCAKE_BLOCK_TOKENS, parse_lines, read_trace
from loadgen.trace.io import MAX_TOKENS

from .common import FUZZ, expect

LINE = re.compile(r", line (\d+): ")
ROOT = Path(__file__).resolve().parents[2]       # the repository: a child process imports loadgen from here

# ---------------------------------------------------------------------------------------------- lines
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-3, 3000), st.floats(),
                         st.text(max_size=6), st.sampled_from([0, -1, 512, 1.5, 1e400, "12", [], {}, MAX_TOKENS, MAX_TOKENS + 1, 10**12]))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["doc", "tokens", "x"]) | st.text(max_size=4), inner, max_size=3),
                    max_leaves=10)


@st.composite
def mooncake_line(draw, ts):
    n = draw(st.integers(0, 4000))
    blocks = -(-n // MOONCAKE_BLOCK_TOKENS)
    return {"timestamp": ts, "input_length": n, "output_length": draw(st.integers(0, 64)),
            "hash_ids": draw(st.lists(st.integers(0, 50), min_size=blocks, max_size=blocks))}


@st.composite
def our_line(draw, ts):
    chunks = draw(st.lists(st.fixed_dictionaries({"doc": st.integers(0, 20), "tokens": st.integers(1, 1500)}), max_size=4))
    suffix = draw(st.integers(0, 600))
    obj = {"timestamp": ts, "input_length": sum(c["tokens"] for c in chunks) + suffix,
           "output_length": draw(st.integers(0, 64)), "chunks": chunks, "suffix_tokens": suffix}
    if draw(st.booleans()):
        blocks = -(-obj["input_length"] // MOONCAKE_BLOCK_TOKENS)
        obj["hash_ids"] = draw(st.lists(st.integers(0, 50), min_size=blocks, max_size=blocks))
    return obj


@st.composite
def long_line(draw, ts):
    """Our line of one chunk at, or past, the longest a line may hold (``MAX_TOKENS``), lengths consistent."""
    tokens = draw(st.sampled_from([MAX_TOKENS - 1, MAX_TOKENS, MAX_TOKENS + 1, 10**12]))
    suffix = draw(st.sampled_from([0, 1]))
    return {"timestamp": ts, "input_length": tokens + suffix, "output_length": draw(st.sampled_from([1, 10**12])),
            "chunks": [{"doc": 0, "tokens": tokens}], "suffix_tokens": suffix}


@st.composite
def damaged(draw, obj):
    """``obj`` with one field dropped, set to a random JSON value, or added."""
    obj = dict(obj)
    how = draw(st.sampled_from(["keep", "keep", "drop", "set", "set", "add"]))
    keys = ["timestamp", "input_length", "output_length", "hash_ids", "chunks", "suffix_tokens"]
    key = draw(st.sampled_from(keys))
    if how == "drop":
        obj.pop(key, None)
    elif how in ("set", "add"):
        obj[key] = draw(JSON)
    return obj


@st.composite
def trace_text(draw) -> bytes:
    """JSONL of our and Mooncake lines, some damaged, with blank lines, raw junk and odd encodings now and then."""
    lines, ts = [], 0.0
    for _ in range(draw(st.integers(0, 6))):
        ts += draw(st.sampled_from([0.0, 0.5, 10.0, -1.0]))
        kind = draw(st.sampled_from(["ours", "mooncake", "json", "junk", "blank", "long"]))
        if kind == "ours":
            line = json.dumps(draw(damaged(draw(our_line(ts)))))
        elif kind == "long":
            line = json.dumps(draw(long_line(ts)))
        elif kind == "mooncake":
            line = json.dumps(draw(damaged(draw(mooncake_line(ts)))))
        elif kind == "json":
            line = json.dumps(draw(JSON))
        elif kind == "junk":
            line = draw(st.text(max_size=20))
        else:
            line = draw(st.sampled_from(["", "   ", "\t"]))
        lines.append(line)
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    mutation = draw(st.sampled_from(["none", "none", "none", "cut", "byte", "bom", "crlf"]))
    if mutation == "cut" and data:
        data = data[:draw(st.integers(0, len(data)))]
    elif mutation == "byte" and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    elif mutation == "bom":
        data = b"\xef\xbb\xbf" + data
    elif mutation == "crlf":
        data = data.replace(b"\n", b"\r\n")
    return data


# ---------------------------------------------------------------------------------------------- the property
def check_read(path, data: bytes | None, gzipped: bool) -> None:
    name = str(path)
    try:
        trace = read_trace(path)
    except FileNotFoundError as exc:
        assert data is None and name in str(exc), f"FileNotFoundError for a file that exists, or unnamed: {exc}"
        return
    except ValueError as exc:
        msg = str(exc)
        assert msg.startswith(name), f"the refusal does not start with the file's name: {msg}"
        m = LINE.search(msg)
        assert m or msg == f"{name}: the trace has no requests", f"a refusal names no line: {msg}"
        if m and not gzipped:
            same_line_refused(data, name, int(m.group(1)), msg)
        return
    except Exception as exc:  # noqa: BLE001 - any other type is the defect looked for
        pytest.fail(f"{type(exc).__name__} reading {data!r:.300}: {exc}")
    assert trace, "a trace read without a request"
    last = -math.inf
    for req in trace:
        assert math.isfinite(req.timestamp_ms) and req.timestamp_ms >= last
        last = req.timestamp_ms
        assert req.input_length == sum(c.tokens for c in req.chunks) + req.suffix_tokens
        assert len(req.hash_ids) == -(-req.input_length // MOONCAKE_BLOCK_TOKENS)
        assert all(c.tokens >= 1 for c in req.chunks) and req.output_length >= 0


def same_line_refused(data: bytes, name: str, lineno: int, msg: str) -> None:
    lines = io.BytesIO(data).readlines()
    assert 1 <= lineno <= len(lines), f"line {lineno} of a file of {len(lines)} lines: {msg}"
    try:
        parse_lines(lines[:lineno - 1], source=name)
    except ValueError as exc:
        assert str(exc) == f"{name}: the trace has no requests", f"line {lineno} is named, but an earlier one fails: {exc}"
    with pytest.raises(ValueError) as again:
        parse_lines(lines[:lineno], source=name)
    assert str(again.value) == msg


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


def test_a_file_of_random_bytes_is_read_or_refused_by_name(folder):
    path = folder / "random.jsonl"

    @settings(FUZZ, max_examples=150)
    @given(st.binary(max_size=300) | st.binary(max_size=40).map(lambda b: b"\n".join([b'{"timestamp": 0', b, b"}"])))
    def read(data):
        path.write_bytes(data)
        check_read(path, data, gzipped=data[:2] == b"\x1f\x8b")

    read()


@pytest.mark.slow
def test_a_file_of_trace_lines_is_read_or_refused_at_the_right_line(folder):
    path = folder / "lines.jsonl"

    @settings(FUZZ, max_examples=250)
    @given(trace_text())
    def read(data):
        path.write_bytes(data)
        check_read(path, data, gzipped=False)

    read()


@pytest.mark.slow
def test_a_gzip_stream_cut_short_or_damaged_is_refused_by_name_and_line(folder):
    path = folder / "trace.jsonl.gz"

    @settings(FUZZ, max_examples=150)
    @given(trace_text(), st.sampled_from(["whole", "cut", "byte", "tail", "twice"]), st.data())
    def read(text, how, data):
        raw = gzip.compress(text, mtime=0)
        if how == "cut":
            raw = raw[:data.draw(st.integers(2, len(raw) - 1))]           # keeps the magic bytes: read as gzip
        elif how == "byte":
            at = data.draw(st.integers(2, len(raw) - 1))
            raw = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1:]
        elif how == "tail":
            raw += data.draw(st.binary(min_size=1, max_size=8))
        elif how == "twice":
            raw += gzip.compress(text, mtime=0)                            # two members: read as one stream
        path.write_bytes(raw)
        check_read(path, raw, gzipped=True)

    read()


def test_a_missing_file_is_named():
    with pytest.raises(FileNotFoundError, match="no-such-trace.jsonl"):
        read_trace("/nonexistent-dir/no-such-trace.jsonl")


def test_parse_lines_names_its_source_for_any_line():
    @settings(FUZZ, max_examples=150)
    @given(st.lists(st.text(max_size=30) | st.binary(max_size=30) | JSON.map(json.dumps), min_size=1, max_size=4))
    def parse(lines):
        try:
            parse_lines(lines, source="<fuzz>")
        except ValueError as exc:
            assert str(exc).startswith("<fuzz>"), exc
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{type(exc).__name__} for {lines!r}: {exc}")

    parse()


@pytest.mark.slow
def test_tessera_simulate_reads_a_fuzzed_trace_or_says_why_in_one_line(folder, capsys):
    """What the command does with the same files: a result (exit 0) or one error line naming the file (exit 2)."""
    from services.cli import main

    path = folder / "simulate.jsonl"

    @settings(FUZZ, max_examples=80)
    @given(trace_text())
    def simulate(data):
        path.write_bytes(data)
        rc = main(["simulate", str(path), "--json"])
        out, err = capsys.readouterr()
        if rc == 0:
            assert json.loads(out)["policy"] == "tessera" and not err
        else:
            assert rc == 2 and err.startswith(f"tessera simulate: error: {path}"), (rc, err)
            assert err.count("\n") == 1 and "Traceback" not in err, err

    simulate()


# ---------------------------------------------------------------------------------------------- defects found, fixed
def test_a_deeply_nested_line_is_refused_by_name(folder):
    """json.loads once raised RecursionError for a line nested ~1,000 deep."""
    path = folder / "deep.jsonl"
    path.write_text("[" * 100_000 + "\n")
    try:
        read_trace(path)
    except ValueError as exc:
        expect(str(exc).startswith(f"{path}, line 1: "), f"the refusal names no file and line: {exc}")
    except Exception as exc:  # noqa: BLE001 - the defect: RecursionError
        expect(False, f"{type(exc).__name__}: {exc}")


def test_a_directory_is_refused_by_name(folder, capsys):
    """read_trace once raised IsADirectoryError, so ``tessera simulate <dir>`` ended in a traceback."""
    from services.cli import main

    try:
        read_trace(folder)
    except (ValueError, FileNotFoundError) as exc:
        expect(str(folder) in str(exc), f"the refusal does not name the directory: {exc}")
    except Exception as exc:  # noqa: BLE001 - the defect: IsADirectoryError
        expect(False, f"{type(exc).__name__}: {exc}")
    else:
        expect(False, "a directory was read as a trace")
    rc = main(["simulate", str(folder), "--json"])
    err = capsys.readouterr().err
    expect(rc == 2 and err == f"tessera simulate: error: {folder}: is a directory, not a trace file\n", f"{rc}: {err}")


def test_a_line_claiming_a_trillion_tokens_is_read_or_refused_at_once(folder):
    """A 120-byte line whose chunks claim 10**12 tokens (no hash_ids) once made read_trace hash 2e9 blocks."""
    path = folder / "huge.jsonl"
    n = 10**12
    path.write_text(json.dumps({"timestamp": 0, "input_length": n, "output_length": 1,
                                "chunks": [{"doc": 0, "tokens": n}], "suffix_tokens": 0}) + "\n")
    # in a child with 1 GiB of address space and 10 s: the defect neither ends nor stays small here
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from loadgen.trace import read_trace
        try:
            read_trace({str(path)!r})
        except ValueError as exc:
            print(exc)
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10, cwd=ROOT)
    except subprocess.TimeoutExpired:
        expect(False, "read_trace was still running after 10 s")
    expect(done.returncode == 0, done.stderr[-2000:])
    expect(done.stdout.startswith(f"{path}, line 1: ") and f"{MAX_TOKENS:,} tokens" in done.stdout,
           f"the refusal names no line or bound: {done.stdout}")
