"""Trace files: round trip, Mooncake lines, bad input refused with the line number, the CLI."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from loadgen.trace import (Chunk, LengthDist, SynthConfig, parse_lines, read_trace, synthesize,
                           write_trace)
from services.cli import main

GOOD = ('{"timestamp": 0, "input_length": 1056, "output_length": 8, "hash_ids": [0, 1, 2], '
        '"chunks": [{"doc": 3, "tokens": 512}, {"doc": 0, "tokens": 512}], "suffix_tokens": 32}')


def test_round_trip(tmp_path):
    trace = synthesize(SynthConfig(docs=40, alpha=1.2, chunks_per_request=3, requests=300, seed=4,
                                   rate=20.0, burstiness=0.5,
                                   doc_tokens=LengthDist.parse("uniform:1:1500"),
                                   suffix_tokens=LengthDist.parse("uniform:0:600")))
    path = tmp_path / "t.jsonl"
    assert write_trace(path, trace) == 300
    assert read_trace(path) == trace
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids", "chunks",
                          "suffix_tokens"}


def test_mooncake_lines_read_with_blocks_as_chunks():
    lines = [
        '{"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, 2]}',
        "",
        '{"timestamp": 27.5, "input_length": 1024, "output_length": 9, "hash_ids": [0, 3]}',
    ]
    a, b = parse_lines(lines)
    assert a.chunks == (Chunk(0, 512), Chunk(1, 512), Chunk(2, 176)) and a.suffix_tokens == 0
    assert b.chunks == (Chunk(0, 512), Chunk(3, 512)) and b.timestamp_ms == 27.5
    assert b.hash_ids == (0, 3) and b.output_length == 9


def test_our_lines_without_hash_ids_get_them_computed():
    line = json.loads(GOOD)
    del line["hash_ids"]
    (req,) = parse_lines([json.dumps(line)])
    assert len(req.hash_ids) == 3


def _bad(**change):
    obj = json.loads(GOOD)
    for k, v in change.items():
        if v is None:
            obj.pop(k)
        else:
            obj[k] = v
    return json.dumps(obj)


@pytest.mark.parametrize("line,message", [
    ("{not json", "bad JSON"),
    ("[1, 2]", "JSON object"),
    (_bad(timestamp=None), "missing field(s): timestamp"),
    (_bad(output_length=None), "output_length"),
    (_bad(hash_ids=None, chunks=None), "hash_ids (or chunks)"),
    (_bad(suffix_tokens=None), "suffix_tokens"),
    (_bad(output_length=-1), "'output_length' must be >= 0"),
    (_bad(input_length=-5), "'input_length' must be >= 0"),
    (_bad(suffix_tokens=-3, input_length=1021), "'suffix_tokens' must be >= 0"),
    (_bad(chunks=[{"doc": 1, "tokens": -512}]), "chunks[0]"),
    (_bad(chunks=[{"doc": -1, "tokens": 512}], input_length=544, hash_ids=[0, 1]), "'doc' must be >= 0"),
    (_bad(input_length=1000), "input_length 1000 != chunk tokens"),
    (_bad(hash_ids=[0, 1]), "expected 3 blocks"),
    (_bad(hash_ids=[0, -1, 2]), "hash_ids"),
    (_bad(timestamp=-1), "timestamp"),
    (_bad(timestamp="soon"), "timestamp"),
    (_bad(output_length=2.5), "must be an integer"),
    ('{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [4, 5]}',
     "2 hash_ids (blocks of 512 tokens) are more than input_length 100, which takes 1"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [4, 5]}',
     "2 hash_ids (blocks of 512 tokens) do not cover input_length 1025, which takes 3"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}', "do not cover"),
    ("[" * 100_000, "JSON nested too deeply to read"),
    (_bad(input_length=2**24 + 1), "'input_length' is 16777217, past the limit of 16,777,216 tokens"),
    (_bad(output_length=10**12), "'output_length' is 1000000000000, past the limit of 16,777,216 tokens"),
    (_bad(chunks=[{"doc": 0, "tokens": 10**12}], input_length=10**12 + 32, hash_ids=None),
     "line 3: 'input_length' is 1000000000032, past the limit"),
    (_bad(chunks=[{"doc": 0, "tokens": 10**12}]), "chunks[0]: 'tokens' is 1000000000000, past the limit"),
    (_bad(suffix_tokens=2**24 + 1), "'suffix_tokens' is 16777217, past the limit"),
])
def test_bad_lines_are_refused_with_their_line_number(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n\n" + line + "\n" + GOOD + "\n")
    with pytest.raises(ValueError) as err:
        read_trace(path)
    assert f"{path}, line 3:" in str(err.value)
    assert message in str(err.value)


def test_mooncake_blocks_cover_the_input_exactly():
    (req,) = parse_lines(['{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}'])
    assert req.chunks == (Chunk(7, 512), Chunk(8, 512)) and req.suffix_tokens == 0


@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.jsonl"])
def test_gzip_traces_are_read_by_their_magic_bytes(tmp_path, name):
    plain = tmp_path / "plain.jsonl"
    write_trace(plain, synthesize(SynthConfig(docs=20, chunks_per_request=2, requests=30)))
    packed = tmp_path / name
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_trace(packed) == read_trace(plain)


def test_a_broken_gzip_trace_is_refused_with_its_name_and_line(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress((GOOD + "\n").encode() * 200)[:-40])   # cut: no CRC, no end
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line \d+: corrupt or truncated gzip"):
        read_trace(path)


def test_a_git_lfs_pointer_is_named_as_one(tmp_path, capsys):
    path = tmp_path / "conversation_trace.jsonl"
    path.write_text("version https://git-lfs.github.com/spec/v1\n"
                    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
                    "size 12345\n")
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tessera simulate: error: {path}, line 1: a Git-LFS pointer")
    assert "git lfs pull" in err and "bad JSON" not in err and len(err.splitlines()) == 1


def test_a_line_at_the_length_limit_is_read():
    n = 2**24           # loadgen.trace.io.MAX_TOKENS: a prompt of this many tokens is still read
    line = json.dumps({"timestamp": 0, "input_length": n, "output_length": n, "chunks": [{"doc": 0, "tokens": n - 1}],
                       "suffix_tokens": 1})
    (req,) = parse_lines([line])
    assert req.input_length == n and len(req.hash_ids) == n // 512


def test_a_path_that_is_no_readable_file_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}: is a directory, not a trace file$"):
        read_trace(tmp_path)
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)                               # ELOOP: an OSError that is no FileNotFoundError
    with pytest.raises(ValueError, match=rf"^{re.escape(str(loop))}: cannot open the trace \("):
        read_trace(loop)
    for path in (tmp_path, loop):
        assert main(["simulate", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tessera simulate: error: {path}: ") and err.count("\n") == 1, err


def test_a_line_that_is_not_utf8_is_refused_with_its_name_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"timestamp": \xff}\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line 2: not UTF-8 text"):
        read_trace(path)


def test_unsorted_timestamps_are_refused_with_the_line_number():
    later = GOOD.replace('"timestamp": 0', '"timestamp": 100')
    with pytest.raises(ValueError, match=r"line 3: timestamp 0 ms is before the previous line's 100"):
        parse_lines([GOOD, later, GOOD])


def test_empty_trace_is_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        read_trace(tmp_path / "e.jsonl")


def test_cli_synth_writes_a_readable_trace(tmp_path, capsys):
    out = tmp_path / "trace.jsonl"
    rc = main(["trace", "synth", "--docs", "50", "--alpha", "1.5", "--chunks-per-request", "3",
               "--doc-tokens", "uniform:64:256", "--suffix-tokens", "normal:20:5", "--output-tokens",
               "lognormal:50:20", "--rate", "4", "--burstiness", "0.5", "--requests", "40",
               "--seed", "9", "-o", str(out)])
    assert rc == 0
    trace = read_trace(out)
    assert len(trace) == 40 and all(len(r.chunks) == 3 for r in trace)
    assert all(64 <= c.tokens <= 256 for r in trace for c in r.chunks)


def test_cli_refuses_bad_input_in_one_line(tmp_path, capsys):
    rc = main(["trace", "synth", "--doc-tokens", "gauss:3", "-o", str(tmp_path / "x.jsonl")])
    assert rc == 2
    assert "unknown length distribution 'gauss'" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD + "\n" + "{oops\n")
    assert main(["simulate", str(bad)]) == 2
    assert "line 2: bad JSON" in capsys.readouterr().err
