"""The gateway: the client API (``tessera.v1.Tessera``) over grpc.aio, and its async factory.

Generate: resolve the input (INVALID_ARGUMENT with the reason when it is bad), route to a prefill
worker by chunk residency and load and to a decode worker by load, prefill (the worker samples the
first token, which goes to the client at once, then pushes the hand-off to the decode worker), then
relay the decode worker's token stream. A worker that fails before the first token is sent is avoided
and the request is sent again (``max_attempts``). A worker that fails after tokens were sent: greedy
and seeded requests resume elsewhere (regenerated tokens are checked against those sent, then
skipped); unseeded sampling ends UNAVAILABLE, saying how far it got.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from services.modes import ROUTINGS
from services.cluster.sampling import write_sampling
from services.cluster.serving import add_health, advertised_host, bind, make_server, serve_metrics, set_serving
from services.gateway.auth import TenantAuth
from services.gateway.detok import Detokenizer
from services.gateway.inputs import (ChunkRegistry, Fresh, InputResolver, InvalidRequest, QuotaExceeded,
                                     ResolvedRequest, TextTokens)
from services.gateway.metrics import GatewayMetrics
from services.gateway.peers import Peers
from services.gateway.router import NoWorker, Router, WorkerView
from services.gateway.tenants import Tenant, Tenants, TenantUsage
from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tessera"].full_name
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED)
PASS_THROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED)
DEFAULT_DEADLINE_S = 300.0


class _Retry(Exception):
    """One attempt failed in a way another worker may not; ``code``: the worker's status."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


class _Relay:
    """The tokens of one attempt on their way to the client. A resumed attempt regenerates the tokens
    an earlier attempt sent: each is checked against what was sent, then skipped. Records TTFT/TPOT.
    ``detok`` makes the text of the fresh tokens (rebuilt from ``sent``: a resumed attempt repeats none)."""

    def __init__(self, rid: str, sent: list[int], arrival: float, metrics: GatewayMetrics, tokenizer=None) -> None:
        self.rid, self.sent, self.arrival, self.metrics = rid, sent, arrival, metrics
        self.detok = Detokenizer(tokenizer, sent)
        self.replay = list(sent)
        self.seen = 0
        self.sent_here = False
        self.last: float | None = None

    async def accept(self, tokens, context, worker: str) -> list[int]:
        """The tokens of ``tokens`` not sent yet (appended to ``sent``)."""
        fresh = []
        for tok in tokens:
            if self.seen < len(self.replay):
                if tok != self.replay[self.seen]:
                    await context.abort(grpc.StatusCode.ABORTED,
                                        f"request {self.rid} could not be resumed on worker {worker}: "
                                        f"token {self.seen} came out different")
            else:
                fresh.append(tok)
            self.seen += 1
        if fresh:
            now = time.perf_counter()
            if not self.sent:
                self.metrics.ttft.observe(now - self.arrival)
            elif self.last is not None:
                self.metrics.tpot.observe((now - self.last) / len(fresh))
            self.last = now
            self.sent.extend(fresh)
            self.sent_here = True
        return fresh


