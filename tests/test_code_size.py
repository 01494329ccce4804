"""No source file of pdserve/ over 400 lines and no function over 60 (issue #47): a file or a
function past these holds more than one concept, and a newcomer reads it whole to change a part."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "pdserve"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_no_file_over_400_lines():
    long = {
        str(p.relative_to(PKG)): n
        for p in sorted(PKG.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


def test_no_function_over_60_lines():
    """Counted from `def` to its last line, decorators aside."""
    long = {}
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PKG)}:{node.lineno} {node.name}"] = n
    assert long == {}
