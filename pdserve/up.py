"""`pdserve up`: a whole local PD cluster in one command (router + prefill nodes + decode nodes).

Every node is a `pdserve prefill|decode` process (which starts its own rank processes); the router
is a `pdserve router` process. All of them die with this launcher (PR_SET_PDEATHSIG), and Ctrl-C
or SIGTERM stops them in order: router first, then the nodes, each of which stops its ranks.
SIGHUP restarts every node, one at a time, while the router serves (pdserve/rolling_restart.py).

The cluster secret: the one in the environment (PDSERVE_INTERNAL_TOKEN or _FILE) if set, else a
fresh random one per cluster. Every process gets it through its environment, never its command line,
and it is also written to a 0600 file (printed at start) for an operator's calls to /workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx

from pdserve.engine.model.path import ModelLoadError, resolve_model
from pdserve.engine.model.tokenizer import saved_chat_template
from pdserve.infra.cluster_secret import ENV as SECRET_ENV
from pdserve.infra.cluster_secret import FILE_ENV as SECRET_FILE_ENV
from pdserve.infra.cluster_secret import cluster_secret
from pdserve.infra.internal_auth import is_loopback
from pdserve.infra.logs import FORMAT_ENV, setup_logging
from pdserve.infra.procs import die_with_parent, hold_port, reserve_port, stop_processes
from pdserve.infra.request_signing import signed_auth
from pdserve.infra.zygote import ENV as ZYGOTE_ENV
from pdserve.infra.zygote_client import Zygote
from pdserve.rolling_restart import rolling_restart
from pdserve.up_args import UpConfig
from pdserve.up_cores import plan_cluster_cores

log = logging.getLogger("pdserve.up")
RANK_MODULES = [
    "pdserve.prefill_node.rank",
    "pdserve.elastic_node.rank",
    "pdserve.decode_node.rank",
]  # what the cluster's zygote preloads
STILL_LOADING_S = 30.0  # while nodes load, a progress line this often (else: none)


def example_request(url: str, key: str, model: str, chat: bool) -> str:
    """The ready line's curl: a chat request, or a completion for a model without a chat template
    (which answers chat with a 400)."""
    if chat:
        path = "chat/completions"
        body = '"messages": [{"role": "user", "content": "What is the capital of France?"}]'
    else:
        path, body = "completions", '"prompt": "The capital of France is"'
    return (
        f"  curl {url}/v1/{path} -H 'Content-Type: application/json'{key} \\\n"
        f'    -d \'{{"model": "{model}", {body}, "max_tokens": 32, "temperature": 0}}\''
    )


def say(msg: str, error: bool = False) -> None:
    """One line of the launcher's own: `[up] ...` as text, a JSON record with --log-format json."""
    if os.environ.get(FORMAT_ENV) == "json":
        (log.error if error else log.info)("%s", msg)
    else:
        print(f"[up] {msg}", file=sys.stderr if error else sys.stdout, flush=True)


