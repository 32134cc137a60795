"""The code's style as pyproject.toml declares it, held by the test run (and so by CI): ruff's lint rules
pass, the 110-column line length (E501) among them; no module of moe_rl is over 500 lines, no function
of moe_rl or of the tools and examples (benchmarks included) over 80."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

RUFF = Path(sys.executable).parent / "ruff"


def test_ruff_lint_rules_pass():
    proc = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_module_is_over_500_lines():
    long = {str(f.relative_to(ROOT)): n for f in sorted((ROOT / "moe_rl").rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > 500}
    assert not long, f"split these modules: {long}"


def test_no_function_is_over_80_lines():
    files = sorted(f for d in ("moe_rl", "tools", "examples") for f in (ROOT / d).rglob("*.py"))
    functions = [(f, node) for f in files
                 for node in ast.walk(ast.parse(f.read_text()))
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    long = {f"{f.relative_to(ROOT)}:{node.name}": lines for f, node in functions
            if (lines := node.end_lineno - node.lineno + 1) > 80}
    assert not long, f"split these functions: {long}"
