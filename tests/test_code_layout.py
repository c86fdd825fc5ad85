"""The rules of the code's layout, checked on the source: imports point one way (apps -> engine -> models -> layers
-> ops), vlinfer/ has no import cycles (lazy imports inside functions count), and vlinfer/ops and vlinfer/layers
keep no mutable state at module level (each engine owns its op table and step metadata); and every document the
code cites is in the repository, with the sections and sources it is cited for."""
import ast
import importlib
import os
import re

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


# ---- the documents the code cites ----
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CITING = [os.path.join(REPO, "README.md"), os.path.join(REPO, "Makefile")] + [
    os.path.join(folder, name) for top in ("vlinfer", "tests", "apps", "examples", "bench")
    for folder, _, files in os.walk(os.path.join(REPO, top)) for name in files
    if name.endswith((".py", ".sh", ".md", ".jinja"))]
NPU_NOTE = "docs/npu-ops.md"


def _cited_docs() -> dict[str, list[str]]:
    """Paths docs/<name>.md named in the code and docs -> the files naming them."""
    cited = {}
    for path in CITING:
        with open(path, encoding="utf-8", errors="replace") as f:
            for doc in set(re.findall(r"\bdocs/[\w./-]+\.md\b", f.read())):
                cited.setdefault(doc, []).append(os.path.relpath(path, REPO))
    return cited


def test_every_cited_document_is_in_the_repository():
    cited = _cited_docs()
    assert NPU_NOTE in cited  # the scan sees the citations (the NPU note is cited from vlinfer/ops/npu.py)
    missing = {doc: files for doc, files in cited.items() if not os.path.isfile(os.path.join(REPO, doc))}
    assert not missing, f"documents cited but not in the repository: {missing}"


def _sections(text: str) -> dict[str, str]:
    """'2.3' -> that section's text, from headings '## 2. ...' / '### 2.3 ...' (a section holds its subsections)."""
    heads = [(m.start(), m.group(1), len(m.group(0).split()[0]))
             for m in re.finditer(r"^(?:##|###) (\d+(?:\.\d+)?)\.? ", text, re.M)]
    sections = {}
    for i, (start, number, level) in enumerate(heads):
        end = next((s for s, _, lv in heads[i + 1:] if lv <= level), len(text))
        sections[number] = text[start:end]
    return sections


def test_npu_note_has_every_section_and_source_the_code_cites():
    """Files citing the NPU note refer to its sections (§2.3, §2.3 "Masks") and to the wheel's docstring lines
    (OPD:8219); each must be in the note, so a citation always leads somewhere."""
    with open(os.path.join(REPO, NPU_NOTE), encoding="utf-8") as f:
        note = f.read()
    sections = _sections(note)
    citing = [path for path in CITING if "npu-ops.md" in open(path, encoding="utf-8", errors="replace").read()
              and not path.endswith("test_code_layout.py")]
    assert any(p.endswith(os.path.join("ops", "npu.py")) for p in citing)
    bad = []
    for path in citing:
        text = open(path, encoding="utf-8").read()
        for number, label in re.findall(r'§(\d+(?:\.\d+)?)(?: "([^"]+)")?', text):
            if number not in sections:
                bad.append(f"{os.path.relpath(path, REPO)}: §{number}")
            elif label and f"**{label}**" not in sections[number]:
                bad.append(f"{os.path.relpath(path, REPO)}: §{number} \"{label}\"")
        for source in re.findall(r"\b(?:OPD|ATBD|META):\d+", text):
            if source not in note:
                bad.append(f"{os.path.relpath(path, REPO)}: {source}")
    assert not bad, f"cited but not in {NPU_NOTE}: {sorted(set(bad))}"
