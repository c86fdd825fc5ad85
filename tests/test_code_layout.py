"""The rules of the code's layout, checked on the source: imports point one way (apps -> engine -> models -> layers
-> ops), vlinfer/ has no import cycles (lazy imports inside functions count), and vlinfer/ops and vlinfer/layers
keep no mutable state at module level (each engine owns its op table and step metadata)."""
import ast
import importlib
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "vlinfer")
# Packages a package may not import from, whatever the route (top-level or inside a function, TYPE_CHECKING too).
FORBIDDEN = {
    "vlinfer.ops": ("vlinfer.layers", "vlinfer.models", "vlinfer.engine", "vlinfer.serve", "vlinfer.multimodal",
                    "vlinfer.llm", "vlinfer.pipeline"),
    "vlinfer.layers": ("vlinfer.models", "vlinfer.engine", "vlinfer.serve", "vlinfer.llm", "vlinfer.pipeline"),
    "vlinfer.models": ("vlinfer.engine", "vlinfer.serve", "vlinfer.llm", "vlinfer.pipeline"),
}
STATEFUL_PACKAGES = ("vlinfer.ops", "vlinfer.layers")


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(module: str) -> set[str]:
    """vlinfer modules `module` imports anywhere in its body (resolved to modules that exist)."""
    tree = ast.parse(open(MODULES[module]).read())
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name in MODULES and name != module}


GRAPH = {module: _imports(module) for module in MODULES}


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_imports_point_one_way(package):
    bad = [(m, target) for m, targets in GRAPH.items() if m == package or m.startswith(package + ".")
           for target in targets if any(target == f or target.startswith(f + ".") for f in FORBIDDEN[package])]
    assert not bad, f"{package} imports upward: {bad}"


def test_no_import_cycles_between_modules():
    """Package __init__ files re-export their modules, so edges into a package's own __init__ from inside it are
    the package's public face, not a cycle between rooms; every other cycle fails."""
    def edges(module):
        return {t for t in GRAPH[module] if not (module.startswith(t + "."))}

    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges(module)):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _module_level_names(module: str):
    tree = ast.parse(open(MODULES[module]).read())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    yield name.id, node


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith(STATEFUL_PACKAGES)])
def test_no_module_level_state_in_ops_and_layers(module):
    """Only constants (UPPER_CASE, never rebound), the logger and __all__ at module level; no `global`."""
    tree = ast.parse(open(MODULES[module]).read())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Global, ast.Nonlocal))], f"{module} uses global"
    bad = []
    for name, node in _module_level_names(module):
        constant = name.lstrip("_").isupper() and not isinstance(node, ast.AugAssign)
        if not (constant or name in ("logger", "__all__")):
            bad.append(name)
    assert not bad, f"{module} has module-level variables {bad}"


def test_module_constants_unchanged_by_running_engines(qwen3_checkpoint):
    """The constants the rule above lets through are not mutated at run time: two engines run, and every
    module-level value in vlinfer.ops / vlinfer.layers compares equal to its copy from before."""
    from vlinfer import LLM, SamplingParams
    modules = [importlib.import_module(m) for m in MODULES if m.startswith(STATEFUL_PACKAGES)]

    assigned = {m.__name__: {name for name, _ in _module_level_names(m.__name__)} for m in modules}

    def snapshot():
        return {m.__name__: {k: repr(v) for k, v in vars(m).items() if k in assigned[m.__name__]}
                for m in modules}

    before = snapshot()
    for ops in ("cpu-compiled", "reference"):
        llm = LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=1 << 22, ops=ops)
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert snapshot() == before
