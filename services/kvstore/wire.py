"""Hand-rolled (de)serialization of the bulk messages, byte-compatible with proto/kvstore.proto.

``PutRequest`` and ``GetResponse`` both carry a ``LayerFrame`` in field 2 of their oneof, and
nearly every byte of a chunk travels in those frames. Through the generated classes a frame is
copied three times per side in Python (slice, protobuf object, serialized string); here it is
copied once when encoded (``b"".join`` of the field prefixes and the payload, which may be a
memoryview into a tensor or a stored value) and not at all when decoded (the payload is a
memoryview into the received message). Any other message (headers) goes through protobuf, so
the wire format stays plain protobuf for other clients.

A store keeps a layer that fits one message as a ``FramedLayer``: the serialized ``GetResponse``
that carries the whole layer (one copy, made when the layer is stored), so a get hands the stored
``bytes`` to gRPC as they are, with no copy in Python, from DRAM and from RocksDB alike.

``Frame`` is what decoding yields for a frame message; a header message decodes to its
generated class (``pb.PutRequest`` / ``pb.GetResponse``).
"""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1 << 14)      # a stored layer's envelope is built once, checked on every read
def envelope(layer_index: int, nbytes: int, end_of_layer: bool, checksum: int, align: int = 1) -> tuple[bytes, bytes]:
    """The bytes before and after an ``nbytes`` payload in ``{PutRequest|GetResponse}.frame``
    (proto3: default-valued fields omitted). With ``align`` > 1 a ``padding`` field goes before
    the payload so that it starts at a multiple of ``align`` from the message's start."""
    index = b"\x08" + _varint(layer_index) if layer_index else b""     # field 1, varint
    data_key = b"\x12" + _varint(nbytes)                               # field 2, bytes
    tail = (b"\x18\x01" if end_of_layer else b"") + (b"\x20" + _varint(checksum) if checksum else b"")  # fields 3, 4
    # NOTE: one more padding byte usually makes the head one byte longer, but where the frame's length varint
    # gains a byte it makes it two longer, skipping one length (a 106-byte payload skipped 16): 2 * align
    # tries always pass a multiple of align (the padding stays under 128 bytes: its length is one byte)
    for k in range(-1, 2 * align + 8 if align > 1 else 0):             # padding bytes; -1: no field 5
        pad = b"" if k < 0 else b"\x2a" + bytes([k]) + bytes(k)
        fields = index + pad + data_key
        head = _TAG_FRAME + _varint(len(fields) + nbytes + len(tail)) + fields
        if len(head) % align == 0:
            return head, tail
    raise AssertionError("unreachable: a padding of 2 * align + 7 bytes or less always fits")


def encode_frame(frame: Frame) -> bytes:
    """Serialize as ``{PutRequest|GetResponse}.frame``."""
    n = len(frame.data) if isinstance(frame.data, bytes) else frame.data.nbytes
    head, tail = envelope(frame.layer_index, n, frame.end_of_layer, frame.checksum)
    return b"".join((head, frame.data, tail))


ALIGN = 16   # a CPython bytes object's data is 16-byte aligned, so the payload of a message is too


@dataclass(frozen=True, slots=True)
class FramedLayer:
    """A whole layer held as the message that carries it: ``message`` is a serialized
    ``GetResponse`` whose frame is (layer index, K||V bytes, end_of_layer, the layer's checksum);
    the K||V bytes are ``message[start:start + nbytes]``, ``start`` a multiple of ``ALIGN`` (a
    client can then view them as tensors of any dtype without copying)."""

    message: bytes
    start: int
    nbytes: int

    @property
    def payload(self) -> memoryview:
        return memoryview(self.message)[self.start:self.start + self.nbytes]


def frame_layer(layer_index: int, parts, checksum: int) -> FramedLayer:
    """Build the message of a whole layer from its K||V bytes (given as consecutive parts)."""
    nbytes = sum(memoryview(p).nbytes for p in parts)
    head, tail = envelope(layer_index, nbytes, True, checksum, ALIGN)
    return FramedLayer(b"".join((head, *parts, tail)), len(head), nbytes)


def read_framed_layer(message: bytes, layer_index: int, nbytes: int, checksum: int) -> FramedLayer | None:
    """``message`` as the whole-layer message of (layer_index, nbytes, checksum), or None when its
    envelope says anything else (another layer, size or checksum: a damaged or foreign record).
    The payload itself is not checked here."""
    head, tail = envelope(layer_index, nbytes, True, checksum, ALIGN)
    if len(message) != len(head) + nbytes + len(tail) or not message.startswith(head) or not message.endswith(tail):
        return None
    return FramedLayer(message, len(head), nbytes)


def received_layer(frame: Frame) -> FramedLayer | None:
    """A whole layer's frame as the message it was decoded from, when that message is laid out as a
    stored layer (``frame_layer``'s envelope: the client sends layers so); None otherwise (the
    layer came in pieces, or through protobuf). The store keeps that message as it is: no copy."""
    data = frame.data
    if not frame.end_of_layer or not isinstance(data, memoryview) or not isinstance(data.obj, bytes):
        return None
    return read_framed_layer(data.obj, frame.layer_index, data.nbytes, frame.checksum)


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
    """A ``Frame``, a protobuf message, or ``bytes`` already serialized (a ``FramedLayer.message``)."""
    if isinstance(message, bytes):
        return message
    return encode_frame(message) if isinstance(message, Frame) else message.SerializeToString()


decode_put_request = _decoder(pb.PutRequest)
decode_get_response = _decoder(pb.GetResponse)
