"""Hand-rolled (de)serialization of the bulk messages, byte-compatible with proto/kvstore.proto.

``PutRequest`` and ``GetResponse`` both carry a ``LayerFrame`` in field 2 of their oneof, and
nearly every byte of a chunk travels in those frames. Through the generated classes a frame is
copied three times per side in Python (slice, protobuf object, serialized string); here it is
copied once when encoded (``b"".join`` of the field prefixes and the payload, which may be a
memoryview into a tensor or a stored value) and not at all when decoded (the payload is a
memoryview into the received message). Any other message (headers) goes through protobuf, so
the wire format stays plain protobuf for other clients.

``Frame`` is what decoding yields for a frame message; a header message decodes to its
generated class (``pb.PutRequest`` / ``pb.GetResponse``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.rpc import kvstore_pb2 as pb

_VARINT, _LEN = 0, 2
_TAG_FRAME = bytes([(2 << 3) | _LEN])          # oneof field 2 (frame), length-delimited


@dataclass(frozen=True, slots=True)
class Frame:
    """One slice of a layer's K||V bytes; ``checksum`` is set when ``end_of_layer``."""

    layer_index: int
    data: memoryview | bytes
    end_of_layer: bool = False
    checksum: int = 0


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_frame(frame: Frame) -> bytes:
    """Serialize as ``{PutRequest|GetResponse}.frame`` (proto3: default-valued fields omitted)."""
    n = len(frame.data) if isinstance(frame.data, bytes) else frame.data.nbytes
    head = bytearray()
    if frame.layer_index:
        head += b"\x08" + _varint(frame.layer_index)            # field 1, varint
    head += b"\x12" + _varint(n)                                # field 2, bytes
    tail = bytearray()
    if frame.end_of_layer:
        tail += b"\x18\x01"                                      # field 3, bool
    if frame.checksum:
        tail += b"\x20" + _varint(frame.checksum)               # field 4, uint32
    inner_len = len(head) + n + len(tail)
    return b"".join((_TAG_FRAME, _varint(inner_len), head, frame.data, tail))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _skip(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(buf, pos)[1]
    if wire_type == _LEN:
        n, pos = _read_varint(buf, pos)
        return pos + n
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"unsupported wire type {wire_type}")


def _decode_frame(buf: memoryview) -> Frame:
    layer_index, data, end, crc = 0, buf[0:0], False, 0
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field == 1 and wire_type == _VARINT:
            layer_index, pos = _read_varint(buf, pos)
        elif field == 2 and wire_type == _LEN:
            n, pos = _read_varint(buf, pos)
            data = buf[pos:pos + n]
            pos += n
        elif field == 3 and wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            end = bool(value)
        elif field == 4 and wire_type == _VARINT:
            crc, pos = _read_varint(buf, pos)
            crc &= 0xFFFFFFFF
        else:
            pos = _skip(buf, pos, wire_type)
    if pos != len(buf):
        raise ValueError("truncated LayerFrame")
    return Frame(layer_index, data, end, crc)


def _decoder(message_class):
    def decode(raw: bytes):
        # A frame message is exactly one field-2 record; anything else goes to protobuf.
        buf = memoryview(raw)
        if raw[:1] == _TAG_FRAME:
            try:
                n, pos = _read_varint(buf, 1)
                if pos + n == len(buf):
                    return _decode_frame(buf[pos:])
            except (ValueError, IndexError):
                pass
        return message_class.FromString(raw)
    return decode


def encode_message(message) -> bytes:
    return encode_frame(message) if isinstance(message, Frame) else message.SerializeToString()


decode_put_request = _decoder(pb.PutRequest)
decode_get_response = _decoder(pb.GetResponse)
