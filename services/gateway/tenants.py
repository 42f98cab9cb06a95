"""Tenants of the client API: who a bearer token is, which chunk namespaces it may use, its quotas.

A tenant's chunks live in its own namespace: a chunk's id is the content hash of (model, namespace, token
ids), so two tenants sending the same document get two ids, two copies of its KV, and nothing either
receives (stats, timing, Stats, Lookup, RegisterChunks) tells whether the other sent it. A namespace
declared ``shared`` (a public corpus) is one copy for every tenant allowed to read it, on purpose: a chunk
placed there is a hit for all of them. The default tenant of a cluster without a tenants file has the
plain namespace (the ids the engine computes without one).

The tenants file (YAML, or the same as JSON; a Kubernetes Secret mounted as a file)::

    shared: [public]                 # namespaces one copy serves for every tenant that may read them
    tenants:
      - name: acme
        tokens: [acme-token-1]       # bearer tokens naming this tenant (at least 16 characters each)
        reads: [public]              # shared namespaces its requests may place chunks in
        admin: false                 # true: cluster-wide Stats and ResetCaches
        quotas: {max_chunks_per_request: 64, max_prompt_tokens: 32768, max_new_tokens: 1024,
                 max_in_flight: 16, max_stored_chunk_tokens: 1048576}

A quota left out takes ``Quotas``' default; a limit past the model's own is the model's.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, slots=True)
class Quotas:
    """Per-tenant limits; a request past one is RESOURCE_EXHAUSTED, naming it. None: the model's limit."""

    max_chunks_per_request: int = 256        # each chunk is a lookup, maybe a computation and a store write
    max_chunk_tokens: int | None = None      # chunk tokens of one request (their KV bytes: tokens x bytes/token)
    max_stored_chunk_tokens: int | None = None   # tokens of the tenant's own chunks the cluster keeps for it
    max_prompt_tokens: int | None = None     # chunks and suffix of one request
    max_new_tokens: int | None = None        # tokens one request may generate
    max_in_flight: int = 256                 # the tenant's requests served at once
    max_text_bytes: int = 64 << 20           # chunk and suffix text of one request, before it is tokenized

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if type(value) is not int or value < 1:
                raise ValueError(f"quota {f.name} must be a positive integer, got {value!r}")

    @classmethod
    def read(cls, raw, where: str) -> Quotas:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: 'quotas' must be a mapping of quota names to limits")
        known = {f.name for f in fields(cls)}
        unknown = _unknown(raw, known)
        if unknown is not None:
            raise ValueError(f"{where}: unknown quota {unknown!r}; one of {', '.join(sorted(known))}")
        try:
            return cls(**raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Tenant:
    """``namespace``: where its own chunks live ("" only for the default tenant); ``reads``: the shared
    namespaces it may place chunks in."""

    name: str
    namespace: str
    reads: frozenset[str] = frozenset()
    admin: bool = False
    quotas: Quotas = field(default_factory=Quotas)

    def chunk_namespace(self, requested: str) -> str:
        """The namespace a chunk of this tenant's request goes to: its own (``requested`` empty) or a shared
        one it may read. PermissionError naming the namespace otherwise."""
        if not requested:
            return self.namespace
        if requested in self.reads:
            return shared_namespace(requested)
        raise PermissionError(f"tenant {self.name} may not use namespace {requested!r}"
                              + (f" (it reads {', '.join(sorted(self.reads))})" if self.reads else ""))

    def may_read(self, namespace: str) -> bool:
        """Whether a chunk stored under the effective ``namespace`` is this tenant's to use."""
        return namespace == self.namespace or any(namespace == shared_namespace(r) for r in self.reads)


def tenant_namespace(name: str) -> str:
    return f"tenant/{name}"


def shared_namespace(name: str) -> str:
    return f"shared/{name}"


DEFAULT = Tenant("default", "", admin=True)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _unknown(mapping: dict, known) -> object | None:
    """The first key of ``mapping`` not in ``known`` (keys of any types: YAML allows them), else None."""
    return next((k for k in mapping if not (isinstance(k, str) and k in known)), None)


class Tenants:
    """Bearer token -> tenant. ``open`` (no tokens at all): every caller is the default tenant."""

    def __init__(self, tenants: list[tuple[Tenant, list[str]]], shared: frozenset[str] = frozenset(),
                 anonymous: Tenant | None = None) -> None:
        self.shared = shared
        self.anonymous = anonymous
        self._by_digest: dict[bytes, Tenant] = {}
        self.by_name: dict[str, Tenant] = {}
        for tenant, tokens in tenants:
            if tenant.name in self.by_name:
                raise ValueError(f"tenant {tenant.name!r} is listed twice")
            self.by_name[tenant.name] = tenant
            if len(set(tokens)) < len(tokens):
                raise ValueError(f"tenant {tenant.name!r} lists one token twice")
            for token in tokens:
                d = _digest(token)
                if d in self._by_digest:
                    raise ValueError(f"a token of tenant {tenant.name!r} is also another tenant's")
                self._by_digest[d] = tenant

    @property
    def open(self) -> bool:
        return self.anonymous is not None

    @classmethod
    def single(cls, token: str | None) -> Tenants:
        """The cluster without a tenants file: the default tenant, behind ``token`` when one is given."""
        if token is None:
            return cls([], anonymous=DEFAULT)
        if not token:
            raise ValueError("an empty token would let everyone in")
        return cls([(DEFAULT, [token])])

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        return cls.load(path)[0]

    @classmethod
    def load(cls, path: str | Path) -> tuple[Tenants, dict]:
        """The tenants of a file and the mapping read from it (what a launcher hands the gateway); ValueError or
        FileNotFoundError naming the file."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"tenants file {p} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"tenants file {p}: not UTF-8 text") from None
        try:
            import yaml

            raw = yaml.safe_load(text) if p.suffix != ".json" else json.loads(text)
        except Exception as exc:  # noqa: BLE001 - yaml's and json's errors, named with the file
            raise ValueError(f"tenants file {p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None
        try:
            return cls.parse(raw, str(p)), raw
        except ValueError as exc:
            message = str(exc)
            raise ValueError(message if message.startswith(str(p)) else f"tenants file {p}: {message}") from None

    @classmethod
    def parse(cls, raw, where: str = "tenants") -> Tenants:
        if not isinstance(raw, dict) or not isinstance(raw.get("tenants"), list) or not raw["tenants"]:
            raise ValueError(f"{where}: needs a non-empty list under 'tenants'")
        unknown = _unknown(raw, {"tenants", "shared"})
        if unknown is not None:
            raise ValueError(f"{where}: unknown key {unknown!r}; 'tenants' and 'shared' are read")
        shared = raw.get("shared") or []
        if not isinstance(shared, list) or not all(isinstance(s, str) and NAME.fullmatch(s) for s in shared):
            raise ValueError(f"{where}: 'shared' must be a list of namespace names ({NAME.pattern})")
        out = []
        for i, t in enumerate(raw["tenants"]):
            at = f"{where}: tenant {i}"
            if not isinstance(t, dict):
                raise ValueError(f"{at}: must be a mapping")
            extra = _unknown(t, {"name", "tokens", "reads", "admin", "quotas"})
            if extra is not None:
                raise ValueError(f"{at}: unknown key {extra!r}")
            name = t.get("name")
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise ValueError(f"{at}: name must match {NAME.pattern}, got {name!r}")
            at = f"{where}: tenant {name}"
            tokens = t.get("tokens")
            if not isinstance(tokens, list) or not tokens or not all(isinstance(k, str) for k in tokens):
                raise ValueError(f"{at}: 'tokens' must be a non-empty list of strings")
            if any(len(k) < MIN_TOKEN_CHARS for k in tokens):
                raise ValueError(f"{at}: every token needs at least {MIN_TOKEN_CHARS} characters")
            reads = t.get("reads") or []
            if not isinstance(reads, list) or not all(isinstance(r, str) for r in reads):
                raise ValueError(f"{at}: 'reads' must be a list of shared namespace names")
            undeclared = sorted(set(reads) - set(shared))
            if undeclared:
                raise ValueError(f"{at}: reads {undeclared[0]!r}, which 'shared' does not declare")
            admin = t.get("admin", False)
            if type(admin) is not bool:
                raise ValueError(f"{at}: 'admin' must be true or false")
            out.append((Tenant(name, tenant_namespace(name), frozenset(reads), admin,
                               Quotas.read(t.get("quotas"), at)), tokens))
        return cls(out, frozenset(shared))

    def authenticate(self, metadata) -> Tenant | None:
        """The tenant the call's ``authorization: Bearer <token>`` names; the default tenant for an open
        cluster; None when the token is missing or names no one."""
        if self.anonymous is not None:
            return self.anonymous
        sent = dict(metadata or ()).get("authorization", "")
        sent = sent.decode() if isinstance(sent, bytes) else sent
        if not sent.startswith("Bearer "):
            return None
        # a lookup by the token's digest: its time says nothing of how much of a real token was matched
        return self._by_digest.get(_digest(sent[len("Bearer "):]))


class QuotaExceeded(Exception):
    """A request past one of its tenant's quotas; the message names it."""


class TenantUsage:
    """What the gateway keeps of one tenant: requests seen, in flight, and the chunks of its own namespace it has
    brought to the cluster, with their tokens (what its ResetCaches drops, and what max_stored_chunk_tokens
    bounds; the oldest forgotten past ``max_ids``)."""

    def __init__(self, max_ids: int = 1 << 16) -> None:
        self.requests = 0
        self.in_flight = 0
        self.max_ids = max_ids
        self.stored_tokens = 0
        self._ids: dict[str, int] = {}      # chunk id -> tokens

    def admit(self, tenant: Tenant, chunk_ids, chunk_tokens, namespaces) -> None:
        """Count the request's chunks of the tenant's own namespace as stored for it; QuotaExceeded, counting
        nothing, when the new ones would take it past ``max_stored_chunk_tokens``."""
        namespaces = namespaces or ("",) * len(chunk_ids)
        own = {cid: n for cid, n, ns in zip(chunk_ids, chunk_tokens, namespaces) if ns == tenant.namespace}
        new = sum(n for cid, n in own.items() if cid not in self._ids)
        limit = tenant.quotas.max_stored_chunk_tokens
        if new and limit is not None and self.stored_tokens + new > limit:
            raise QuotaExceeded(f"{new} new chunk tokens beside the {self.stored_tokens} the cluster keeps for tenant "
                                f"{tenant.name} are past its quota max_stored_chunk_tokens ({limit}); ResetCaches "
                                "drops them")
        for cid, n in own.items():
            if self._ids.pop(cid, None) is None:
                self.stored_tokens += n
            self._ids[cid] = n
        while len(self._ids) > self.max_ids:
            self.stored_tokens -= self._ids.pop(next(iter(self._ids)))

    def take_ids(self) -> tuple[str, ...]:
        ids, self._ids, self.stored_tokens = tuple(self._ids), {}, 0
        return ids
