"""The rules of the code's layout, checked on the source: every vlinfer module imports only its own
room and the rooms below it (docs/design.md "Rooms"; lazy imports inside functions and dynamic
import maps count), neither vlinfer/ nor bench/ has an import circle, no library code sets torch's
process-wide state, no file outgrows one idea, vlinfer/ops and vlinfer/layers keep no mutable state
at module level (each engine owns its op table and step metadata), vlinfer/ops is one package per
device behind one interface; and every document the code cites is in the repository, with the
sections and sources it is cited for; and no line of Python is longer than 100 characters."""
import ast
import importlib
import os
import re

import pytest

from dependencies import REPO
ROOT = os.path.join(REPO, "vlinfer")
# The rooms, top first. A module imports its own row and the rows below it, never one above; in the
# last row (the leaves) each room stands alone and imports no other. Kept in step with
# docs/design.md "Rooms".
ROOMS = [
    ["vlinfer.cli", "vlinfer.__main__"],  # the command line: `python -m vlinfer`, `vlinfer ...`
    ["vlinfer.integrations"],  # Ray Data captioning and embedding, Ray Serve replicas
    ["vlinfer.serve"],  # the OpenAI-compatible server
    ["vlinfer.captioning"],  # the batch jobs (caption, embed) the CLI, the demo and Ray share
    ["vlinfer", "vlinfer.llm", "vlinfer.pipeline"],  # the public face
    # the loop, its input and output processors, scheduler, KV blocks, model runner, workers
    ["vlinfer.engine"],
    # the public data types
    [
        "vlinfer.config", "vlinfer.sampling_params", "vlinfer.pooling_params",
        "vlinfer.lora_request", "vlinfer.outputs", "vlinfer.vllm_names",
        "vlinfer.caption_records"
    ],
    # tensor-parallel processes: rendezvous, control channel, rank 0's driver
    ["vlinfer.distributed"],
    ["vlinfer.models"],  # model forwards
    ["vlinfer.loading"],  # finding a model, reading its config, tokenizer and tensors
    ["vlinfer.layers"],  # layers, their sharding and quantization methods
    ["vlinfer.ops"],  # the op tables, one per device, and their kernels
    ["vlinfer.multimodal"],  # images and videos in, preprocessed items out
    ["vlinfer.inputs", "vlinfer.structured", "vlinfer.platform", "vlinfer.toy"],  # the leaves
]
RANK = {room: len(ROOMS) - i for i, rooms in enumerate(ROOMS) for room in rooms}
LEAVES = ROOMS[-1]
STATEFUL_PACKAGES = ("vlinfer.ops", "vlinfer.layers")
# One concept per file: a file over LONG_FILE_LINES lines says why in its module docstring, in a
# sentence that starts with LONG_FILE_REASON.
LONG_FILE_LINES = 500
LONG_FILE_REASON = "Long because"
# vlinfer/engine/llm_engine.py: the loop, read like nano-vllm's (210 lines at 120 columns, now 100)
MAX_ENGINE_LINES = 230


def _modules(top: str, package: str) -> dict[str, str]:
    """Dotted module name -> path, for every .py under `top` (named from `package`)."""
    found = {}
    for folder, _, files in os.walk(top):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, top)[:-3].replace(os.sep, ".")
                found[f"{package}.{rel}".removesuffix(".__init__").strip(".")] = path
    return found


MODULES = _modules(ROOT, "vlinfer")


def _imports(module: str, modules: dict[str, str]) -> set[str]:
    """The modules of `modules` that `module` imports anywhere in its body: `import a.b`, `from a
    import b` (a.b when that is a module, else a's __init__), relative imports, and strings naming a
    module (importlib maps)."""
    tree = ast.parse(open(modules[module]).read())
    package = module if modules[module].endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in modules:  # a dotted name, not the logger's "vlinfer"
            names.add(node.value)
    return {name for name in names if name in modules and name != module}


GRAPH = {module: _imports(module, MODULES) for module in MODULES}


