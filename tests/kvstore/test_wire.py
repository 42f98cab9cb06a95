"""The hand-rolled frame codec is protobuf's wire format, both ways."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.kvstore import wire
from services.rpc import kvstore_pb2 as pb


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, 2**32 - 1), data=st.binary(max_size=3000), end=st.booleans(), crc=st.integers(0, 2**32 - 1))
def test_frames_match_protobuf(index, data, end, crc):
    frame = wire.Frame(index, memoryview(data), end, crc)
    raw = wire.encode_frame(frame)
    for cls in (pb.PutRequest, pb.GetResponse):
        parsed = cls.FromString(raw)                       # protobuf reads what we write
        assert parsed.WhichOneof("item") == "frame"
        assert (parsed.frame.layer_index, parsed.frame.data, parsed.frame.end_of_layer, parsed.frame.checksum) == (index, data, end, crc)
        ours = wire.decode_get_response(cls(frame=parsed.frame).SerializeToString())   # we read what protobuf writes
        assert isinstance(ours, wire.Frame)
        assert (ours.layer_index, bytes(ours.data), ours.end_of_layer, ours.checksum) == (index, data, end, crc)


def test_headers_and_unknown_fields_go_through_protobuf():
    header = pb.GetResponse(header=pb.ChunkHeader(chunk_id="abc", num_layers=2))
    decoded = wire.decode_get_response(header.SerializeToString())
    assert isinstance(decoded, pb.GetResponse) and decoded.header.chunk_id == "abc"
    # a frame with an unknown field (a newer writer) still decodes, the field skipped
    raw = pb.LayerFrame(layer_index=3, data=b"xyz", end_of_layer=True, checksum=7).SerializeToString() + b"\x28\x05"
    framed = b"\x12" + bytes([len(raw)]) + raw
    decoded = wire.decode_put_request(framed)
    assert (decoded.layer_index, bytes(decoded.data), decoded.end_of_layer, decoded.checksum) == (3, b"xyz", True, 7)
    assert wire.encode_message(header) == header.SerializeToString()
