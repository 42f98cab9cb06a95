"""``tessera kvstore serve``: run one store shard in the foreground."""

from __future__ import annotations

import argparse
import os

from services.kvstore.arena import SEGMENT_BYTES


def _size(text: str) -> int:
    """Bytes from '1073741824', '512M', '4G' or '1.5GiB' (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1] if s and s[-1] in units else ""
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512M, 4G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must not be negative: {text!r}")
    return int(value * units[unit])


def register(subparsers) -> None:
    kv = subparsers.add_parser("kvstore", help="chunk KV store (DRAM -> RocksDB -> S3)")
    sub = kv.add_subparsers(dest="kvstore_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser("serve", help="serve one store shard over gRPC until SIGTERM/SIGINT")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="gRPC port (0 picks a free one; printed at start)")
    p.add_argument("--dram-bytes", type=_size, required=True, help="DRAM tier budget, e.g. 8G")
    p.add_argument("--dram-dir", help="keep the DRAM tier as files in this directory of a memory file system "
                                      "(e.g. /dev/shm/tessera-store), read by workers on this host themselves")
    p.add_argument("--dram-segment-bytes", type=_size, default=SEGMENT_BYTES,
                   help="with --dram-dir: the size of the tier's arena segments, which workers on this host map and "
                        "register with CUDA once each (default 1G); 0: a file per chunk")
    p.add_argument("--nixl", action="store_true",
                   help="with --dram-dir: run a NIXL agent over the tier's arena, so that workers on other hosts read "
                        "chunks from this store's memory over NIXL (UCX) rather than the gRPC stream")
    p.add_argument("--rocksdb-dir", required=True, help="RocksDB directory (created if missing)")
    p.add_argument("--rocksdb-bytes", type=_size, default=16 << 30, help="RocksDB tier budget (default 16G)")
    p.add_argument("--s3-endpoint", help="S3 endpoint URL; credentials from AWS_* environment variables")
    p.add_argument("--s3-bucket", help="S3 bucket (created if missing)")
    p.add_argument("--s3-prefix", default="chunks/", help="key prefix inside the bucket")
    p.add_argument("--policy", choices=("lru", "s3fifo"), default="lru", help="eviction policy (default lru)")
    p.add_argument("--write-mode", choices=("through", "behind"), default="through",
                   help="through: ack after every tier holds the chunk; behind: ack after DRAM")
    p.add_argument("--rocksdb-sync", action="store_true", help="fsync the WAL on every put (power-loss safety)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve /metrics over HTTP on this port (0: any)")
    p.add_argument("--certs-dir", help="serve over mutual TLS with the cluster's certificates (ca.pem, store.pem, "
                                       "store.key: `tessera certs DIR`), callers authorized by role; without it, "
                                       "plain gRPC that anyone reaching the port may call")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(handler=_serve)


def _serve(args) -> int:
    import logging

    from services.kvstore.config import S3Config, StoreConfig
    from services.kvstore.server import serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if bool(args.s3_endpoint) != bool(args.s3_bucket):
        raise ValueError("--s3-endpoint and --s3-bucket go together")
    s3 = None
    if args.s3_bucket:
        s3 = S3Config(endpoint_url=args.s3_endpoint, bucket=args.s3_bucket, prefix=args.s3_prefix,
                      region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    config = StoreConfig(dram_bytes=args.dram_bytes, rocksdb_dir=args.rocksdb_dir, rocksdb_bytes=args.rocksdb_bytes,
                         s3=s3, policy=args.policy, write_mode=args.write_mode, rocksdb_sync=args.rocksdb_sync,
                         dram_dir=args.dram_dir, dram_segment_bytes=args.dram_segment_bytes,
                         nixl=args.nixl)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be within 0..65535, got {args.port}")
    tls = None
    if args.certs_dir:
        from services.cluster.security import ClusterTLS

        tls = ClusterTLS.load(args.certs_dir, "store")
    elif args.host not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger(__name__).warning("serving on %s without --certs-dir: any caller reaching it may write and "
                                            "read every chunk", args.host)
    serve(config, host=args.host, port=args.port, metrics_port=args.metrics_port, tls=tls)
    return 0
