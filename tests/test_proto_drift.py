"""The committed gRPC stubs must be exactly what ``make proto`` generates from proto/*.proto."""

from pathlib import Path

import pytest

from services.rpc.generate import PROTO_DIR, REPO, generate

PROTOS = sorted(p.stem for p in PROTO_DIR.glob("*.proto"))


def test_there_are_contracts():
    assert PROTOS, "proto/ holds no .proto contract"


@pytest.mark.parametrize("stem", PROTOS)
def test_stubs_match_proto(tmp_path: Path, stem: str):
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path) if p.name.startswith(f"{stem}_pb2")}
    assert set(fresh) == {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"}
    for name, data in fresh.items():
        committed = REPO / "services" / "rpc" / name
        assert committed.exists(), f"{committed} is missing: run `make proto` and commit it"
        assert committed.read_bytes() == data, f"{committed} drifted from proto/{stem}.proto: run `make proto`"