class GatewayServicer(pb_grpc.TesseraServicer):
    # RegisterChunks: chunks per Warm call; the decode workers read one group while the next is computed
    # (a group's last store write is not overlapped by a computation: larger groups lose less of that)
    REGISTER_GROUP = 4

    def __init__(self, resolver: InputResolver, router: Router, peers: Peers, metrics: GatewayMetrics,
                 model_name: str, metrics_url: str, max_attempts: int = 3, restart_wait_s: float = 60.0,
                 tenants: Tenants | None = None) -> None:
        self.resolver, self.router, self.peers, self.metrics = resolver, router, peers, metrics
        self.model_name, self.metrics_url, self.max_attempts = model_name, metrics_url, max_attempts
        self.restart_wait_s = restart_wait_s
        self.tenants = tenants if tenants is not None else Tenants.single(None)
        self.requests_total = 0
        self.usage: dict[str, TenantUsage] = {}     # tenant name -> its requests, in flight, chunk ids used

    def _tenant(self, context) -> Tenant:
        """The tenant the call's token names (TenantAuth let it in, so there is one)."""
        tenant = self.tenants.authenticate(context.invocation_metadata())
        assert tenant is not None, "TenantAuth admits only callers it can name"
        return tenant

    def _usage(self, tenant: Tenant) -> TenantUsage:
        return self.usage.setdefault(tenant.name, TenantUsage())

    @staticmethod
    def _remaining(context) -> float:
        left = context.time_remaining()
        return DEFAULT_DEADLINE_S if left is None else max(left, 0.01)

    async def _resolve(self, request: pb.GenerateRequest, tenant: Tenant, context) -> ResolvedRequest:
        """The request in token ids within its tenant's quotas, or the call ends with the reason."""
        try:
            # new chunk texts take milliseconds to tokenize: off the event loop, so other calls go on meanwhile
            if self.resolver.tokenizes(request.chunks, tenant):
                return await asyncio.to_thread(self.resolver.resolve, request, tenant)
            return self.resolver.resolve(request, tenant)
        except InvalidRequest as exc:
            self.metrics.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QuotaExceeded as exc:
            self.metrics.requests.labels("quota").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except PermissionError as exc:
            self.metrics.requests.labels("denied").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))

    async def Generate(self, request: pb.GenerateRequest, context):
        arrival = time.perf_counter()
        tenant = self._tenant(context)
        usage = self._usage(tenant)
        self.requests_total += 1
        usage.requests += 1
        req = await self._resolve(request, tenant, context)
        if usage.in_flight >= tenant.quotas.max_in_flight:
            self.metrics.requests.labels("quota").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"tenant {tenant.name} has {usage.in_flight} requests in flight, its quota "
                                f"max_in_flight ({tenant.quotas.max_in_flight})")
        try:
            usage.admit(tenant, req.chunk_ids, tuple(map(len, req.chunks)), req.namespaces)
        except QuotaExceeded as exc:
            self.metrics.requests.labels("quota").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        gone = self.router.gone()
        if gone:                  # fail fast: waiting for a restart that will not come only burns the deadline
            self.metrics.requests.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, gone)
        rid = request.request_id or uuid.uuid4().hex
        self.metrics.in_flight.inc()
        usage.in_flight += 1
        outcome = "error"
        try:
            last_error, last_code = "no attempt made", grpc.StatusCode.UNAVAILABLE
            avoid: set[str] = set()
            sent: list[int] = []          # tokens streamed to the client so far, over every attempt
            for attempt in range(self.max_attempts):
                if attempt:
                    await self._await_workers(context)
                try:
                    # a client-given id may repeat: the suffix keeps hand-offs of concurrent calls apart
                    attempt_id = f"{rid}.{uuid.uuid4().hex[:8]}.{attempt}"
                    async for msg in self._attempt(req, attempt_id, arrival, avoid, context, sent):
                        yield msg
                    outcome = "ok"
                    return
                except _Retry as exc:
                    last_error, last_code = str(exc), exc.code
                    log.warning("request %s attempt %d (%d tokens sent): %s", rid, attempt, len(sent), exc)
                except NoWorker as exc:
                    outcome = "unavailable"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            # every attempt failing inside a worker that answered is ours (INTERNAL, with the ids), not a
            # cluster without workers
            internal = last_code == grpc.StatusCode.INTERNAL
            outcome = "internal" if internal else "unavailable"
            await context.abort(grpc.StatusCode.INTERNAL if internal else grpc.StatusCode.UNAVAILABLE,
                                f"no worker could serve request {rid} in {self.max_attempts} attempts "
                                f"({len(sent)} tokens were sent): {last_error}")
        finally:
            usage.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome).inc()

    async def _await_workers(self, context) -> None:
        """Before a retry: a short pause, and while no worker of a role is healthy (the only one is
        restarting) wait for one, up to ``restart_wait_s`` and the call's deadline."""
        await asyncio.sleep(0.2)
        deadline = time.monotonic() + min(self.restart_wait_s, self._remaining(context) / 2)
        while not self.router.ready() and not self.router.gone() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def _attempt(self, req: ResolvedRequest, rid: str, arrival: float, avoid: set[str], context, sent):
        lens = tuple(map(len, req.chunks))
        p = self.router.pick_prefill(req.chunk_ids, lens, avoid)
        d = self.router.pick_decode(avoid, near=p)
        routed = time.perf_counter()
        relay = _Relay(rid, sent, arrival, self.metrics, self.resolver.tokenizer)
        # greedy and seeded requests are deterministic: after a failure they resume on other workers
        # (the tokens already sent are regenerated, checked and skipped); unseeded sampling cannot
        resumable = req.sampling.temperature == 0 or req.sampling.seed is not None
        stats, finish = None, ""
        sampling = write_sampling(req.sampling)
        try:
            preq = pb.PrefillRequest(request_id=rid, chunks=[pb.TokenIds(ids=c) for c in req.chunks],
                                     suffix=req.suffix, mode=req.mode, decode_address=d.address, sampling=sampling,
                                     chunk_namespaces=req.namespaces)
            if req.recompute_ratio is not None:
                preq.recompute_ratio = req.recompute_ratio
            if req.decode is not None:
                preq.decode.CopyFrom(req.decode)
            try:
                # first reply: the first token (sent to the client at once); second: the hand-off is at
                # the decode worker, with the stats
                async for reply in self.peers.prefill_stub(p).Prefill(preq, timeout=self._remaining(context)):
                    if reply.HasField("first_token"):
                        fresh = await relay.accept([reply.first_token], context, p.name)
                        if fresh:
                            yield pb.GenerateResponse(token_ids=fresh, text=relay.detok.push(fresh))
                    if reply.HasField("stats"):
                        stats, finish = reply.stats, reply.finish_reason
                        p.resident = frozenset(reply.resident_chunk_ids)
                if stats is None:
                    await context.abort(grpc.StatusCode.INTERNAL, f"prefill worker {p.name} ended request {rid} "
                                                                  "without its stats")
            except grpc.aio.AioRpcError as exc:
                await self._failed(exc, p, d, avoid, context, "prefill", relay.sent_here and not resumable)
            finally:
                self.router.done(p)
            stats.queue_seconds += routed - arrival
            self.metrics.queue.observe(stats.queue_seconds)
            if not finish:           # the first token did not end the request: the decode worker goes on
                try:
                    call = self.peers.decode_stub(d).Decode(
                        pb.DecodeRequest(request_id=rid, sampling=sampling, decode=req.decode),
                        timeout=self._remaining(context))
                    # a client that leaves frees the decode slot at once: this generator's own clean-up may
                    # wait for the garbage collector when the client leaves while it is parked at a yield
                    context.add_done_callback(lambda _ctx, c=call: c.cancel())
                    try:
                        async for msg in call:
                            fresh = await relay.accept(msg.token_ids, context, d.name)
                            if fresh:
                                yield pb.GenerateResponse(token_ids=fresh, text=relay.detok.push(fresh))
                            if msg.finish_reason:
                                finish = msg.finish_reason
                            if msg.HasField("stats"):
                                stats.decode.CopyFrom(msg.stats)
                    finally:
                        call.cancel()        # no-op once finished
                except grpc.aio.AioRpcError as exc:
                    await self._failed(exc, None, d, avoid, context, "decode", bool(sent) and not resumable)
        finally:
            self.router.done(d)
        self.metrics.e2e.observe(time.perf_counter() - arrival)
        self.metrics.output_tokens.inc(len(sent))
        for tier, n in stats.chunk_tokens_by_tier.items():
            self.metrics.chunk_tokens.labels(tier).inc(n)
        stats.prompt_tokens, stats.output_tokens = req.prompt_tokens, len(sent)
        stats.decode_worker = d.name
        stats.decode.policy = req.decode.name if req.decode is not None else "dense"
        stats.chunk_ids.extend(req.chunk_ids)
        # the text held back (a character the last tokens left incomplete) goes with the last message
        yield pb.GenerateResponse(text=relay.detok.flush(), finish_reason=finish or "length", stats=stats)

    async def _failed(self, exc: grpc.aio.AioRpcError, p: WorkerView | None, d: WorkerView, avoid: set[str],
                      context, stage: str, stranded: bool = False) -> None:
        """Answer a worker's failure: pass bad input through, or mark the worker and retry (``_Retry``);
        ``stranded``: tokens were sent and the request cannot be resumed, so it ends UNAVAILABLE."""
        code = exc.code()
        if code in PASS_THROUGH:
            await context.abort(code, exc.details())
        if code not in RETRYABLE:
            await context.abort(code, f"{stage} failed: {exc.details()}")
        # ABORTED from a prefill worker: its hand-off to the decode worker failed
        bad = d if (stage == "decode" or code == grpc.StatusCode.ABORTED) else p
        if stranded:
            self.peers.mark_down(bad)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{bad.role} worker {bad.name} failed after some tokens were sent "
                                f"({code.name}: {exc.details()}); the tokens sent are valid, the rest were not "
                                "produced, and unseeded sampling cannot be resumed: send it again")
        if code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INTERNAL):
            self.peers.mark_down(bad)       # it did not answer: an INTERNAL came from a worker that serves
        avoid.add(bad.name)
        self.metrics.retries.labels(bad.role).inc()
        raise _Retry(f"{bad.role} worker {bad.name}: {code.name}: {exc.details()}", code)

    async def RegisterChunks(self, request: pb.RegisterChunksRequest, context):
        tenant = self._tenant(context)
        try:
            if len(request.chunks) > tenant.quotas.max_chunks_per_request:
                raise QuotaExceeded(f"{len(request.chunks)} chunks is past tenant {tenant.name}'s quota "
                                    f"max_chunks_per_request ({tenant.quotas.max_chunks_per_request})")
            self.resolver.check_text(request.chunks, "", tenant)
            fresh = Fresh(await asyncio.to_thread(self.resolver.tokenize_chunks, request.chunks, tenant))
            parts = [self.resolver.chunk(c, f"chunk {i}", tenant, allow_id=False, fresh=fresh)
                     for i, c in enumerate(request.chunks)]
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QuotaExceeded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except PermissionError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        chunks = [p[0] for p in parts]
        namespaces = [p[1] for p in parts]
        if not chunks:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty request: no chunk to register")
        too_long = next((i for i, c in enumerate(chunks) if len(c) >= self.resolver.limit), None)
        if too_long is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {too_long} of {len(chunks[too_long])} tokens "
                                                                  f"is past the model's limit of {self.resolver.limit}")
        self.resolver.keep(fresh)
        ids = [self.resolver.chunk_id(c, ns) for c, ns in zip(chunks, namespaces)]
        try:
            self._usage(tenant).admit(tenant, ids, [len(c) for c in chunks], namespaces)
        except QuotaExceeded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        # In groups: the decode workers read a group's stored chunks (``_prefetch``) while the prefill
        # worker computes and stores the next group; the reply waits for every read.
        stored: list[bool] = []
        reads: list[asyncio.Task] = []
        try:
            for at in range(0, len(chunks), self.REGISTER_GROUP):
                group_ids, group = ids[at:at + self.REGISTER_GROUP], chunks[at:at + self.REGISTER_GROUP]
                group_ns = namespaces[at:at + self.REGISTER_GROUP]
                reply = await self._warm(group_ids, group, group_ns, context)
                for cid, c, ns in zip(group_ids, group, group_ns):
                    self.resolver.registry.add(cid, c, ns)
                stored += reply.stored
                new = [cid for cid, s in zip(group_ids, reply.stored) if s]
                if new:
                    reads.append(asyncio.ensure_future(self._prefetch(new, context)))
            await asyncio.gather(*reads)
        finally:
            for task in reads:
                task.cancel()           # no-op once done; a refused group stops the reads still going
        return pb.RegisterChunksResponse(chunks=[pb.RegisteredChunk(chunk_id=cid, num_tokens=len(c), stored=s)
                                                 for cid, c, s in zip(ids, chunks, stored)])

    async def _warm(self, ids: list[str], chunks: list[list[int]], namespaces: list[str], context) -> pb.WarmReply:
        """Compute and store ``chunks`` on a prefill worker (another one if it fails); aborts the call
        when none can."""
        avoid: set[str] = set()
        last = ""
        for _ in range(self.max_attempts):
            try:
                w = self.router.pick_prefill(tuple(ids), tuple(map(len, chunks)), avoid)
            except NoWorker as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            try:
                warm = pb.WarmRequest(chunks=[pb.TokenIds(ids=c) for c in chunks],
                                      chunk_namespaces=namespaces if any(namespaces) else ())
                reply = await self.peers.prefill_stub(w).Warm(warm, timeout=self._remaining(context))
            except grpc.aio.AioRpcError as exc:
                if exc.code() in PASS_THROUGH:
                    await context.abort(exc.code(), exc.details())
                self.peers.mark_down(w)
                avoid.add(w.name)
                last = f"{w.name}: {exc.code().name}: {exc.details()}"
                continue
            finally:
                self.router.done(w)
            w.resident = frozenset(reply.resident_chunk_ids)
            return reply
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no prefill worker could register the chunks: {last}")

    async def _prefetch(self, ids: list[str], context) -> None:
        """Have every decode worker read newly stored chunks into its host tier, so that their first
        requests find them there. Best effort: a worker that cannot is logged, not an error."""
        if not ids:
            return
        workers = [w for w in self.router.of_role("decode") if w.healthy]
        replies = await asyncio.gather(*[self.peers.decode_stub(w).Prefetch(pb.PrefetchRequest(chunk_ids=ids),
                                                                            timeout=self._remaining(context))
                                         for w in workers], return_exceptions=True)
        for w, r in zip(workers, replies):
            if isinstance(r, BaseException):
                log.warning("decode worker %s could not prefetch %d registered chunk(s): %s", w.name, len(ids), r)

    async def Stats(self, request, context):
        """The cluster as the caller's tenant may see it: the model and its limits, and its own requests and
        registered chunks; workers, every tenant's totals and the metrics URL for an admin token only."""
        tenant = self._tenant(context)
        transport = next((s.transport for s in self.peers.status.values() if s.transport), "grpc stream")
        cfg = self.resolver.cfg
        out = pb.StatsResponse(model=self.model_name, vocab_size=cfg.vocab_size,
                               max_position_embeddings=self.resolver.limit, transport=transport, tenant=tenant.name)
        if tenant.admin:
            out.workers.extend(pb.WorkerInfo(name=w.name, role=w.role, address=w.address, healthy=w.healthy,
                                             in_flight=w.in_flight, resident_chunks=len(w.resident),
                                             metrics_url=w.metrics_url) for w in self.router.workers.values())
            out.requests_total, out.registered_chunks = self.requests_total, len(self.resolver.registry)
            out.metrics_url = self.metrics_url
        else:
            out.requests_total = self._usage(tenant).requests
            out.registered_chunks = self.resolver.registry.count([tenant.namespace])
        return out

    async def ResetCaches(self, request, context):
        """An admin token drops every chunk on every worker (and store); another tenant's drops the chunks of its
        own namespace the gateway has seen it use (shared namespaces are not one tenant's to drop)."""
        tenant = self._tenant(context)
        ids: tuple[str, ...] = ()
        if not tenant.admin:
            ids = self._usage(tenant).take_ids()
            if not ids:
                return pb.ResetCachesResponse(chunks_dropped=0)
        reset = pb.ResetRequest(device_only=request.device_only, chunk_ids=ids)
        calls = [self.peers.prefill_stub(w).Reset(reset, timeout=30) for w in self.router.of_role("prefill")]
        calls += [self.peers.decode_stub(w).Reset(reset, timeout=30) for w in self.router.of_role("decode")]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{len(failed)} worker(s) could not reset: {failed[0]}")
        for w in self.router.workers.values():
            w.resident = w.resident - set(ids) if ids else frozenset()
        return pb.ResetCachesResponse(chunks_dropped=sum(r.chunks_dropped for r in replies))


