"""One owner per piece of engine state, checked on the source: a sequence's progress
(num_computed_tokens), its proposals (spec_token_ids) and its KV blocks change only in
engine/scheduler.py (and Sequence's constructor); a step's result reaches them through
Scheduler.update alone, which caches full blocks and rolls back rejected proposals. Each scan names
the writers it finds, so a new writer elsewhere fails here by name."""
import ast
import os

from dependencies import REPO
ROOT = os.path.join(REPO, "vlinfer")
SCHEDULER = "vlinfer/engine/scheduler.py"
SEQUENCE_INIT = ("vlinfer/engine/sequence.py", "Sequence.__init__")
# What drives a BlockManager (its own file calls its own helpers).
BLOCK_MANAGER_CALLS = {"allocate", "allocate_prefix", "free", "trim", "cache_full_blocks",
                       "reset_prefix_cache", "reserve_checkpoint", "commit_checkpoints",
                       "drop_pending_checkpoints"}


def _scopes(tree: ast.AST):
    """(qualified name of the enclosing function, node) for every node of a module."""
    def walk(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
                yield inner, child
                yield from walk(child, inner)
            else:
                yield scope, child
                yield from walk(child, scope)
    yield from walk(tree, "")


def _tail(node: ast.AST) -> str | None:
    """The last name of a call's receiver: block_manager in self.engine.block_manager.free(seq)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def scan(sources: dict[str, str]) -> tuple[dict, dict, set]:
    """Over the sources: attribute -> {(path, scope)} assigning it; method name -> {(path, scope)}
    calling it; {(path, scope, method)} calling a block manager's method on a `block_manager`."""
    writes, calls, on_block_manager = {}, {}, set()
    for path, text in sources.items():
        for scope, node in _scopes(ast.parse(text)):
            targets = []
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in ast.walk(target)]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute):
                    writes.setdefault(target.attr, set()).add((path, scope))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                method = node.func.attr
                calls.setdefault(method, set()).add((path, scope))
                if method in BLOCK_MANAGER_CALLS and _tail(node.func.value) == "block_manager":
                    on_block_manager.add((path, scope, method))
    return writes, calls, on_block_manager


def _sources() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, REPO)] = open(path, encoding="utf-8").read()
    return found


WRITES, CALLS, ON_BLOCK_MANAGER = scan(_sources())


def test_the_scan_sees_writes_and_calls_where_they_are():
    source = ("class E:\n    def step(self, seq):\n        seq.num_computed_tokens += 1\n"
              "        x.seq.num_computed_tokens, y = 0, 1\n"
              "        self.block_manager.cache_full_blocks(seq)\n")
    writes, calls, on_block_manager = scan({"a.py": source})
    assert writes["num_computed_tokens"] == {("a.py", "E.step")}
    assert calls["cache_full_blocks"] == {("a.py", "E.step")}
    assert on_block_manager == {("a.py", "E.step", "cache_full_blocks")}


def test_only_the_scheduler_writes_progress():
    assert WRITES["num_computed_tokens"] == {
        SEQUENCE_INIT,
        (SCHEDULER, "Scheduler.schedule"),  # admission: the prefix cache's tokens, or none
        (SCHEDULER, "Scheduler._preempt"),  # recompute: back to none
        (SCHEDULER, "Scheduler.update"),  # a step's tokens
        (SCHEDULER, "Scheduler.rollback"),  # rejected proposals, a draft shadow's stale tokens
    }


def test_only_the_scheduler_places_proposals():
    assert WRITES["spec_token_ids"] == {SEQUENCE_INIT, (SCHEDULER, "Scheduler.add_proposals"),
                                        (SCHEDULER, "Scheduler.update"),
                                        (SCHEDULER, "Scheduler.finish")}


def test_only_scheduler_update_caches_blocks_and_rolls_back():
    assert CALLS["cache_full_blocks"] == {(SCHEDULER, "Scheduler.update")}
    assert CALLS["trim"] == {(SCHEDULER, "Scheduler.rollback")}
    # Rejected proposals after a step; a draft model's shadows (through the draft's own Scheduler)
    # when their target kept other tokens than they proposed.
    draft = "vlinfer/engine/speculative/draft_model.py"
    assert CALLS["rollback"] == {(SCHEDULER, "Scheduler.update"), (draft, "DraftModel._shadow")}


def test_only_the_scheduler_drives_the_block_manager():
    """Allocation, freeing, caching, rollback and the prefix cache's reset all go through the
    scheduler; the engine and the server only read the pool (its sizes and counts)."""
    callers = {(path, method) for path, _, method in ON_BLOCK_MANAGER}
    assert {path for path, _ in callers} == {SCHEDULER}
    assert {method for _, method in callers} == BLOCK_MANAGER_CALLS


def test_only_the_block_manager_hands_out_state_slots():
    """A hybrid model's state slot is taken with a sequence's first blocks and given back with
    them (BlockManager.allocate / free, driven by the scheduler alone); the model runner's
    throwaway profiling sequence is the one other writer."""
    manager = "vlinfer/engine/block_manager.py"
    assert WRITES["state_slot"] == {SEQUENCE_INIT, (manager, "BlockManager.allocate"),
                                    (manager, "BlockManager.free"),
                                    ("vlinfer/engine/model_runner.py",
                                     "ModelRunner.profile_peak_memory")}


def test_state_checkpoints_have_one_owner():
    """A hybrid model's prefix-cache checkpoints (docs/hybrid.md): the block manager reserves them
    as the scheduler places a step and keys them in Scheduler.update alone, after the step ran; a
    hit's restore is set by the block manager and handed to the step by the scheduler."""
    manager = "vlinfer/engine/block_manager.py"
    assert CALLS["commit_checkpoints"] == {(SCHEDULER, "Scheduler.update")}
    assert CALLS["reserve_checkpoint"] == {(SCHEDULER, "Scheduler._schedule")}
    assert WRITES["restore_slot"] == {SEQUENCE_INIT, (manager, "BlockManager.allocate_prefix"),
                                      (manager, "BlockManager.free"),
                                      (SCHEDULER, "Scheduler._schedule")}
