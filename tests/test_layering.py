"""The package layering of docs/ARCHITECTURE.md section 2, checked against every import in the
source (top-level and inside functions), so an upward import fails here and not in review."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> the pdserve packages it may import (besides itself).
ALLOWED = {
    "infra": set(),
    "consensus": {"infra"},
    "engine": {"consensus"},
    "kv_transfer": {"consensus", "infra"},
    "runtime": {"engine", "consensus", "infra"},
    "pd_common": {"runtime", "engine", "kv_transfer", "consensus", "infra"},
    "prefill_node": {"pd_common", "runtime", "engine", "kv_transfer", "consensus", "infra"},
    "decode_node": {"pd_common", "runtime", "engine", "kv_transfer", "consensus", "infra"},
    "router": {"infra"},
}
ALL = set(ALLOWED) | {"pdserve"}
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


def test_every_package_imports_only_downward():
    bad = []
    for pkg, allowed in ALLOWED.items():
        files = sorted((ROOT / pkg).glob("*.py"))
        assert files, f"package {pkg}/ is missing"
        for f in files:
            for line, mod in _imports(f):
                top = mod.split(".")[0]
                if top in ALL and top != pkg and top not in allowed:
                    bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "imports against docs/ARCHITECTURE.md section 2:\n" + "\n".join(bad)


def test_engine_needs_no_network_or_process_group():
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {mod}"
        for f in sorted((ROOT / "engine").glob("*.py"))
        for line, mod in _imports(f)
        if any(mod == m or mod.startswith(m + ".") for m in ENGINE_FORBIDDEN)
    ]
    assert not bad, "\n".join(bad)


def test_no_source_package_is_left_out_of_the_layering():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - ALL == set(), "add new packages to ALLOWED and to docs/ARCHITECTURE.md"


# The in-memory seams stand in for gloo and Mooncake in tests only (docs/ARCHITECTURE.md section 9).
TEST_ONLY = {
    "kv_transfer.in_memory",
    "kv_transfer.in_memory_prefill",
    "kv_transfer.in_memory_decode",
    "runtime.pp_comm_memory",
}


def _module(f: Path) -> str:
    return ".".join(f.relative_to(ROOT).with_suffix("").parts)


def test_no_source_module_imports_a_test_only_seam():
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {mod}"
        for pkg in ALL
        for f in sorted((ROOT / pkg).glob("*.py"))
        if _module(f) not in TEST_ONLY  # the seams' own modules import one another
        for line, mod in _imports(f)
        if mod in TEST_ONLY
    ]
    assert not bad, "\n".join(bad)