def room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_every_module_has_a_room():
    assert not [m for m in MODULES if room(m) not in RANK
                ], "add the new package to ROOMS and docs/design.md"


def test_imports_point_one_way():
    """Down, or within a row; the leaves import no other room."""
    def allowed(m, t):
        a, b = room(m), room(t)
        return a == b or RANK[b] < RANK[a] or (RANK[b] == RANK[a] and a not in LEAVES)

    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                 if not allowed(m, t))
    assert not bad, "imports pointing up or across: " + "; ".join(bad)


def test_the_checker_sees_lazy_and_dynamic_imports():
    """The rules above would pass on a blind graph: a few known edges of each kind must be in it."""
    assert "vlinfer.multimodal.chat" in GRAPH["vlinfer.engine.input_processor"]  # inside a function
    assert "vlinfer.llm" in GRAPH["vlinfer"]  # the public face's importlib map
    assert "vlinfer.models.qwen3_vl" in GRAPH["vlinfer.models.registry"]
    # `from package import module`
    assert "vlinfer.platform.cpu_features" in GRAPH["vlinfer.ops.cpu.backend"]
    assert "vlinfer.ops.npu" in GRAPH["vlinfer.ops.select"]  # a lazy import of a device package


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Package __init__ files re-export their modules, so edges into a package's own __init__ from
    inside it are the package's public face, not a circle between rooms; every other circle counts.
    """
    def edges(module):
        return {t for t in graph[module] if not module.startswith(t + ".")}

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

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_import_circles_in_vlinfer():
    cycles = _cycles(GRAPH)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_circles_in_bench():
    """bench/ scripts import each other by file name (each puts bench/ on sys.path) or as
    bench.<name>."""
    bench = {
        name.removeprefix("bench."): path
        for name, path in _modules(os.path.join(REPO, "bench"), "bench").items()
    }
    bench.update({f"bench.{name}": path for name, path in list(bench.items())})
    graph = {
        m: {t.removeprefix("bench.")
            for t in _imports(m, bench)}
        for m in bench if not m.startswith("bench.")
    }
    assert "throughput" in graph and "peers" in graph
    cycles = _cycles(graph)
    assert not cycles, "import circles in bench/: " + "; ".join(" -> ".join(c) for c in cycles)


def _room_path(room: str) -> str:
    if room == "vlinfer":
        return "vlinfer/__init__.py"
    rel = room.replace(".", "/")
    return rel + "/" if os.path.isdir(os.path.join(REPO, rel)) else rel + ".py"


def _section(text: str, heading: str) -> str:
    section = text[text.index(heading):]
    end = section.find("\n## ", 1)
    return section if end < 0 else section[:end]


def test_design_doc_lists_the_rooms_in_order():
    """docs/design.md's "Rooms" table has one row per rank, top first, naming the rooms of this
    file's ROOMS."""
    text = open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8").read()
    rows = [
        re.findall(r"`([^`]+)`",
                   line.split("|")[1]) for line in _section(text, "## Rooms").splitlines()
        if line.startswith("| `vlinfer")
    ]
    assert rows == [[_room_path(r) for r in rooms] for rooms in ROOMS]