class Cluster:
    def __init__(self, cfg: UpConfig):
        self.cfg = cfg
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.nodes: list[tuple[str, str]] = []  # (name, url)
        # the nodes' ports, held (reserve_port) until every node is up: free_port alone left a
        # window in which another process took a bootstrap port (EADDRINUSE in a test run)
        self._held_ports: list[socket.socket] = []
        self._router_port: socket.socket | None = None  # --port, held until the router listens
        self.zygote: Zygote | None = None
        self.rank_modules = RANK_MODULES
        self.commands: dict[str, list[str]] = {}  # each process's command, to start it again
        self.env: dict[str, str] = {}  # the nodes' environment
        self.router_url = ""
        self.restart_requested = False  # SIGHUP: a rolling restart (pdserve/rolling_restart.py)
        self.retired_zygotes: list[Zygote] = []  # a stopped rolling restart's: closed at the end
        self.secret = cluster_secret() or secrets.token_urlsafe(32)
        # one client for every start-up poll: httpx.get builds a client and a TLS context (the CA
        # bundle, tens of ms of CPU) per call, taken from the ranks that are starting
        self.http = httpx.Client(timeout=2)
        self._secret_dir = tempfile.mkdtemp(prefix="pdserve-")  # 0700
        self.secret_file = os.path.join(self._secret_dir, "internal_token")
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.secret)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        # a node starts on all of the host's cores (its --cpus name its ranks' cores, which this
        # launcher, bound to the fronts' cores, does not hold); the router keeps the launcher's
        host = self._host_cores if name != "router" else None

        def start() -> None:
            if host:
                os.sched_setaffinity(0, host)
            die_with_parent()

        p = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *cmd], env=env, preexec_fn=start)
        self.procs.append((name, p))
        self.commands[name] = cmd
        return p

    def proc(self, name: str) -> subprocess.Popen:
        return next(p for n, p in self.procs if n == name)

    def respawn(self, name: str) -> subprocess.Popen:
        """`name` started again with the command it had, and the environment now in `self.env`
        (pdserve/rolling_restart.py)."""
        self.procs = [(n, p) for n, p in self.procs if n != name]
        return self._spawn(name, self.commands[name], self.env)

    def start(self) -> str:
        """Starts the nodes, waits until every rank has loaded, then starts the router; returns
        the router's URL."""
        a = self.cfg
        try:
            self._router_port = hold_port(a.host, a.port)
        except OSError as e:
            raise RuntimeError(f"--port {a.port} on {a.host}: {e.strerror or e}") from None
        # every rank of every node is forked from one zygote: one torch import, not one per rank
        self.zygote = Zygote.start(RANK_MODULES)
        env = dict(os.environ, **{SECRET_ENV: self.secret, ZYGOTE_ENV: self.zygote.path})
        env.pop(SECRET_FILE_ENV, None)
        self.env = env
        self._host_cores = os.sched_getaffinity(0)
        cpus = self._plan_cores()
        logs = ["--log-level", a.log_level, "--log-format", a.log_format]
        if a.otlp_traces_endpoint:  # the router and every node export their spans
            logs += ["--otlp-traces-endpoint", a.otlp_traces_endpoint]
        router_cmd = ["router", "--host", a.host, "--port", str(a.port), *logs]
        if a.elastic:
            router_cmd.append("--elastic")
        router_cmd += self._start_prefill_nodes(env, cpus, logs)
        router_cmd += self._start_decode_nodes(env, cpus, logs)
        self._wait_nodes()
        return self._start_router(router_cmd, env)

    def first_model_chats(self) -> bool:
        """Whether the first model has a chat template (a pretrained one, Gemma 3 270M, has none);
        yes where its saved tokenizer cannot be read."""
        try:
            return saved_chat_template(resolve_model(self._models()[0])) is not False
        except ModelLoadError:
            return True

    def _models(self) -> list[str | None]:
        """The models to serve, each on its own prefill and decode nodes (None: the default)."""
        return list(self.cfg.model) or [os.environ.get("PDSERVE_MODEL") or None]

    def _plan_cores(self) -> Callable[[str, int], list[str]]:
        """Every rank's cores (up_cores.py); binds this launcher and the router it starts to the
        fronts' cores."""
        return plan_cluster_cores(self.cfg, len(self._models()), say)

    def _start_prefill_nodes(
        self, env: dict[str, str], cpus: Callable[[str, int], list[str]], logs: list[str]
    ) -> list[str]:
        """Spawns the prefill nodes; returns their flags for the router's command line."""
        a = self.cfg
        extra = logs + shlex.split(a.node_args) + shlex.split(a.prefill_args)
        router_flags = []
        for i, path in enumerate(p for p in self._models() for _ in range(a.prefill_nodes)):
            model = ["--model", path] if path else []
            port, bport = self._port(), self._port()
            self._spawn(
                f"prefill-{i}",
                [
                    "prefill",
                    *model,
                    "--pp",
                    str(a.prefill_pp),
                    "--tp",
                    str(a.prefill_tp),
                    "--port",
                    str(port),
                    "--bootstrap-port",
                    str(bport),
                    *cpus("prefill", a.prefill_pp * a.prefill_tp),
                    *(["--elastic"] if a.elastic else []),
                    *extra,
                ],
                env,
            )
            self.nodes.append((f"prefill-{i}", f"http://127.0.0.1:{port}"))
            router_flags += ["--prefill", f"http://127.0.0.1:{port}", str(bport)]
        return router_flags

    def _start_decode_nodes(
        self, env: dict[str, str], cpus: Callable[[str, int], list[str]], logs: list[str]
    ) -> list[str]:
        """Spawns the decode nodes; returns their flags for the router's command line."""
        a = self.cfg
        extra = logs + shlex.split(a.node_args) + shlex.split(a.decode_args)
        router_flags = []
        for i, path in enumerate(p for p in self._models() for _ in range(a.decode_nodes)):
            model = ["--model", path] if path else []
            port = self._port()
            # elastic: a bootstrap server too, for when it becomes a prefill node
            elastic = ["--elastic", "--bootstrap-port", str(self._port())] if a.elastic else []
            self._spawn(
                f"decode-{i}",
                [
                    "decode",
                    *model,
                    "--pp",
                    str(a.decode_pp),
                    "--tp",
                    str(a.decode_tp),
                    "--port",
                    str(port),
                    *cpus("decode", a.decode_pp * a.decode_tp),
                    *elastic,
                    *extra,
                ],
                env,
            )
            self.nodes.append((f"decode-{i}", f"http://127.0.0.1:{port}"))
            router_flags += ["--decode", f"http://127.0.0.1:{port}"]
        return router_flags

    def _start_router(self, router_cmd: list[str], env: dict[str, str]) -> str:
        a = self.cfg
        if a.policy:
            router_cmd += ["--policy", a.policy]
        if a.api_key:
            env = dict(env, PDSERVE_API_KEY=a.api_key)  # not on the router's command line (ps)
        self._spawn("router", router_cmd + shlex.split(a.router_args), env)
        url = f"http://{a.host}:{a.port}"
        self._wait(url, "router")
        self._release_router_port()  # it listens now
        self.router_url = url
        return url

    def _check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode} during start-up")

    def _port(self) -> int:
        held = reserve_port()
        self._held_ports.append(held)
        return held.getsockname()[1]

    def _release_ports(self) -> None:
        for held in self._held_ports:
            held.close()
        self._held_ports.clear()

    def _release_router_port(self) -> None:
        if self._router_port is not None:
            self._router_port.close()
            self._router_port = None

    def _wait_nodes(self) -> None:
        start = time.monotonic()
        deadline = start + self.cfg.startup_timeout
        next_note = start + STILL_LOADING_S
        while True:
            self._check_alive()
            states, ready = [], 0
            for name, url in self.nodes:
                try:
                    info = self.http.get(f"{url}/server_info", auth=signed_auth(self.secret)).json()
                    if info.get("failed"):
                        raise RuntimeError(f"{name} failed during start-up: {info['failed']}")
                    n, total = sum(1 for r in info["ranks"] if r), len(info["ranks"])
                    ok = info["healthy"]
                    states.append(f"{name} " + ("ready" if ok else f"{n}/{total} ranks"))
                    ready += ok
                except (httpx.HTTPError, ValueError, KeyError):
                    states.append(f"{name} starting")
            if time.monotonic() > next_note:  # each node and rank says when it is ready
                say(f"still loading after {time.monotonic() - start:.0f} s: " + ", ".join(states))
                next_note += STILL_LOADING_S
            if ready == len(self.nodes):
                self._release_ports()  # every node listens on its ports now
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes not ready after {self.cfg.startup_timeout:.0f} s")
            time.sleep(0.5)

    def _wait(self, url: str, name: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if self.http.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{name} not healthy after 60 s")

    def watch(self) -> int:
        """Runs until the router exits; a node that dies is reported and routed around."""
        reported: set[str] = set()
        while True:
            if self.restart_requested:
                self.restart_requested = False
                try:
                    rolling_restart(self, say)
                except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
                    say(f"rolling restart stopped: {e}", True)
            for name, p in self.procs:
                if p.poll() is None or name in reported:
                    continue
                if name == "router":
                    say(f"the router exited with code {p.returncode}; stopping the cluster", True)
                    return 1
                reported.add(name)
                say(f"{name} exited with code {p.returncode}; the router routes around it", True)
            time.sleep(0.5)

    def stop(self) -> None:
        self._release_ports()
        self._release_router_port()
        self.http.close()
        routers = [p for n, p in self.procs if n == "router"]
        stop_processes(routers)
        stop_processes([p for n, p in self.procs if n != "router"], grace_s=15)
        for zygote in [*self.retired_zygotes, self.zygote]:  # after the nodes and their ranks
            if zygote is not None:
                zygote.close()
        with contextlib.suppress(OSError):
            os.unlink(self.secret_file)
            os.rmdir(self._secret_dir)


def up_main(cfg: UpConfig) -> int:
    setup_logging("[up]", cfg.log_level, cfg.log_format)
    if not (cfg.api_key or cfg.insecure or is_loopback(cfg.host)):
        say(
            f"error: refusing to serve on {cfg.host} without an API key; set PDSERVE_API_KEY "
            f"(or --api-key), or pass --insecure",
            True,
        )
        return 2
    cluster = Cluster(cfg)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C stops everything even where SIGINT came ignored (a script's background job: Python
    # then installs no KeyboardInterrupt of its own, and the cluster would ignore it)
    signal.signal(signal.SIGINT, on_signal)
    # SIGHUP: restart every node, one at a time, without a failed request (rolling_restart.py)
    signal.signal(signal.SIGHUP, lambda *_: setattr(cluster, "restart_requested", True))
    try:
        url = cluster.start()
        key = f" -H 'Authorization: Bearer {cfg.api_key}'" if cfg.api_key else ""
        auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json().get("data") or [
            {"id": "default"}
        ]
        say(
            "cluster secret (for /workers and the nodes' internal endpoints) in "
            f"{cluster.secret_file}"
        )
        say(
            f"ready: OpenAI-compatible API on {url}/v1  (Ctrl-C stops everything)\n"
            + example_request(url, key, models[0]["id"], cluster.first_model_chats())
        )
        return cluster.watch()
    except KeyboardInterrupt:
        say("stopping")
        return 0
    except (RuntimeError, TimeoutError) as e:
        say(f"error: {e}", True)
        return 1
    finally:
        cluster.stop()
