"""The Tessera client SDK: what users import.

    from services.sdk import Client, ChunkId
    with Client("127.0.0.1:50051") as c:
        ids = c.register_chunks(["a document", "another document"])
        for ev in c.generate(chunks=[ChunkId(ids[0].chunk_id), "fresh text"], suffix="Question?"):
            print(ev.text, end="")

``AsyncClient`` is the asyncio twin. Errors are ``TesseraError`` subclasses.
"""

from services.sdk.aio import AsyncClient
from services.sdk.client import Client
from services.sdk.errors import (DeadlineExceeded, InvalidArgument, PermissionDenied, ResourceExhausted, TesseraError,
                                 Unauthenticated, Unavailable)
from services.sdk.types import (ChunkId, ClusterStats, DecodeStats, GenerateEvent, GenerationStats, RegisteredChunk,
                                Shared, WorkerInfo)
from services.tiers import Tier

__all__ = ["Client", "AsyncClient", "ChunkId", "Shared", "GenerateEvent", "GenerationStats", "DecodeStats",
           "RegisteredChunk", "ClusterStats", "WorkerInfo", "Tier", "TesseraError", "InvalidArgument", "Unavailable",
           "DeadlineExceeded", "Unauthenticated", "ResourceExhausted", "PermissionDenied"]