def test_readme_layout_section_matches_the_packages():
    """The README's layout lists every package folder of vlinfer/, and nothing that is not one."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    listed = set(re.findall(r"vlinfer/(\w+)/", _section(text, "## Layout")))
    packages = {
        name
        for name in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, name, "__init__.py"))
    }
    assert listed == packages


LIBRARY = [
    path for module, path in MODULES.items()
    if not module.startswith(("vlinfer.cli", "vlinfer.__main__"))
]


@pytest.mark.parametrize("call", ["set_default_dtype", "set_num_threads", "set_default_device"])
def test_no_torch_process_state_set_by_library_code(call):
    """torch keeps one default dtype, device and thread pool per process: library code never sets
    them (two engines in one process would see each other's). The one thread setter,
    platform/threads.py, is called by process entry points only (the CLI, a spawned worker's main, a
    Ray actor's start), which the next test checks."""
    found = [
        os.path.relpath(p, REPO) for p in LIBRARY if re.search(rf"\btorch\.{call}\(",
                                                               open(p).read())
    ]
    assert found == (["vlinfer/platform/threads.py"] if call == "set_num_threads" else [])


def test_threads_set_only_at_process_entry_points():
    callers = {}
    for module, path in MODULES.items():
        tree = ast.parse(open(path).read())
        for fn in (n for n in ast.walk(tree)
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            if any(
                    isinstance(c, ast.Call) and
                    getattr(c.func, "id", getattr(c.func, "attr", None)) == "set_process_threads"
                    for c in ast.walk(fn)):
                callers.setdefault(module, set()).add(fn.name)
    assert callers == {
        "vlinfer.cli.options": {"set_threads"}, "vlinfer.engine.worker": {"spawned_worker_main"},
        "vlinfer.integrations.ray_data": {"__init__"},
        "vlinfer.integrations.ray_serve": {"__init__"}
    }


def test_one_concept_per_file():
    """A vlinfer/ file over LONG_FILE_LINES lines says why in its docstring; the engine loop stays
    under MAX_ENGINE_LINES."""
    sizes = {os.path.relpath(p, REPO): sum(1 for _ in open(p)) for p in MODULES.values()}
    def says_why(path):
        docstring = ast.get_docstring(ast.parse(open(os.path.join(REPO, path)).read())) or ""
        return LONG_FILE_REASON in docstring

    unexplained = [p for p, n in sizes.items() if n > LONG_FILE_LINES and not says_why(p)]
    assert not unexplained, f"over {LONG_FILE_LINES} lines, no '{LONG_FILE_REASON}' in docstring"
    assert sizes["vlinfer/engine/llm_engine.py"] <= MAX_ENGINE_LINES


MAX_LINE_LENGTH = 100
LINE_CHECKED_DIRS = ("vlinfer", "tests", "bench", "tools", "apps", "examples")


def test_lines_fit_in_100_columns():
    """No line of a Python file in the code's folders is longer than MAX_LINE_LENGTH characters
    (the newline not counted)."""
    too_long = []
    for folder in LINE_CHECKED_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, folder)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        if len(line.rstrip("\r\n")) > MAX_LINE_LENGTH:
                            too_long.append(f"{os.path.relpath(path, REPO)}:{number}")
    assert not too_long, \
        f"{len(too_long)} line(s) over {MAX_LINE_LENGTH} characters: {', '.join(too_long)}"


# ---- the device layer: vlinfer/ops, one package per device behind ops/interface.py ----
OPS_DIR = os.path.join(ROOT, "ops")
BACKEND_PACKAGES = ("reference", "cpu", "cuda", "npu")
DEVICE_PACKAGES = tuple(f"vlinfer.ops.{name}" for name in ("cpu", "cuda", "npu"))


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_ops_is_one_package_per_device():
    """ops/'s top holds the interface, the selection and the public face; everything else is in a
    backend."""
    top = {name for name in os.listdir(OPS_DIR) if name != "__pycache__"}
    assert top == {"__init__.py", "interface.py", "select.py", *BACKEND_PACKAGES}
    for name in BACKEND_PACKAGES:
        init = os.path.join(OPS_DIR, name, "__init__.py")
        assert os.path.isfile(init), f"ops/{name} is not a package"


def test_only_the_ops_select_device_packages():
    """Nothing outside vlinfer.ops imports a device package (lazy imports included): the engine,
    layers and models see the interface and ops.select; bench/ and tests/ may."""
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if not _in_package(m, "vlinfer.ops")
                 for t in targets if any(_in_package(t, p) for p in DEVICE_PACKAGES))
    assert not bad, "device packages imported from outside vlinfer.ops: " + "; ".join(bad)


def test_a_backend_imports_the_interface_the_reference_platform_and_itself():
    allowed_below = ("vlinfer.ops.interface", "vlinfer.ops.reference", "vlinfer.platform")
    bad = []
    for name in BACKEND_PACKAGES:
        package = f"vlinfer.ops.{name}"
        for m in (m for m in GRAPH if _in_package(m, package)):
            bad += [f"{m} -> {t}" for t in GRAPH[m]
                    if not any(_in_package(t, p) for p in (package, *allowed_below))]
    assert not bad, "backend imports outside its package, the interface, the reference and " \
        "platform: " + "; ".join(sorted(bad))


def test_the_op_list_has_one_definition_and_every_backend_keeps_to_it():
    """OPS is derived from ops/interface.py's declarations, assigned nowhere else; the reference
    defines every op; every device table's public members are ops or the interface's declared
    questions (QUESTIONS)."""
    from vlinfer.ops import OPS, QUESTIONS, Backend, ReferenceOps
    from vlinfer.ops.cpu import CpuOps
    from vlinfer.ops.cuda import CudaOps
    from vlinfer.ops.npu import NpuOps
    assigned = [os.path.relpath(path, REPO) for path in MODULES.values()
                if re.search(r"^OPS\s*=", open(path).read(), re.M)]
    assert assigned == ["vlinfer/ops/interface.py"]
    assert OPS and not set(OPS) & set(QUESTIONS)
    undefined = [op for op in OPS if getattr(ReferenceOps, op) is getattr(Backend, op)]
    assert not undefined, f"ops with no reference definition: {undefined}"
    for table in (ReferenceOps, CpuOps, CudaOps, NpuOps):
        public = {name for name in vars(table) if not name.startswith("_")}
        extra = sorted(public - set(OPS) - set(QUESTIONS))
        assert not extra, f"{table.__name__} has public members outside the interface: {extra}"



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
    """Only constants (UPPER_CASE, never rebound), the logger and __all__ at module level; no
    `global`."""
    tree = ast.parse(open(MODULES[module]).read())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Global, ast.Nonlocal))
                ], f"{module} uses global"
    bad = []
    for name, node in _module_level_names(module):
        constant = name.lstrip("_").isupper() and not isinstance(node, ast.AugAssign)
        if not (constant or name in ("logger", "__all__")):
            bad.append(name)
    assert not bad, f"{module} has module-level variables {bad}"


