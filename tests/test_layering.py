"""The package layering of docs/ARCHITECTURE.md section 2, checked against every import in the
source (top-level and inside functions), so an upward import fails here and not in review."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "pdserve"

# package below pdserve/ -> the pdserve packages it may import (besides itself and its own
# sub-packages). pdserve's own modules (the command line, `pdserve up` and its rolling restart,
# `pdserve bench`) sit on top and may import any of them.
ALLOWED = {
    "infra": set(),
    "consensus": {"infra"},
    "engine": {"consensus", "infra"},
    "kv_transfer": {"consensus", "infra"},
    "runtime": {"engine", "consensus", "infra"},
    "pd_common": {"runtime", "engine", "kv_transfer", "consensus", "infra"},
    "prefill_node": {"pd_common", "runtime", "engine", "kv_transfer", "consensus", "infra"},
    "decode_node": {"pd_common", "runtime", "engine", "kv_transfer", "consensus", "infra"},
    "elastic_node": {
        "prefill_node",
        "decode_node",
        "pd_common",
        "runtime",
        "engine",
        "kv_transfer",
        "consensus",
        "infra",
    },
    "router": {"infra"},
}
TOP_LEVEL = {
    "pdserve.cli",
    "pdserve.up",
    "pdserve.up_args",
    "pdserve.up_cores",
    "pdserve.launch",
    "pdserve.rolling_restart",
    "pdserve.trace_cmd",
    "pdserve.register_cmd",
    "pdserve.bench",
}
# Third-party modules the model-and-decisions package must not need.
ENGINE_FORBIDDEN = {"zmq", "fastapi", "uvicorn", "starlette", "torch.distributed"}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _package_of(mod: str) -> str | None:
    """`pdserve.engine.model.llama` -> "engine"; None for a module outside pdserve's packages."""
    parts = mod.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_package_imports_only_downward():
    bad = []
    for pkg, allowed in ALLOWED.items():
        files = sorted((PKG / pkg).rglob("*.py"))
        assert files, f"package pdserve/{pkg}/ is missing"
        for f in files:
            for line, mod in _imports(f):
                top = _package_of(mod)
                if mod.split(".")[0] == "pdserve" and top is None:
                    bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod} (pdserve's top level)")
                elif top is not None and top != pkg and top not in allowed:
                    bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "imports against docs/ARCHITECTURE.md section 2:\n" + "\n".join(bad)


def test_nothing_imports_a_name_outside_the_namespace():
    """The packages moved below pdserve/; an import of the old top-level names would only work
    from a checkout's root, never from an installed package."""
    old = set(ALLOWED)
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {mod}"
        for folder in ("pdserve", "tests", "bench")
        for f in sorted((ROOT / folder).rglob("*.py"))
        for line, mod in _imports(f)
        if mod.split(".")[0] in old
    ]
    assert not bad, "\n".join(bad)


def test_engine_needs_no_network_or_process_group():
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {mod}"
        for f in sorted((PKG / "engine").rglob("*.py"))
        for line, mod in _imports(f)
        if any(mod == m or mod.startswith(m + ".") for m in ENGINE_FORBIDDEN)
    ]
    assert not bad, "\n".join(bad)


def test_no_source_package_is_left_out_of_the_layering():
    packages = {p.parent.name for p in PKG.glob("*/__init__.py")}
    modules = {f"pdserve.{p.stem}" for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert packages - set(ALLOWED) - {"bench"} == set(), (
        "add new packages to ALLOWED and to ARCHITECTURE"
    )
    assert modules - TOP_LEVEL == set(), "a module at pdserve's top level: put it in a package"


# The in-memory seams stand in for gloo and Mooncake in tests only (docs/ARCHITECTURE.md section 9).
TEST_ONLY = {
    "pdserve.kv_transfer.in_memory",
    "pdserve.kv_transfer.in_memory_prefill",
    "pdserve.kv_transfer.in_memory_decode",
    "pdserve.runtime.rank.pp_comm_memory",
}


def _module(f: Path) -> str:
    return ".".join(f.relative_to(ROOT).with_suffix("").parts)


def test_no_source_module_imports_a_test_only_seam():
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {mod}"
        for f in sorted(PKG.rglob("*.py"))
        if _module(f) not in TEST_ONLY  # the seams' own modules import one another
        for line, mod in _imports(f)
        if mod in TEST_ONLY
    ]
    assert not bad, "\n".join(bad)
