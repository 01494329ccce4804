"""One node the router is told about (`--prefill`/`--decode`/`--worker`, `POST /workers`), checked
where it enters: a bad field is a `WorkerSpecError` that names it."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

ROLES = ("prefill", "decode", "colocated")
MAX_REPLICA = 100_000  # a node's index in its autoscaled StatefulSet, at most this less one


class WorkerSpecError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field  # the request field it is about, for a 400's `param`


@dataclass(frozen=True)
class WorkerSpec:
    """One node the router sends to. `bootstrap_port` is only meaningful for prefill nodes; when it
    is None the router learns it from the node's `GET /server_info`."""

    url: str
    role: str
    bootstrap_port: int | None = None
    # its index in the set an autoscaler shrinks from the top (a StatefulSet's pod ordinal)
    replica: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise WorkerSpecError("role", f"role {self.role!r} is not one of {', '.join(ROLES)}")
        parsed = urlparse(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise WorkerSpecError("url", f"worker URL {self.url!r} must look like http://HOST:PORT")
        if self.url.endswith("/"):
            raise WorkerSpecError("url", f"worker URL {self.url!r} must not end with '/'")
        if (p := self.bootstrap_port) is not None and (type(p) is not int or not 0 < p < 65536):
            raise WorkerSpecError("bootstrap_port", f"bootstrap_port {p!r} is not a TCP port")
        if (r := self.replica) is not None and (type(r) is not int or not 0 <= r < MAX_REPLICA):
            raise WorkerSpecError("replica", f"replica {r!r} is not in [0, {MAX_REPLICA})")
