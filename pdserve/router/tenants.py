"""Tenants: who a request is, for fair sharing and per-tenant limits (router/admission.py).

A tenant is an API key. With `--tenant-keys FILE` (lines `NAME KEY [WEIGHT]`, `#` comments) the
router accepts those keys, besides `--api-key`, and each names its tenant and weight. Without a
file, the tenant is a hash of the bearer token the client sent (`key-<12 hex>`, so two keys are two
tenants even where any key is accepted), or `anonymous` when it sent none. Keys are compared in
constant time, and only the names appear in the status page.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from pdserve.router.admission import ANONYMOUS


@dataclass(frozen=True)
class TenantKey:
    name: str
    key: str
    weight: float = 1.0


MAX_TENANT_NAME = 128  # engine/core.py MAX_TENANT_CHARS (the router imports nothing of the engine)


def read_tenant_keys(path: str) -> tuple[TenantKey, ...]:
    """Parses the file; raises ValueError naming the line that is wrong."""
    keys, names = [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) not in (2, 3):
            raise ValueError(f"{path}:{n}: expected 'NAME KEY [WEIGHT]'")
        try:
            weight = float(fields[2]) if len(fields) == 3 else 1.0
        except ValueError:
            raise ValueError(f"{path}:{n}: weight {fields[2]!r} is not a number") from None
        if not 0 < weight <= 1000:
            raise ValueError(f"{path}:{n}: weight must be in (0, 1000]")
        if len(fields[0]) > MAX_TENANT_NAME:  # the nodes' fair queue takes names up to this
            raise ValueError(f"{path}:{n}: a tenant name has at most {MAX_TENANT_NAME} characters")
        if fields[0] in names:
            raise ValueError(f"{path}:{n}: tenant {fields[0]!r} is listed twice")
        names.add(fields[0])
        keys.append(TenantKey(fields[0], fields[1], weight))
    return tuple(keys)


class Tenants:
    def __init__(self, api_key: str | None, keys: tuple[TenantKey, ...] = ()):
        self.api_key = api_key
        self.keys = keys
        self.weights = {k.name: k.weight for k in keys}

    @property
    def required(self) -> bool:
        return bool(self.api_key or self.keys)

    def identify(self, authorization: str | None) -> str | None:
        """The tenant of a request's Authorization header; None when keys are required and it
        carries none of them."""
        token = _bearer(authorization)
        if token is not None:
            for k in self.keys:
                if hmac.compare_digest(token.encode(), k.key.encode()):
                    return k.name
        if self.api_key:
            if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return None
        elif self.keys:
            return None
        if token is None:
            return ANONYMOUS
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:12]


def _bearer(header: str | None) -> str | None:
    if header and header.startswith("Bearer ") and len(header) > 7:
        return header[7:]
    return None
