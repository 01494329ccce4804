"""Logging of every pdserve process (router, node fronts, ranks, `pdserve up`): one line per record,
as text or as one JSON object per line, and quiet unless asked.

Level and format come from the process's flags (`--log-level`, `--log-format`), else from
PDSERVE_LOG_LEVEL / PDSERVE_LOG_FORMAT; `setup_logging` exports both, so the processes a launcher
starts (a node's ranks, the nodes and router of `pdserve up`) log the same way.

Below DEBUG these stay quiet: httpx's line per request (the router's health probes, every
rank's heartbeats), uvicorn's access log and start-up lines, and Mooncake's own C++ logging (glog,
to warnings and above: MC_LOG_LEVEL, read when Mooncake loads, so it is set here, before any
import of it; `native_log` re-logs what it prints while starting). At DEBUG all of them show.

JSON lines carry `ts`, `level`, `logger`, `proc` (which process: "router", "prefill pp0", ...),
`pid`, `msg`, `rid` and `trace_id` (null when no request is in scope, or it is not traced:
docs/TRACING.md), and `exc` with a traceback. A request is in scope when the log call passes
`extra={"rid": ...}` or the code runs under `bind_request(rid)` (a context variable: it follows
asyncio tasks).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator

LEVEL_ENV, FORMAT_ENV = "PDSERVE_LOG_LEVEL", "PDSERVE_LOG_FORMAT"
FORMATS = ("text", "json")
_RID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_rid", default=None)
_TRACE: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_trace", default=None)


def bind_request(rid: str | None, trace_id: str | None = None) -> None:
    """Every record logged from here on in this context (task, thread) carries `rid`."""
    _RID.set(rid)
    _TRACE.set(trace_id)


class JsonFormatter(logging.Formatter):
    def __init__(self, proc: str):
        super().__init__()
        self.proc = proc

    def format(self, record: logging.LogRecord) -> str:
        ms = int(record.msecs)
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "proc": self.proc,
            "pid": record.process,
            "msg": record.getMessage(),
            "rid": getattr(record, "rid", None) or _RID.get(),
            "trace_id": getattr(record, "trace_id", None) or _TRACE.get(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def log_level(level: str | None = None) -> str:
    return (level or os.environ.get(LEVEL_ENV) or "INFO").upper()


def is_debug() -> bool:
    return log_level() == "DEBUG"


def uvicorn_level() -> str:
    """What a uvicorn server of ours logs: its start-up lines and access log only at DEBUG."""
    return "info" if is_debug() else "warning"


def setup_logging(prefix: str, level: str | None = None, fmt: str | None = None) -> None:
    """`prefix`: which process, e.g. "[prefill pp0]" (text lines start with it)."""
    level = log_level(level)
    fmt = (fmt or os.environ.get(FORMAT_ENV) or "text").lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: choose one of {', '.join(FORMATS)}")
    os.environ[LEVEL_ENV], os.environ[FORMAT_ENV] = level, fmt  # children log the same way
    debug = level == "DEBUG"
    # Mooncake's glog: it sets glog's level itself from MC_LOG_LEVEL (default INFO) when it loads,
    # so that is the one that counts; GLOG_minloglevel for any other glog user
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if debug else "WARNING")
    os.environ.setdefault("GLOG_minloglevel", "0" if debug else "1")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(prefix.strip("[]")))
    else:
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s {prefix} pid={os.getpid()} %(levelname)s %(name)s: %(message)s"
            )
        )
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python warnings become records (JSON lines in json format)
    quiet = logging.INFO if debug else logging.WARNING
    for name, lvl in (
        ("httpx", quiet),  # a line per request
        ("httpcore", logging.INFO),  # connection-level traces, even at DEBUG: too many
        ("uvicorn.access", quiet),
        ("uvicorn.error", quiet),
    ):
        logging.getLogger(name).setLevel(lvl)


_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]]+)\] ?(.*)$")
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


@contextlib.contextmanager
def native_log(logger: logging.Logger, quiet: Iterable[str] = ()) -> Iterator[None]:
    """Captures what the process writes to its stderr file descriptor inside the block (native
    code: Mooncake's glog) and logs it through `logger` after it: a glog line at its own severity,
    or at DEBUG when it contains one of `quiet` (lines known to be harmless); any other line is
    written back as it was."""
    quiet = tuple(quiet)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured = tmp.read().decode(errors="replace")
        for line in captured.splitlines():
            m = _GLOG.match(line)
            if line.startswith("WARNING: Logging before InitGoogleLogging"):
                logger.debug("%s", line)
            elif m is None:
                sys.stderr.write(line + "\n")
            else:
                level = _GLOG_LEVELS[m.group(1)]
                if any(q in line for q in quiet):
                    level = logging.DEBUG
                logger.log(level, "%s] %s", m.group(2), m.group(3))
