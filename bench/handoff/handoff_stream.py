"""Host time of a hand-off's gRPC stream ends (services/handoff/transport.py), without a network: the sender's parts
(``handoff_parts``) and the receiver's reassembly and check (``receive_handoff``), against the previous receiver
(a buffer grown part by part, copied out, zlib's crc32 on the event loop) as the peer. A payload of the size of a
tessera@0.15 hand-off on Llama-3-8B (69 MiB: ~525 private tokens x 32 layers x 4 KB of K/V). Best of 5, ms.

    python3 bench/handoff/handoff_stream.py [--mib 69] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.handoff.transport import handoff_parts, receive_handoff  # noqa: E402
from services.rpc import tessera_pb2 as pb  # noqa: E402


async def grown_buffer(parts):
    """The receiver before: bytearray += each part, zlib.crc32 on the loop, bytes() out."""
    header, buf = None, bytearray()
    async for part in parts:
        if header is None:
            header = part.header
            continue
        buf += part.data
    if zlib.crc32(buf) != header.crc32:
        raise ValueError("bad crc32")
    return bytes(buf)


async def stream(parts):
    for p in parts:
        yield p


async def timed(receive, parts) -> float:
    t0 = time.perf_counter()
    out = await receive(stream(parts))
    dt = time.perf_counter() - t0
    del out  # (not returned: asyncio.run would hold the 69 MiB result)
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=69)
    ap.add_argument("--json")
    args = ap.parse_args()
    payload = os.urandom(args.mib << 20)
    send, rows = [], {}
    for _ in range(5):
        t0 = time.perf_counter()
        parts = list(handoff_parts(pb.HandoffHeader(request_id="r", kind="engine"), payload))
        send.append(time.perf_counter() - t0)
    rows["send (parts, crc32)"] = min(send) * 1e3
    for name, receive in (("receive, before (peer)", grown_buffer), ("receive", receive_handoff)):
        rows[name] = min(asyncio.run(timed(receive, parts)) for _ in range(5)) * 1e3
    for k, v in rows.items():
        print(f"{k:26s} {v:7.1f} ms  ({args.mib} MiB)")
    if args.json:
        Path(args.json).write_text(json.dumps({"mib": args.mib, "cpu": os.cpu_count(), "ms": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
