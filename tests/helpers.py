"""Helpers of the services' tests (gateway, prefill, decode, cluster, launch, sdk, e2e, fuzz): prompts, in-process
services, bounded waits."""

from __future__ import annotations

import random
import time

MAX_POSITIONS = 1024     # the tests' tiny model: long enough for every prompt, short enough to exceed


def docs(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n random byte-token documents of ``length`` tokens (ids below 256: no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def wait_until(check, timeout_s: float = 120.0, every_s: float = 0.25, what: str = "condition"):
    """Poll ``check()`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the thing waited for may throw until it is up
            last_exc = exc
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


class InProcessCluster:
    """Store shard, prefill and decode workers and a gateway served from one loop thread here, talking
    mutual TLS with a development CA minted in ``store_dir/certs`` (``internal_tls=False``: plain)."""

    def __init__(self, model_dir: str, store_dir, token: str | None = None, internal_tls: bool = True,
                 decode_settings=None, tenants: dict | None = None) -> None:
        from services.cluster.config import DecodeSettings, EngineSettings, PrefillSettings
        from services.cluster.serving import LoopThread
        from services.decode.server import create_server as decode_server
        from services.gateway.server import create_server as gateway_server
        from services.kvstore import BackgroundServer, StoreConfig
        from services.prefill.server import create_server as prefill_server

        from services.cluster.security import bundle, mint

        self.certs = str(mint(store_dir / "certs")) if internal_tls else None
        ids = bundle(self.certs) if internal_tls else {}
        self.store = BackgroundServer(StoreConfig(dram_bytes=64 << 20, rocksdb_dir=str(store_dir / "shard")),
                                      tls=ids.get("store"))
        self.loop = LoopThread("test-cluster")
        engine = EngineSettings(model_dir, kv_cache_bytes=64 << 20)
        # store-held chunks are always streamed: these tests are about that path, whatever the timings
        self.prefill, pport = self.loop.run(prefill_server("prefill-0", engine, [self.store.address],
                                                           PrefillSettings(store_loads="always"),
                                                           cluster_tls=ids.get("prefill")))
        # the decode worker keeps what it reads from the store in a host tier (registered chunks are prefetched)
        self.decode, dport = self.loop.run(decode_server("decode-0", engine, [self.store.address],
                                                         decode_settings or DecodeSettings(host_cache_bytes=32 << 20),
                                                         cluster_tls=ids.get("decode")))
        self.workers = [("prefill-0", "prefill", f"127.0.0.1:{pport}"), ("decode-0", "decode", f"127.0.0.1:{dport}")]
        self.cluster_tls = ids.get("gateway")
        from services.gateway.tenants import Tenants

        self.gateway, gport = self.loop.run(gateway_server(model_dir, self.workers, token=token,
                                                           cluster_tls=self.cluster_tls,
                                                           tenants=Tenants.parse(tenants) if tenants else None))
        self.address = f"127.0.0.1:{gport}"
        self.token = token

    def stop(self) -> None:
        for server in (self.gateway, self.decode, self.prefill):
            self.loop.run(server.stop(0.5))
        self.loop.stop()
        self.store.stop()


def start_ray_cluster(model_dir: str, store_dir, namespace: str, **fields):
    """A Tessera cluster on the session's local Ray, in its own namespace."""
    from services.cluster.config import ClusterConfig, PrefillSettings
    from services.launch.on_ray import start_cluster

    fields.setdefault("prefill_settings", PrefillSettings(store_loads="always"))   # see InProcessCluster
    cfg = ClusterConfig(model_dir=model_dir, store_dir=str(store_dir), kv_cache_bytes=64 << 20, namespace=namespace,
                        **fields)
    return start_cluster(cfg)


def self_signed(tmp_path) -> tuple[bytes, bytes, str]:
    """(certificate PEM, key PEM, path of the certificate) for 127.0.0.1 / localhost, valid one day."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tessera-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    path = tmp_path / "cert.pem"
    path.write_bytes(cert_pem)
    return cert_pem, key_pem, str(path)
