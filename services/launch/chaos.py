"""``tessera chaos``: a bounded soak that SIGKILLs workers, store shards and retrieval index services while clients
send prompts.

What a soak checks (``SoakReport.ok``):
- every completed greedy output equals its fault-free reference, computed beforehand by an ``Engine`` in
  this process on the same model with the same recompute ratio: a kill may fail a request (UNAVAILABLE
  while an actor restarts), never change its tokens;
- every chunk the cluster acknowledged as stored (``RegisterChunks`` answered ``stored=True``, before or
  during the soak) is still found by the store's Lookup afterwards and is served by its ``ChunkId``;
- the cluster serves again after each kill (a request completes after it) and the killed actor came back.

The killer takes the allowed roles in turn, in a seeded shuffled order (every role is hit within
``len(roles)`` kills), an actor of that role at random, and kills the next one only after the last is back:
a new pid, and the gateway seeing every worker healthy. Intervals are exponential around ``kill_every_s``,
clamped to [0.25, 3] times it; everything random is drawn from ``seed``. Loopback only: ``os.kill`` needs
the actors on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROLES = ("prefill", "decode", "store", "gateway", "index")


@dataclass(frozen=True, slots=True)
class SoakSettings:
    """One soak. ``duration_s`` (seconds of kills and requests; 60 when neither is given) or ``requests``
    (generate requests sent) bounds it, and so does ``max_kills`` (the last of them back); after that the killer stops
    and clients go on until a request completes after the last kill (at most ``settle_timeout_s``)."""

    duration_s: float | None = None
    requests: int | None = None
    concurrency: int = 2                    # client threads
    kill_every_s: float = 8.0               # mean seconds from an actor's return to the next kill
    max_kills: int | None = None            # None: as many as the duration allows; else the soak ends once they are
    roles: tuple[str, ...] = ("prefill", "decode", "store")
    seed: int = 0
    max_new_tokens: int = 8
    prompts: int = 24                       # each 2-3 documents of the pool and a 1-4 token suffix
    docs: int = 12
    doc_tokens: int = 64
    registered: int = 4                     # documents registered first, then sent by ChunkId
    register_share: float = 0.1             # share of client operations that register a fresh document
    # share of generate requests decoded by retrieval (the decode worker's index service), retrieving every key so
    # that the tokens are dense decoding's: a killed index service may fail such a request, never change it
    retrieval_share: float = 0.0
    recompute_ratio: float = 0.15           # fixed: the loading controller would follow measured timings
    request_timeout_s: float = 60.0
    restart_timeout_s: float = 120.0        # how long a killed actor may take to come back
    settle_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.duration_s is None and self.requests is None:
            object.__setattr__(self, "duration_s", 60.0)
        if self.duration_s is not None and self.requests is not None:
            raise ValueError("give one of duration_s and requests, not both")
        if self.duration_s is not None and not 0 < self.duration_s <= 24 * 3600:
            raise ValueError(f"duration_s must be in (0, 86400], got {self.duration_s}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if not 1 <= self.concurrency <= 64:
            raise ValueError(f"concurrency must be in [1, 64], got {self.concurrency}")
        if not self.kill_every_s > 0:
            raise ValueError(f"kill_every_s must be > 0, got {self.kill_every_s}")
        if self.max_kills is not None and self.max_kills < 0:
            raise ValueError(f"max_kills must be >= 0, got {self.max_kills}")
        unknown = [r for r in self.roles if r not in ROLES]
        if not self.roles or unknown or len(set(self.roles)) != len(self.roles):
            raise ValueError(f"roles must be distinct names among {', '.join(ROLES)}, got {list(self.roles)}")
        if min(self.max_new_tokens, self.prompts, self.docs, self.doc_tokens) < 1:
            raise ValueError("max_new_tokens, prompts, docs and doc_tokens must be >= 1")
        if not 0 <= self.registered <= self.docs:
            raise ValueError(f"registered must be in [0, docs={self.docs}], got {self.registered}")
        if not 0.0 <= self.register_share < 1.0:
            raise ValueError(f"register_share must be in [0, 1), got {self.register_share}")
        if not 0.0 <= self.retrieval_share <= 1.0:
            raise ValueError(f"retrieval_share must be in [0, 1], got {self.retrieval_share}")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if min(self.request_timeout_s, self.restart_timeout_s, self.settle_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")


@dataclass(frozen=True, slots=True)
class SoakTarget:
    """What a soak needs of a running cluster: its gateway, model, actors (name -> Ray handle), store shard
    addresses and certificates directory (the store is looked up as role prefill; None: plain channels)."""

    gateway: str
    model_dir: str
    actors: dict
    stores: tuple[str, ...]
    certs_dir: str | None
    dtype: str = "float32"

    @classmethod
    def of(cls, cluster) -> SoakTarget:
        """An ``on_ray.Cluster`` started by this process."""
        cfg = cluster.config
        stores = tuple(cluster.addresses[n] for n in cluster.names.get("store", ()))
        certs = (cfg.certs_dir or cluster.certs_scratch) if cfg.internal_tls else None
        return cls(cluster.gateway_address, cfg.model_dir, dict(cluster.actors), stores, certs, cfg.dtype)

    @classmethod
    def find(cls, gateway: str, model_dir: str, namespace: str = "tessera", certs_dir: str | None = None,
             dtype: str = "float32") -> SoakTarget:
        """A cluster another process started (``tessera up``), found by its actors' names; Ray must be initialised."""
        import ray

        from services.launch.on_ray import find_actors

        actors = find_actors(namespace)
        stores = tuple(ray.get(actors[n].address.remote(), timeout=30) for n in sorted(actors) if _role(n) == "store")
        return cls(gateway, model_dir, actors, stores, certs_dir, dtype)


