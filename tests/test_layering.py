"""DESIGN.md's layering rules, checked on the source: algos imports only torch (and itself);
rollout never imports megatron or moe_rl.train; train never imports vllm or moe_rl.rollout;
only loop.py and cluster.py know Ray."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "moe_rl"
STDLIB_OK = {"__future__", "dataclasses", "math", "functools", "logging", "pathlib", "typing", "collections"}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def files(sub: str):
    return sorted((PKG / sub).rglob("*.py")) if (PKG / sub).exists() else []


def test_algos_imports_only_torch():
    assert files("algos")
    for f in files("algos"):
        for mod in imports(f):
            top = mod.split(".")[0]
            ok = top == "torch" or mod.startswith("moe_rl.algos") or top in STDLIB_OK
            assert ok, f"{f.relative_to(PKG)} imports {mod}"


def test_rollout_never_imports_megatron():
    for f in files("rollout"):
        for mod in imports(f):
            assert not mod.startswith(("megatron", "moe_rl.train")), f"{f.relative_to(PKG)} imports {mod}"


def test_train_never_imports_vllm():
    for f in files("train"):
        for mod in imports(f):
            assert not mod.startswith(("vllm", "moe_rl.rollout")), f"{f.relative_to(PKG)} imports {mod}"


def test_only_loop_and_cluster_know_ray():
    for f in PKG.rglob("*.py"):
        if f.name in ("loop.py", "cluster.py"):
            continue
        for mod in imports(f):
            assert mod.split(".")[0] != "ray", f"{f.relative_to(PKG)} imports {mod}"
