"""Object-storage tier through boto3 (any S3-protocol server). Blocking; the store runs it in a thread.

One object per chunk, ``<prefix><chunk_id>``: a 4-byte little-endian length, the encoded metadata,
then every layer's K||V bytes in order. A single PUT makes the chunk appear whole or not at all.
A reader fetches the head (metadata) with one ranged GET and streams the requested layers with a
second, so layer 0 is served before the rest of the object has arrived.
"""

from __future__ import annotations

import struct

from services.kvstore.chunk import ChunkMeta, CorruptEntry, layer_parts
from services.kvstore.config import S3Config
from services.tiers import Tier

HEAD_PROBE = 64 << 10   # the metadata of a 32-layer chunk is ~1 KiB; one GET usually covers it


class S3Tier:
    name = Tier.S3

    def __init__(self, config: S3Config) -> None:
        import boto3
        from botocore.config import Config

        self._cfg = config
        self._s3 = boto3.client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            config=Config(retries={"max_attempts": 3, "mode": "standard"}, max_pool_connections=16),
        )
        if config.create_bucket:
            try:
                self._s3.head_bucket(Bucket=config.bucket)
            except self._s3.exceptions.ClientError:
                self._s3.create_bucket(Bucket=config.bucket)

    def _key(self, chunk_id: str) -> str:
        return self._cfg.prefix + chunk_id

    def write(self, meta: ChunkMeta, layers: tuple[bytes, ...]) -> None:
        head = meta.encode()
        body = b"".join((struct.pack("<I", len(head)), head, *(p for layer in layers for p in layer_parts(layer))))
        self._s3.put_object(Bucket=self._cfg.bucket, Key=self._key(meta.chunk_id), Body=body,
                            Metadata={"tessera-nbytes": str(meta.nbytes)})

    def _get(self, chunk_id: str, start: int, stop: int):
        """Body of bytes [start, stop) of the chunk's object, or None if there is no object."""
        try:
            resp = self._s3.get_object(Bucket=self._cfg.bucket, Key=self._key(chunk_id), Range=f"bytes={start}-{stop - 1}")
        except self._s3.exceptions.NoSuchKey:
            return None
        except self._s3.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "InvalidRange"):
                return None
            raise
        return resp["Body"]

    def open(self, chunk_id: str) -> "S3Reader | None":
        body = self._get(chunk_id, 0, HEAD_PROBE)
        if body is None:
            return None
        probe = body.read()
        if len(probe) < 4:
            raise CorruptEntry(f"s3 object of {chunk_id} is truncated")
        (head_len,) = struct.unpack_from("<I", probe)
        if 4 + head_len > len(probe):
            if head_len > 64 << 20:
                raise CorruptEntry(f"s3 object of {chunk_id} has an implausible header length")
            probe = self._get(chunk_id, 0, 4 + head_len).read()
        meta = ChunkMeta.decode(probe[4:4 + head_len])
        return S3Reader(self, meta, data_offset=4 + head_len)

    def nbytes(self, chunk_id: str) -> int | None:
        """Chunk size from the object's metadata, or None if absent (one HEAD request)."""
        try:
            resp = self._s3.head_object(Bucket=self._cfg.bucket, Key=self._key(chunk_id))
        except self._s3.exceptions.ClientError:
            return None
        return int(resp.get("Metadata", {}).get("tessera-nbytes", resp["ContentLength"]))

    def remove(self, chunk_id: str) -> None:
        self._s3.delete_object(Bucket=self._cfg.bucket, Key=self._key(chunk_id))

    def put_raw(self, chunk_id: str, body: bytes) -> None:
        """Overwrite a chunk's object (fault-injection tests only)."""
        self._s3.put_object(Bucket=self._cfg.bucket, Key=self._key(chunk_id), Body=body)

    def get_raw(self, chunk_id: str) -> bytes:
        return self._s3.get_object(Bucket=self._cfg.bucket, Key=self._key(chunk_id))["Body"].read()

    def scan(self) -> list[tuple[str, int]]:
        return []   # unbounded tier: nothing to account at start

    def close(self) -> None:
        self._s3.close()


class S3Reader:
    """Streams layers in increasing order from one ranged GET opened at the first layer asked."""

    def __init__(self, tier: S3Tier, meta: ChunkMeta, data_offset: int) -> None:
        self.meta = meta
        self._tier = tier
        self._offsets = [data_offset]
        for i in range(meta.num_layers):
            self._offsets.append(self._offsets[-1] + meta.layer_nbytes(i))
        self._body = None
        self._next = -1

    def layer(self, index: int) -> bytes | None:
        if self._body is None or index != self._next:
            if self._body is not None:
                self._body.close()
            self._body = self._tier._get(self.meta.chunk_id, self._offsets[index], self._offsets[-1])
            if self._body is None:
                return None
        want = self._offsets[index + 1] - self._offsets[index]
        data = self._body.read(want)
        self._next = index + 1
        return data

    def close(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None
