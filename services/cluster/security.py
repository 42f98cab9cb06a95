"""Mutual TLS between Tessera's services, from one cluster CA, and who may call what.

Every service (gateway, prefill and decode workers, store shards, retrieval index services, and the
tools an operator runs as ``admin``) holds a certificate of the cluster CA naming its role: the
subject's common name and its one DNS name are ``<role>.tessera.internal``. A server asks every
caller for a certificate of that CA (a caller without one fails the handshake and reaches nothing),
and a caller checks that the server is the role it meant to dial (``grpc.ssl_target_name_override``),
so a store cannot pose as a worker. What each role may call is ``POLICY``; ``RoleGuard``
(services/cluster/guard.py) enforces it.

``mint(directory)`` writes a development CA and one certificate per role (``tessera certs``; ``tessera
up`` does it for the embedded default). A real deployment brings its own: any CA whose certificates
carry those names, in the same file layout (``ca.pem``, ``<role>.pem``, ``<role>.key``; the Helm chart
mounts them from a Secret). Keys are written readable by their owner only.

NOTE: nothing here is hand-written crypto: certificates are made by ``cryptography`` and the handshake is
gRPC's own (BoringSSL).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

DOMAIN = "tessera.internal"
ROLES = ("gateway", "prefill", "decode", "store", "index", "admin")
CA_NAME = "Tessera cluster CA"

# method -> roles allowed to call it; a method of a cluster service not listed is refused
POLICY: dict[str, frozenset[str]] = {
    # a decode worker: a chunk's retrieval indexes only (the store checks what it writes: kvstore/server.py)
    "/tessera.kvstore.v1.KVStore/Put": frozenset({"prefill", "decode"}),
    "/tessera.kvstore.v1.KVStore/Delete": frozenset({"prefill", "decode"}),
    "/tessera.kvstore.v1.KVStore/Get": frozenset({"prefill", "decode"}),
    "/tessera.kvstore.v1.KVStore/Lookup": frozenset({"prefill", "decode"}),
    "/tessera.kvstore.v1.KVStore/Stats": frozenset({"prefill", "decode", "gateway", "admin"}),
    "/tessera.v1.PrefillWorker/Prefill": frozenset({"gateway"}),
    "/tessera.v1.PrefillWorker/Warm": frozenset({"gateway"}),
    "/tessera.v1.PrefillWorker/Reset": frozenset({"gateway"}),
    "/tessera.v1.PrefillWorker/Status": frozenset({"gateway", "admin"}),
    "/tessera.v1.DecodeWorker/PushHandoff": frozenset({"prefill"}),
    "/tessera.v1.DecodeWorker/Decode": frozenset({"gateway"}),
    "/tessera.v1.DecodeWorker/Reset": frozenset({"gateway"}),
    "/tessera.v1.DecodeWorker/Prefetch": frozenset({"gateway"}),
    "/tessera.v1.DecodeWorker/Status": frozenset({"gateway", "prefill", "admin"}),
    "/tessera.index.v1.RetrievalIndex/Offload": frozenset({"prefill", "decode"}),
    "/tessera.index.v1.RetrievalIndex/PutChunkIndex": frozenset({"prefill", "decode"}),
    "/tessera.index.v1.RetrievalIndex/Drop": frozenset({"prefill", "decode"}),
    "/tessera.index.v1.RetrievalIndex/Search": frozenset({"decode"}),
    "/tessera.index.v1.RetrievalIndex/Status": frozenset({"prefill", "decode", "gateway", "admin"}),
}
# health checks and reflection are open to any holder of a cluster certificate (services/cluster/guard.py)


def allowed_roles(method: str) -> frozenset[str]:
    """The roles that may call ``method`` ("/package.Service/Method"); empty: nobody."""
    return POLICY.get(method, frozenset())


def host_name(role: str) -> str:
    return f"{role}.{DOMAIN}"


def role_of(common_name: str) -> str | None:
    """The role a certificate's common name states, None when it states none."""
    role, dot, domain = common_name.partition(".")
    return role if dot and domain == DOMAIN and role in ROLES else None


@dataclass(frozen=True, slots=True)
class ClusterTLS:
    """One service's identity in the cluster: the CA's certificate, its own certificate chain and
    private key (PEM bytes) and its role. Travels in a service's spec, so a node needs no files."""

    ca: bytes
    cert: bytes
    key: bytes
    role: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; one of {', '.join(ROLES)}")
        for name in ("ca", "cert", "key"):
            if b"-----BEGIN" not in getattr(self, name):
                raise ValueError(f"the {name} of role {self.role} is not PEM")

    def __repr__(self) -> str:          # never print a key
        return f"ClusterTLS(role={self.role!r})"

    @classmethod
    def load(cls, directory: str | Path, role: str) -> ClusterTLS:
        """``ca.pem``, ``<role>.pem`` and ``<role>.key`` of ``directory``; FileNotFoundError naming what is missing."""
        d = Path(directory)
        files = {"ca": d / "ca.pem", "cert": d / f"{role}.pem", "key": d / f"{role}.key"}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"cluster certificates missing: {', '.join(missing)} (make them with "
                                    f"`tessera certs {d}`)")
        return cls(files["ca"].read_bytes(), files["cert"].read_bytes(), files["key"].read_bytes(), role)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with this certificate and require every caller's certificate of the cluster CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    @staticmethod
    def channel_options(peer_role: str) -> list[tuple[str, str]]:
        """The server must prove ``peer_role``: its certificate is checked against that role's name."""
        return [("grpc.ssl_target_name_override", host_name(peer_role))]


def bundle(directory: str | Path, roles=ROLES) -> dict[str, ClusterTLS]:
    """Every role's identity from ``directory`` (a ``mint`` output or a mounted Secret)."""
    return {role: ClusterTLS.load(directory, role) for role in roles}


def _private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by its owner only (created so: never world-readable for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def mint(directory: str | Path, roles=ROLES, days: int = 365, hosts: tuple[str, ...] = ()) -> Path:
    """A development CA and a certificate per role in ``directory`` (made with mode 0700): ``ca.pem``,
    ``ca.key``, ``<role>.pem``, ``<role>.key``. ``hosts``: extra DNS names or IP addresses every
    certificate also names (the role's own name is always there). Returns the directory."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _private(d / "ca.key", pem_key(ca_key))
    extra = []
    for h in hosts:
        try:
            extra.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            extra.append(x509.DNSName(h))
    for role in roles:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host_name(role))])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(host_name(role)), *extra]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (d / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _private(d / f"{role}.key", pem_key(key))
    return d


def identities(certs_dir: str | None, enabled: bool = True) -> tuple[dict[str, ClusterTLS] | None, str | None]:
    """What a launcher hands its services: every role's identity (None with mutual TLS off) and the
    temporary directory it minted them in when ``certs_dir`` is None (the caller removes it at stop)."""
    if not enabled:
        return None, None
    if certs_dir is not None:
        return bundle(certs_dir), None
    import tempfile

    made = tempfile.mkdtemp(prefix="tessera-certs-")
    return bundle(mint(made)), made