def test_module_constants_unchanged_by_running_engines(qwen3_checkpoint):
    """The constants the rule above lets through are not mutated at run time: two engines run, and
    every module-level value in vlinfer.ops / vlinfer.layers compares equal to its copy from before.
    """
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
    assert NPU_NOTE in cited  # the scan sees the citations (vlinfer/ops/npu/ cites the NPU note)
    missing = {
        doc: files
        for doc, files in cited.items() if not os.path.isfile(os.path.join(REPO, doc))
    }
    assert not missing, f"documents cited but not in the repository: {missing}"


def _sections(text: str) -> dict[str, str]:
    """'2.3' -> that section's text, from headings '## 2. ...' / '### 2.3 ...' (a section holds its
    subsections)."""
    heads = [(m.start(), m.group(1), len(m.group(0).split()[0]))
             for m in re.finditer(r"^(?:##|###) (\d+(?:\.\d+)?)\.? ", text, re.M)]
    sections = {}
    for i, (start, number, level) in enumerate(heads):
        end = next((s for s, _, lv in heads[i + 1:] if lv <= level), len(text))
        sections[number] = text[start:end]
    return sections


def test_npu_note_has_every_section_and_source_the_code_cites():
    """Files citing the NPU note refer to its sections (§2.3, §2.3 "Masks") and to the wheel's
    docstring lines (OPD:8219); each must be in the note, so a citation always leads somewhere."""
    with open(os.path.join(REPO, NPU_NOTE), encoding="utf-8") as f:
        note = f.read()
    sections = _sections(note)
    citing = [
        path for path in CITING
        if "npu-ops.md" in open(path, encoding="utf-8", errors="replace").read() and
        not path.endswith("test_code_layout.py")
    ]
    assert any(p.endswith(os.path.join("ops", "npu", "backend.py")) for p in citing)
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
