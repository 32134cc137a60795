"""The layering rules of docs/architecture.md, checked on the source: algos imports only torch (and itself);
rollout never imports megatron or moe_rl.train; train never imports vllm or moe_rl.rollout; weights
(names, buckets, files) imports none of megatron, vllm, ray, train, rollout or the driver; only the
driver (moe_rl/driver/) knows Ray and calls actors (`.remote`); algos, train, rollout and weights never
import the driver; importing a driver module loads neither megatron nor vllm; and the modules of moe_rl
import one another without a cycle.

Imports are read from the source, at any depth (a function's lazy import counts), relative ones
resolved."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "moe_rl"
STDLIB_OK = {"__future__", "dataclasses", "math", "functools", "hashlib", "logging", "pathlib", "typing",
             "collections", "contextlib", "os", "sys"}  # os, sys: the GAE kernel's build environment


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(f): f for f in sorted(PKG.rglob("*.py"))}


def parsed_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import statement of `path`. `from m import y`
    gives m.y where that is a module of moe_rl, else m; relative imports are made absolute."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend((a.name, top) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                out.append((f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, top))
        inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return out


def imports(path: Path) -> set[str]:
    return {mod for mod, _ in parsed_imports(path)}


def files(sub: str):
    return sorted((PKG / sub).rglob("*.py")) if (PKG / sub).exists() else []


def internal(mod: str) -> str | None:
    """The moe_rl module an import of `mod` runs (the longest module prefix), None outside moe_rl."""
    while mod and mod not in MODULES:
        mod = mod.rpartition(".")[0]
    return mod or None


def test_algos_imports_only_torch():
    assert files("algos")
    for f in files("algos"):
        for mod in sorted(imports(f)):
            top = mod.split(".")[0]
            ok = top == "torch" or mod.startswith("moe_rl.algos") or top in STDLIB_OK
            assert ok, f"{f.relative_to(PKG)} imports {mod}"


def test_rollout_never_imports_megatron():
    for f in files("rollout"):
        for mod in sorted(imports(f)):
            assert not mod.startswith(("megatron", "moe_rl.train")), f"{f.relative_to(PKG)} imports {mod}"


def test_train_never_imports_vllm():
    for f in files("train"):
        for mod in sorted(imports(f)):
            assert not mod.startswith(("vllm", "moe_rl.rollout")), f"{f.relative_to(PKG)} imports {mod}"


def test_weights_is_names_buckets_and_files():
    banned = ("megatron", "vllm", "ray", "moe_rl.train", "moe_rl.rollout", "moe_rl.driver")
    assert files("weights")
    for f in files("weights"):
        for mod in sorted(imports(f)):
            assert not (mod in banned or mod.startswith(tuple(b + "." for b in banned))), \
                f"{f.relative_to(PKG)} imports {mod}"


def driver_file(f: Path) -> bool:
    return f.relative_to(PKG).parts[0] == "driver"


def test_only_the_driver_knows_ray():
    """Ray is the driver's (moe_rl/driver/: the loop, the actors, placement, the managers of the engines
    and trainer groups); worker code (algos, train, rollout, weights) and the rest never import it."""
    assert any(driver_file(f) for f in PKG.rglob("*.py"))
    for f in PKG.rglob("*.py"):
        if driver_file(f):
            continue
        for mod in sorted(imports(f)):
            assert mod.split(".")[0] != "ray", f"{f.relative_to(PKG)} imports {mod}"


def test_only_the_driver_calls_actors():
    """`x.remote(...)` (an actor call, a task) only in moe_rl/driver/."""
    for f in PKG.rglob("*.py"):
        if driver_file(f):
            continue
        calls = [n.lineno for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr == "remote"]
        assert not calls, f"{f.relative_to(PKG)} calls .remote on lines {calls}"


def test_worker_code_never_imports_the_driver():
    for sub in ("algos", "train", "rollout", "weights"):
        assert files(sub)
        for f in files(sub):
            for mod in sorted(imports(f)):
                assert not mod.startswith("moe_rl.driver"), f"{f.relative_to(PKG)} imports {mod}"


def test_importing_a_driver_module_loads_neither_megatron_nor_vllm():
    """What `import moe_rl.driver.X` runs, for every X: its module-level imports and theirs (parent
    packages' __init__ included), followed through moe_rl; function-level imports are left out. The
    driver process imports Megatron and vLLM nowhere: they live in the actors."""
    driver = sorted(name for name in MODULES if name.startswith("moe_rl.driver."))
    assert "moe_rl.driver.placement" in driver
    for start in driver:
        seen, todo, external = set(), [start], {}
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            parts = name.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
            for mod, top in parsed_imports(MODULES[name]):
                if not top:
                    continue
                if internal(mod):
                    todo.append(internal(mod))
                else:
                    external.setdefault(mod, name)
        bad = {mod: by for mod, by in external.items() if mod.split(".")[0] in ("megatron", "vllm")}
        assert not bad, f"importing {start} imports {bad} (module: imported by)"


def import_graph() -> dict[str, set[str]]:
    """moe_rl module -> the moe_rl modules it imports (any depth), less a package __init__'s imports
    of its own submodules."""
    graph = {}
    for name, path in MODULES.items():
        own = name + "." if path.name == "__init__.py" else None
        targets = {internal(mod) for mod, _ in parsed_imports(path)} - {None, name}
        graph[name] = {t for t in targets if not (own and t.startswith(own))}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_no_import_cycles():
    """No moe_rl module imports (at any depth) a module that imports it back, directly or through
    others. Allowed: a package's __init__ importing its own submodules (moe_rl.algos imports its method
    modules so that their registrations are complete), which Python runs before those submodules."""
    graph = import_graph()
    assert "moe_rl.algos.registry" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_architecture_doc_and_the_driver_index_name_every_part():
    """docs/architecture.md names each package and top-level module of moe_rl; driver/__init__.py's index
    names each driver file (a new file is placed in the layout, or the test says where it is missing)."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    parts = [f"{p.name}/" for p in sorted(PKG.iterdir()) if (p / "__init__.py").is_file()]
    parts += [p.name for p in sorted(PKG.glob("*.py")) if p.name != "__init__.py"]
    missing = [p for p in parts if f"`{p}" not in doc]
    assert not missing, f"docs/architecture.md does not name {missing}"
    index = (PKG / "driver" / "__init__.py").read_text()
    unlisted = [p.name for p in sorted((PKG / "driver").glob("*.py"))
                if p.name != "__init__.py" and f"    {p.name} " not in index]
    assert not unlisted, f"driver/__init__.py's index does not name {unlisted}"
