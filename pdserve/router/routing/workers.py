"""The worker registry and its health checker.

A worker is eligible for new requests when it is healthy (its `GET /health` probes pass), its
circuit breaker lets requests through, and (prefill only) its bootstrap port is known.

A decode node contacts only the bootstrap servers on its allowlist, which the registry keeps
current: every decode probe sends it the bootstrap addresses of the prefill workers registered now
(PUT /bootstrap_servers, with the cluster secret), and a prefill probe that finds a decode node's
copy out of date sends it at once, so a prefill node is never eligible before the decode nodes know
it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import httpx

from pdserve.router.config import RouterConfig
from pdserve.router.cpu_affinity import FrontCores
from pdserve.router.metrics import RouterMetrics
from pdserve.router.routing.circuit import CircuitBreaker
from pdserve.router.routing.node_clients import NodeClients
from pdserve.router.routing.worker import Worker
from pdserve.router.tools.parsers import FORMATS
from pdserve.router.worker_spec import WorkerSpec

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")
ROLE_POLL_S = 0.2  # how often a role change asks the node whether its ranks flipped


class WorkerRegistry:
    """Owns the workers and the background health loop. All methods run on the app's event loop."""

    def __init__(self, cfg: RouterConfig, clients: NodeClients, metrics: RouterMetrics):
        self._cfg = cfg
        self._clients = clients
        self._metrics = metrics
        self._workers: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None
        self.cores = (
            FrontCores()
        )  # the router's threads follow same-host fronts (router/cpu_affinity.py)

    # --- membership -------------------------------------------------------------------------
    def add(self, spec: WorkerSpec) -> Worker:
        if spec.url in self._workers:
            raise ValueError(f"worker {spec.url} is already registered")
        worker = Worker(
            url=spec.url,
            role=spec.role,
            bootstrap_port=spec.bootstrap_port,
            breaker=CircuitBreaker(self._cfg.breaker),
            replica=spec.replica,
        )
        self._workers[spec.url] = worker
        self._report(worker)
        logger.debug("worker added: %s role=%s", spec.url, spec.role)
        return worker

    def remove(self, url: str) -> Worker:
        worker = self._workers.pop(url)  # KeyError: caller answers 404
        self._metrics.forget_worker(url, worker.role)
        self.cores.forget(url)
        logger.info("worker removed: %s", url)
        return worker

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens sent to the workers and not yet prefilled (the router's estimate)."""
        return sum(w.queued_prompt_tokens for w in self._workers.values())

    def eligible(self, role: str) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role and w.eligible()]

    def serving(self, model: str | None, role: str | None = None) -> list[Worker]:
        """Eligible workers (of `role`, or any) that take requests for `model`: those whose
        /server_info named it; every worker for the --served-model-name alias, for None, and while
        no worker has reported its model yet."""
        known = any(w.model for w in self._workers.values())
        everyone = model is None or not known or model == self._cfg.served_model_name
        return [
            w
            for w in self._workers.values()
            if (role is None or w.role == role) and w.eligible() and (everyone or w.model == model)
        ]

    def has_role(self, role: str) -> bool:
        return any(w.role == role for w in self._workers.values())

    def models(self) -> list[str]:
        names = {w.model for w in self._workers.values() if w.model}
        if self._cfg.served_model_name:
            names.add(self._cfg.served_model_name)
        return sorted(names)

    def max_context(self, model: str | None = None) -> int | None:
        """The smallest context of the workers (that serve `model`, if given)."""
        limits = [
            w.max_context
            for w in self._workers.values()
            if w.max_context
            and (model is None or w.model in (model, None) or model == self._cfg.served_model_name)
        ]
        return min(limits) if limits else None

    def tool_format(self, model: str | None) -> str | None:
        """The tool-call format of the workers that serve `model` (router/tools/parsers.py); None
        when they report none, or differ."""
        alias = model is None or model == self._cfg.served_model_name
        formats = {
            w.tool_format for w in self._workers.values() if w.model and (alias or w.model == model)
        }
        return formats.pop() if len(formats) == 1 else None

    def bootstrap_servers(self) -> list[str]:
        """'host:port' of every registered prefill worker whose bootstrap port is known."""
        return sorted(
            {
                f"{w.bootstrap_host}:{w.bootstrap_port}"
                for w in self._workers.values()
                if w.role == "prefill" and w.bootstrap_port is not None
            }
        )

    async def push_bootstrap_servers(self, worker: Worker, force: bool) -> bool:
        """Sends the decode `worker` the current allowlist (unless it has it and not `force`).
        Pushes to one worker are serialised, so the last one it receives is the newest list."""
        async with worker.push_lock:
            servers = self.bootstrap_servers()
            if not force and worker.pushed_servers == servers:
                return True
            try:
                resp = await self._clients.get(worker.url).put(
                    f"{worker.url}/bootstrap_servers",
                    json={"servers": servers},
                    timeout=self._cfg.health.timeout_s,
                )
            except httpx.HTTPError as exc:
                logger.debug("bootstrap allowlist to %s failed: %r", worker.url, exc)
                return False
            if resp.status_code != 200:
                logger.warning(
                    "decode node %s refused the bootstrap allowlist: %s %s",
                    worker.url,
                    resp.status_code,
                    resp.text[:200],
                )
                return False
            worker.pushed_servers = servers
            return True

    async def _push_to_decodes(self) -> None:
        decodes = [w for w in self._workers.values() if w.role == "decode"]
        if decodes:
            await asyncio.gather(*(self.push_bootstrap_servers(w, False) for w in decodes))

    def report(self, worker: Worker) -> None:
        """Refresh the worker's gauges (after a health or breaker change)."""
        if self._workers.get(worker.url) is worker:
            self._report(worker)

    def _report(self, worker: Worker) -> None:
        state = worker.breaker.state.name.lower()
        self._metrics.set_worker(worker.url, worker.role, worker.healthy, state)

    # --- health -----------------------------------------------------------------------------
    async def probe(self, worker: Worker) -> bool:
        """One health probe: `/server_info` while the worker's facts are unknown, then `/health`.
        Updates the worker's health by the configured thresholds; returns the probe's verdict."""
        ok = await self._probe_once(worker)
        if ok:
            worker.good_probes += 1
            worker.bad_probes = 0
            if not worker.healthy and (
                not worker.ever_healthy or worker.good_probes >= self._cfg.health.success_threshold
            ):
                # the first time is the start-up (the router's ready line counts the workers)
                log = logger.info if worker.ever_healthy else logger.debug
                worker.healthy = worker.ever_healthy = True
                log("worker healthy: %s", worker.url)
        else:
            worker.bad_probes += 1
            worker.good_probes = 0
            if worker.healthy and worker.bad_probes >= self._cfg.health.failure_threshold:
                worker.healthy = False
                logger.warning(
                    "worker unhealthy after %d failed probes: %s", worker.bad_probes, worker.url
                )
        self.report(worker)
        return ok

    async def _probe_once(self, worker: Worker) -> bool:
        timeout = self._cfg.health.timeout_s
        client = self._clients.get(worker.url)
        try:
            if (
                worker.model is None
                or worker.elastic  # its role can change: it follows the node's (`_follow`)
                or (worker.role == "prefill" and worker.bootstrap_port is None)
            ):
                resp = await client.get(f"{worker.url}/server_info", timeout=timeout)
                if resp.status_code == 200:
                    info = resp.json()
                    self._learn(worker, info)
                    if isinstance(info, dict):
                        await self._follow(worker, info)
                    # a worker removed while its answer was on the way must not pin the router
                    if isinstance(info, dict) and self._workers.get(worker.url) is worker:
                        self.cores.learn(worker.url, info.get("front_cpus"))
            if worker.role == "prefill":
                await self._push_to_decodes()
            elif worker.role == "decode" and not await self.push_bootstrap_servers(worker, True):
                return False
            resp = await client.get(f"{worker.url}/health", timeout=timeout)
            if resp.status_code == 200:
                draining = _says_draining(resp)
                if draining != worker.draining:
                    worker.draining = draining
                    logger.warning(
                        "worker %s: %s", "draining" if draining else "serving", worker.url
                    )
            return resp.status_code == 200
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("probe of %s failed: %r", worker.url, exc)
            return False

    @staticmethod
    def _learn(worker: Worker, info: dict) -> None:
        if not isinstance(info, dict):
            return
        if isinstance(info.get("model"), str):
            worker.model = info["model"]
        if isinstance(info.get("max_context"), int):
            worker.max_context = info["max_context"]
        if isinstance(info.get("prefix_cache"), bool):
            worker.prefix_cache = info["prefix_cache"]
        fmt = info.get("tool_call_format")
        worker.tool_format = fmt if isinstance(fmt, str) and fmt in FORMATS else None
        port = info.get("bootstrap_port")
        if worker.bootstrap_port is None and isinstance(port, int):
            worker.bootstrap_port = port  # an elastic decode node's too: for when it is prefill
        worker.elastic = info.get("elastic") is True
        start = info.get("start_role")
        worker.start_role = start if worker.elastic and start in ("prefill", "decode") else None
        role = info.get("role")
        if isinstance(role, str) and role != worker.role and not worker.elastic:
            logger.warning(
                "worker %s registered as %s reports role %s", worker.url, worker.role, role
            )

    # --- role changes of elastic workers (docs/ROUTER.md "Elastic nodes") --------------------
    async def change_role(
        self, worker: Worker, role: str, timeout_s: float, grace_s: float | None = None
    ) -> None:
        """Makes the elastic `worker` serve `role`: chosen for no request from now, it is asked
        (POST /role), and once every one of its ranks serves `role` (its /server_info says so) it
        takes the role, the decode nodes get the new allowlist, and it is chosen again. The
        requests it held finish first, on the node; with `grace_s`, those left after it move on
        (the node aborts them with `node_draining`: streams migrate, the others are retried).
        Raises RuntimeError if the node cannot be asked, refuses, or the worker is removed
        meanwhile; TimeoutError after `timeout_s`. After a failure the probes follow what the
        node reports (`_follow`)."""
        if worker.changing_to is not None:
            raise RuntimeError(f"{worker.url} is changing role to {worker.changing_to} already")
        worker.changing_to, worker.changed_by_router = role, True
        self.report(worker)
        client = self._clients.get(worker.url)
        timeout = self._cfg.health.timeout_s
        try:
            try:
                ask = {"role": role} if grace_s is None else {"role": role, "grace_s": grace_s}
                resp = await client.post(f"{worker.url}/role", json=ask, timeout=timeout)
            except httpx.HTTPError as exc:
                raise RuntimeError(f"{worker.url} could not be asked: {exc!r}") from None
            if resp.status_code != 200:
                raise RuntimeError(f"{worker.url} refused the role change: {resp.text[:200]}")
            deadline = time.monotonic() + timeout_s
            while True:
                if self._workers.get(worker.url) is not worker:
                    raise RuntimeError(f"{worker.url} was removed during its role change")
                info = await self._server_info(worker, timeout)
                if info.get("role") == role and info.get("changing_to") is None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{worker.url} did not become {role} in {timeout_s:g} s")
                await asyncio.sleep(ROLE_POLL_S)
            await self._adopt_role(worker, role)  # before it is eligible again
        finally:
            worker.changing_to, worker.changed_by_router = None, False
            self.report(worker)

    async def _server_info(self, worker: Worker, timeout: float) -> dict:
        """The worker's /server_info, or {} when it does not answer with a JSON object."""
        try:
            resp = await self._clients.get(worker.url).get(
                f"{worker.url}/server_info", timeout=timeout
            )
            info = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    async def _adopt_role(self, worker: Worker, role: str) -> None:
        """The elastic `worker` serves `role` now: its gauges move, and the bootstrap allowlists
        follow (a prefill node came or went; a decode node needs the list whole)."""
        if role == worker.role:
            return
        old = worker.role
        self._metrics.forget_worker(worker.url, old)
        worker.role = role
        logger.warning("worker %s: role %s -> %s", worker.url, old, role)
        await self._push_to_decodes()
        if role == "decode":
            await self.push_bootstrap_servers(worker, True)

    async def _follow(self, worker: Worker, info: dict) -> None:
        """A probe of an elastic worker takes its role and any change under way from what the
        node reports, unless this router is changing it: after a change that failed here but went
        on at the node, or one asked of the node by someone else, or after a router restart."""
        if not worker.elastic or worker.changed_by_router:
            return
        changing, role = info.get("changing_to"), info.get("role")
        worker.changing_to = changing if changing in ("prefill", "decode") else None
        if worker.changing_to is None and role in ("prefill", "decode"):
            await self._adopt_role(worker, role)

    async def probe_all(self) -> None:
        workers = self.all()
        if workers:
            await asyncio.gather(*(self.probe(w) for w in workers))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.health.interval_s)
            await self.probe_all()
            for worker in self.all():  # breakers move open -> half-open with time
                self.report(worker)


def _says_draining(resp: httpx.Response) -> bool:
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("draining") is True