def _role(name: str) -> str:
    return name.split("-")[1]       # tessera-<role>[-<i>]


@dataclass(slots=True)
class Kill:
    role: str
    name: str
    at_s: float                             # seconds since the soak started
    restarted_after_s: float | None = None  # None: it did not come back within restart_timeout_s
    served_after: bool = False              # a request completed after the kill


@dataclass(slots=True)
class SoakReport:
    settings: dict
    sent: int = 0
    completed: int = 0
    retrieval_completed: int = 0            # of them, decoded by retrieval
    failed: dict[str, int] = field(default_factory=dict)            # status code -> requests
    failure_examples: list[str] = field(default_factory=list)       # the first few, at seconds into the soak
    kills: list[Kill] = field(default_factory=list)
    mismatches: int = 0
    mismatch_examples: list[dict] = field(default_factory=list)     # the first few, with the workers that served
    registrations: int = 0                  # chunks sent to RegisterChunks
    acknowledged: int = 0                   # of them, answered stored=True
    registrations_failed: int = 0
    lost: list[str] = field(default_factory=list)   # acknowledged chunk ids not found or not served afterwards
    problems: list[str] = field(default_factory=list)   # the cluster not whole, a victim not answering, ...
    soak_s: float = 0.0                     # clients running
    wall_s: float = 0.0                     # references, registrations, soak and checks

    @property
    def kills_by_role(self) -> dict[str, int]:
        return dict(Counter(k.role for k in self.kills))

    @property
    def restarts(self) -> int:
        return sum(k.restarted_after_s is not None for k in self.kills)

    @property
    def ok(self) -> bool:
        return (self.mismatches == 0 and not self.lost and not self.problems and self.completed > 0
                and all(k.served_after and k.restarted_after_s is not None for k in self.kills))

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(kills_by_role=self.kills_by_role, restarts=self.restarts, lost_count=len(self.lost), ok=self.ok)
        return out

    def table(self) -> str:
        s = self.settings
        failed = ", ".join(f"{code} {n}" for code, n in sorted(self.failed.items())) or "0"
        by_role = ", ".join(f"{r} {n}" for r, n in sorted(self.kills_by_role.items())) or "none"
        rows = [("soak", f"{self.soak_s:.1f} s of {self.wall_s:.1f} s (seed {s['seed']}, {s['concurrency']} clients, "
                         f"roles {','.join(s['roles'])})"),
                ("requests sent", self.sent),
                ("completed", f"{self.completed} ({self.retrieval_completed} decoded by retrieval)"),
                ("failed", failed),
                ("kills", f"{len(self.kills)} ({by_role})"), ("restarts observed", self.restarts),
                ("served after each kill", "yes" if all(k.served_after for k in self.kills) else "NO"),
                ("mismatches", self.mismatches),
                ("acknowledged chunks", f"{self.acknowledged} of {self.registrations} registered "
                                         f"({self.registrations_failed} registrations failed)"),
                ("acknowledged chunks lost", len(self.lost)), ("result", "OK" if self.ok else "FAILED")]
        lines = ["chaos soak"] + [f"  {label:<26} {value}" for label, value in rows]
        for k in self.kills:
            back = "not back" if k.restarted_after_s is None else f"back after {k.restarted_after_s:.1f} s"
            lines.append(f"    {k.at_s:7.1f} s  kill {k.name:<20} {back}{'' if k.served_after else ', nothing served after'}")
        for f in self.failure_examples:
            lines.append(f"    failed at {f}")
        for p in self.problems:
            lines.append(f"    PROBLEM {p}")
        for m in self.mismatch_examples:
            lines.append(f"    MISMATCH {m}")
        if self.lost:
            lines.append(f"    LOST {', '.join(cid[:16] for cid in self.lost)}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _Prompt:
    chunks: tuple                           # token lists or ChunkIds, as sent
    suffix: tuple[int, ...]
    want: tuple[int, ...]                   # the fault-free greedy output


class _Tally:
    """What clients and the killer record, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = self.completed = self.mismatches = self.registrations = self.registrations_failed = 0
        self.retrieval_completed = 0
        self.failed: Counter = Counter()
        self.failures: list[str] = []
        self.examples: list[dict] = []
        self.last_done = float("-inf")      # monotonic time of the last completed request
        self.acknowledged: dict[str, list[int]] = {}    # chunk id -> tokens

    def fail(self, code: str, what: str) -> None:
        with self.lock:
            self.failed[code] += 1
            if len(self.failures) < 5:
                self.failures.append(what)

    def done(self, prompt: _Prompt, got, at: float | None, retrieval: bool = False) -> None:
        """A completed request (``at`` None: a check after the soak, not counted as served)."""
        with self.lock:
            if at is not None:
                self.completed += 1
                self.retrieval_completed += retrieval
                self.last_done = max(self.last_done, at)
            if tuple(got.token_ids) != prompt.want:
                self.mismatches += 1
                if len(self.examples) < 5:
                    self.examples.append({"want": list(prompt.want), "got": list(got.token_ids),
                                          "prefill": got.stats and got.stats.prefill_worker,
                                          "decode": got.stats and got.stats.decode_worker})


def _documents(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]     # byte ids: no special tokens


def _reference(target: SoakTarget):
    from services.engine import Engine

    return Engine.load(target.model_dir, dtype=target.dtype, kv_cache_bytes=64 << 20)


def _generate(engine, chunks, suffix, s: SoakSettings) -> tuple[int, ...]:
    return tuple(engine.generate([list(c) for c in chunks], list(suffix), max_new_tokens=s.max_new_tokens,
                                 recompute_ratio=s.recompute_ratio, stop_token_ids=[]))


RETRIEVE_ALL = dict(decode="retrieval", retrieval_k=4096, sink_tokens=4, window_tokens=8)   # every key of a prompt


def _complete(client, prompt: _Prompt, s: SoakSettings, retrieval: bool = False):
    return client.complete(list(prompt.chunks), list(prompt.suffix), max_new_tokens=s.max_new_tokens,
                           recompute_ratio=s.recompute_ratio, stop_token_ids=[], timeout=s.request_timeout_s,
                           **(RETRIEVE_ALL if retrieval else {}))


def _wait(check, timeout_s: float, every_s: float = 0.5):
    """``check()``'s first truthy value within ``timeout_s`` (exceptions count as not yet), else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception:  # noqa: BLE001 - an actor coming back refuses calls for a while
            pass
        time.sleep(every_s)
    return None


def _pid(handle, timeout_s: float) -> int | None:
    import ray

    return _wait(lambda: ray.get(handle.pid.remote(), timeout=10), timeout_s)


def _whole(client, target: SoakTarget, timeout_s: float) -> bool:
    """Every actor answers and the gateway sees every worker healthy."""
    deadline = time.monotonic() + timeout_s
    if any(_pid(h, max(deadline - time.monotonic(), 0.1)) is None for h in target.actors.values()):
        return False
    return bool(_wait(lambda: all(w.healthy for w in client.stats(timeout=10).workers),
                      max(deadline - time.monotonic(), 0.1)))


def run_soak(target, settings: SoakSettings, *, model_dir: str | None = None, namespace: str = "tessera",
             certs_dir: str | None = None, say=lambda _m: None) -> SoakReport:
    """Soak ``target``: an ``on_ray.Cluster``, a ``SoakTarget``, or a gateway address (then ``model_dir``,
    the cluster's Ray ``namespace`` and ``certs_dir`` find the rest; Ray must be initialised)."""
    from services.sdk import ChunkId, Client

    if isinstance(target, str):
        if model_dir is None:
            raise ValueError("a gateway address needs model_dir: the reference outputs are computed here")
        target = SoakTarget.find(target, model_dir, namespace, certs_dir)
    elif not isinstance(target, SoakTarget):
        target = SoakTarget.of(target)
    s = settings
    t0 = time.monotonic()
    report = SoakReport(settings=asdict(s))
    tally = _Tally()
    rng = random.Random(s.seed)
    docs = _documents(rng, s.docs, s.doc_tokens)
    say(f"computing {s.prompts} reference outputs in this process")
    engine = _reference(target)
    with Client(target.gateway, timeout=s.request_timeout_s) as client:
        client.wait_ready(s.request_timeout_s)
        regs = client.register_chunks(docs[:s.registered]) if s.registered else []
        tally.acknowledged.update((r.chunk_id, docs[i]) for i, r in enumerate(regs) if r.stored)
        tally.registrations = len(regs)
        sent_as = [ChunkId(r.chunk_id) for r in regs] + [tuple(d) for d in docs[s.registered:]]
        prompts = []
        for _ in range(s.prompts):
            picked = rng.sample(range(s.docs), rng.choice((2, 3)))
            suffix = tuple(rng.randrange(256) for _ in range(rng.randint(1, 4)))
            prompts.append(_Prompt(tuple(sent_as[d] for d in picked), suffix,
                                   _generate(engine, [docs[d] for d in picked], suffix, s)))
        if not _whole(client, target, s.settle_timeout_s):
            raise RuntimeError("the cluster is not whole before the soak: an actor does not answer or a worker is "
                               "unhealthy")
        stop, stop_killing, past_budget = threading.Event(), threading.Event(), threading.Event()
        say(f"soaking: {s.concurrency} clients, a kill every ~{s.kill_every_s:g} s among {', '.join(s.roles)}")
        started = time.monotonic()
        clients = [threading.Thread(target=_client_loop, name=f"chaos-client-{i}",
                                    args=(i, target, s, prompts, tally, stop, past_budget, started))
                   for i in range(s.concurrency)]
        killer = threading.Thread(target=_killer, name="chaos-killer",
                                  args=(target, s, report, client, started, stop_killing))
        for t in (*clients, killer):
            t.start()
        killed = lambda: s.max_kills is not None and not killer.is_alive()   # noqa: E731 - every kill made, back
        if s.duration_s is not None:
            _wait(lambda: stop.is_set() or killed(), s.duration_s, 0.1)
        else:
            _wait(lambda: tally.sent >= s.requests or not any(t.is_alive() for t in clients) or killed(), 24 * 3600,
                  0.1)
        stop_killing.set()
        killer.join(s.restart_timeout_s + 60)
        # clients go on until the cluster served a request after the last kill
        past_budget.set()
        last_kill = started + max((k.at_s for k in report.kills), default=0.0)
        _wait(lambda: tally.last_done > last_kill, s.settle_timeout_s, 0.1)
        stop.set()
        deadline = time.monotonic() + s.request_timeout_s + 10
        for t in clients:
            t.join(max(deadline - time.monotonic(), 0.1))
        report.soak_s = round(time.monotonic() - started, 2)
        for k in report.kills:
            k.served_after = tally.last_done > started + k.at_s
        say("checking that every acknowledged chunk is still stored and served")
        if not _whole(client, target, s.settle_timeout_s):
            report.problems.append("after the soak, an actor does not answer or a worker is unhealthy")
        report.lost = _lost(client, engine, target, tally, s)
    report.sent, report.completed, report.mismatches = tally.sent, tally.completed, tally.mismatches
    report.retrieval_completed = tally.retrieval_completed
    report.failed, report.failure_examples = dict(tally.failed), tally.failures
    report.mismatch_examples = tally.examples
    report.registrations, report.registrations_failed = tally.registrations, tally.registrations_failed
    report.acknowledged = len(tally.acknowledged)
    report.wall_s = round(time.monotonic() - t0, 2)
    return report


def _client_loop(i: int, target: SoakTarget, s: SoakSettings, prompts: list[_Prompt], tally: _Tally,
                 stop: threading.Event, past_budget: threading.Event, started: float) -> None:
    from services.sdk import Client, TesseraError

    rng = random.Random(f"{s.seed}/client/{i}")
    with Client(target.gateway, timeout=s.request_timeout_s) as client:
        while not stop.is_set():
            if rng.random() < s.register_share:
                doc = _documents(rng, 1, s.doc_tokens)[0]
                with tally.lock:
                    tally.registrations += 1
                try:
                    [reg] = client.register_chunks([doc], timeout=s.request_timeout_s)
                except TesseraError:
                    with tally.lock:
                        tally.registrations_failed += 1
                    continue
                if reg.stored:
                    with tally.lock:
                        tally.acknowledged[reg.chunk_id] = doc
                continue
            with tally.lock:
                if s.requests is not None and tally.sent >= s.requests and not past_budget.is_set():
                    return
                tally.sent += 1
            prompt = rng.choice(prompts)
            retrieval = rng.random() < s.retrieval_share
            try:
                got = _complete(client, prompt, s, retrieval)
            except Exception as exc:  # noqa: BLE001 - counted by its code (a TesseraError) or type: the report shows it
                tally.fail(getattr(exc, "code", type(exc).__name__), f"{time.monotonic() - started:.1f} s: {exc}")
            else:
                tally.done(prompt, got, time.monotonic(), retrieval)


def _killer(target: SoakTarget, s: SoakSettings, report: SoakReport, client, t0: float,
            stop: threading.Event) -> None:
    kills = report.kills
    rng = random.Random(f"{s.seed}/killer")
    by_role = {r: sorted(n for n in target.actors if _role(n) == r) for r in s.roles}
    order = [r for r in s.roles if by_role[r]]
    rng.shuffle(order)
    while order and (s.max_kills is None or len(kills) < s.max_kills):
        pause = min(max(rng.expovariate(1 / s.kill_every_s), 0.25 * s.kill_every_s), 3 * s.kill_every_s)
        if stop.wait(pause):
            return
        role = order[len(kills) % len(order)]
        name = rng.choice(by_role[role])
        handle = target.actors[name]
        pid = _pid(handle, s.restart_timeout_s)
        if pid is None:
            report.problems.append(f"{name} did not answer before its kill")
            return
        if stop.is_set():
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:          # it died by itself meanwhile: Ray restarts it anyway
            report.problems.append(f"{name} (pid {pid}) was gone before its kill")
            return
        at = time.monotonic()
        kill = Kill(role, name, round(at - t0, 2))
        kills.append(kill)
        back = _wait(lambda: _pid(handle, 15) not in (None, pid), s.restart_timeout_s)
        if back and role != "store":
            back = _wait(lambda: all(w.healthy for w in client.stats(timeout=10).workers), s.restart_timeout_s)
        if not back:
            return                          # a cluster that did not recover: no further kill
        kill.restarted_after_s = round(time.monotonic() - at, 2)


def _lost(client, engine, target: SoakTarget, tally: _Tally, s: SoakSettings) -> list[str]:
    """Acknowledged chunk ids that the store's Lookup does not find or that their ChunkId does not serve."""
    from services.kvstore import ShardedKVStoreClient
    from services.sdk import ChunkId

    ids = sorted(tally.acknowledged)
    lost: set[str] = set()
    if ids and target.stores:
        from services.cluster.security import ClusterTLS

        tls = ClusterTLS.load(target.certs_dir, "prefill") if target.certs_dir else None
        with ShardedKVStoreClient(list(target.stores), timeout=10, tls=tls) as store:
            found = _wait(lambda: store.lookup(ids), s.settle_timeout_s)
        lost.update(ids if found is None else [loc.chunk_id for loc in found if not loc.found])
    prompts = {cid: _Prompt((ChunkId(cid),), (1,), _generate(engine, [tally.acknowledged[cid]], (1,), s)) for cid in ids}
    deadline = time.monotonic() + s.settle_timeout_s       # every chunk is tried once, however late

    def serve(cid: str) -> None:
        got = _wait(lambda: _complete(client, prompts[cid], s), max(deadline - time.monotonic(), 0.01), 1.0)
        if got is None:
            lost.add(cid)
        else:
            tally.done(prompts[cid], got, None)

    with ThreadPoolExecutor(s.concurrency, thread_name_prefix="chaos-check") as pool:
        list(pool.map(serve, ids))
    return sorted(lost)


def soak_local(settings: SoakSettings, prefill: int = 2, decode: int = 2, stores: int = 1, say=print) -> SoakReport:
    """Start a cluster of the tiny model on a local Ray instance, soak it, stop it."""
    import logging
    import tempfile

    from services.cluster.config import ClusterConfig, PrefillSettings
    from services.launch.on_ray import local_cluster
    from services.engine.model.tiny import write_tiny

    logging.getLogger("ray").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="tessera-chaos-") as tmp:
        model = write_tiny(Path(tmp) / "tiny-llama")
        # restarts always (-1): the soak kills one actor several times; store-held chunks always streamed
        cfg = ClusterConfig(model_dir=str(model), prefill=prefill, decode=decode, stores=stores,
                            store_dir=str(Path(tmp) / "rocksdb"), kv_cache_bytes=64 << 20, max_restarts=-1,
                            namespace="tessera-chaos", prefill_settings=PrefillSettings(store_loads="always"))
        with local_cluster(cfg, progress=say) as cluster:
            return run_soak(cluster, settings, say=say)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chaos", help="soak a local cluster while SIGKILLing workers and store shards; check outputs and chunks",
        description="Start the tiny model's cluster on a local Ray instance, send prompts from concurrent clients "
                    "while an actor of the given roles is SIGKILLed at random intervals, and check that every "
                    "completed greedy output equals its fault-free reference and that no chunk the cluster "
                    "acknowledged as stored is lost. Exits 1 when a check fails.")
    p.add_argument("--duration-s", type=float, help="seconds of kills and requests (default 60)")
    p.add_argument("--requests", type=int, help="stop after this many requests instead of --duration-s")
    p.add_argument("--concurrency", type=int, default=2, help="client threads (default 2)")
    p.add_argument("--kill-every-s", type=float, default=8.0, help="mean seconds between kills (default 8)")
    p.add_argument("--max-kills", type=int, help="kill at most this many times (default: no limit)")
    p.add_argument("--roles", default="prefill,decode,store",
                   help=f"comma-separated roles that may be killed, among {','.join(ROLES)} (default prefill,decode,store)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, intervals and victims (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--retrieval-share", type=float, default=0.0,
                   help="share of requests decoded by retrieval through the index services, every key retrieved so "
                        "that the tokens are dense decoding's (default 0; kill the index role with --roles ...,index)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--stores", type=int, default=1, help="KV store shards (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the report here (JSON)")
    p.set_defaults(handler=_chaos)


def _chaos(args: argparse.Namespace) -> int:
    import sys

    settings = SoakSettings(duration_s=args.duration_s, requests=args.requests,
                            concurrency=args.concurrency, kill_every_s=args.kill_every_s, max_kills=args.max_kills,
                            roles=tuple(r.strip() for r in args.roles.split(",") if r.strip()), seed=args.seed,
                            max_new_tokens=args.max_new_tokens, retrieval_share=args.retrieval_share)
    t0 = time.monotonic()
    report = soak_local(settings, args.prefill, args.decode, args.stores,
                        say=lambda m: print(f"{time.monotonic() - t0:6.1f} s  {m}", file=sys.stderr))
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1