class GatewayServer:
    def __init__(self, grpc_server, servicer: GatewayServicer, health, metrics_http) -> None:
        self.grpc_server, self.servicer, self.health, self._http = grpc_server, servicer, health, metrics_http

    async def stop(self, grace: float | None = 1.0) -> None:
        await set_serving(self.health, (SERVICE_NAME,), False)
        await self.grpc_server.stop(grace)
        await self.servicer.peers.close()
        self._http.shutdown()


async def create_server(model_dir: str, workers: list[tuple[str, str, str]], *, token: str | None = None,
                        tls: tuple[bytes, bytes] | None = None, registry: ChunkRegistry | None = None,
                        host: str = "127.0.0.1", port: int = 0, resolve=None,
                        ready_timeout_s: float = 120.0, text_cache_tokens: int = 8 << 20,
                        cluster_tls=None, tenants: Tenants | None = None,
                        routing: str = "residency") -> tuple[GatewayServer, int]:
    """Serve the client API on ``host:port`` (0: any) over ``workers`` [(name, role, address)];
    ``tls`` = (certificate chain PEM, private key PEM) serves it over TLS. Waits until the prefill
    workers report the model fingerprint. ``text_cache_tokens``: token ids of chunk texts kept for
    requests that send them again (0: every text tokenized every time). ``cluster_tls``: the gateway's
    ``ClusterTLS``: workers are called over mutual TLS (services/cluster/security.py). ``tenants``: who each
    bearer token is (services/gateway/tenants.py); None: one default tenant behind ``token`` (open without
    one). ``routing``: "residency" sends a request to the prefill worker holding most of its chunk tokens on its GPU
    (less a load penalty), "load" to the least loaded (services/gateway/router.py). Returns (server, port)."""
    if tenants is not None and token is not None:
        raise ValueError("give either a token or a tenants file: a tenants file names every token")
    tenants = tenants if tenants is not None else Tenants.single(token)
    metrics = GatewayMetrics()
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be {' or '.join(map(repr, ROUTINGS))}, got {routing!r}")
    router = Router(residency=routing == "residency")
    for name, role, address in workers:
        router.add(WorkerView(name, role, address))
    if not router.of_role("prefill") or not router.of_role("decode"):
        raise ValueError("the gateway needs at least one prefill and one decode worker")
    peers = Peers(router, metrics, resolve=resolve, cluster_tls=cluster_tls)
    fingerprint = await _fingerprint(peers, router, ready_timeout_s)
    resolver = await asyncio.to_thread(InputResolver, model_dir, fingerprint,
                                       registry if registry is not None else ChunkRegistry(),
                                       TextTokens(text_cache_tokens))
    http, http_port = serve_metrics(metrics.registry, host)
    from pathlib import Path

    servicer = GatewayServicer(resolver, router, peers, metrics, Path(model_dir).name,
                               f"http://{advertised_host(host)}:{http_port}/metrics", tenants=tenants)
    server = make_server("gateway", None, () if tenants.open else [TenantAuth(tenants, SERVICE_NAME)])
    pb_grpc.add_TesseraServicer_to_server(servicer, server)
    health = await add_health(server, (SERVICE_NAME,))
    bound = bind(server, host, port, tls)
    await server.start()
    await set_serving(health, (SERVICE_NAME,), True)
    peers.on_ready = lambda ok: set_serving(health, (SERVICE_NAME,), ok)    # NOT_SERVING with no worker of a role
    peers.start()
    log.info("gateway on %s:%d", host, bound)
    return GatewayServer(server, servicer, health, http), bound


async def _fingerprint(peers: Peers, router: Router, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        await peers.poll_once()
        fps = {s.model_fingerprint for s in peers.status.values()}
        if len(fps) > 1:
            raise ValueError(f"workers run different models: {sorted(fps)}")
        if fps and all(w.healthy for w in router.of_role("prefill")):
            return fps.pop()
        if time.monotonic() > deadline:
            raise TimeoutError("no prefill worker answered with its model fingerprint")
        await asyncio.sleep(0.2)
