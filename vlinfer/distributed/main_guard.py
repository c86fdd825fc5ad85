"""Whether the script that creates a tensor-parallel engine can be imported again by the spawned
workers: multiprocessing's spawn re-imports the main script, so an LLM(...) made by its top-level
code without `if __name__ == "__main__":` would start the workers again from every worker."""
import ast
import sys

GUARD_HINT = ("tensor_parallel_size > 1 spawns worker processes that import your script again: "
              "put the code that creates the LLM under `if __name__ == \"__main__\":` "
              "(docs/tensor-parallel.md)")


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and
            isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def unguarded_main_line() -> str | None:
    """'script.py:LINE' when the main script's top-level code outside a `__main__` guard is what
    called us, else None (no script: -c, a REPL, a notebook; a package's __main__.py, which
    multiprocessing does not re-import; a call from under the guard)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if not path or not path.endswith(".py") or (spec is not None and
                                                spec.name.endswith(".__main__")):
        return None
    line, frame = None, sys._getframe(1)
    while frame is not None:  # the outermost frame of the script's own top-level code
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and \
                node.body[0].lineno <= line <= node.end_lineno:
            return None
    return f"{path}:{line}"


def check_main_guard() -> None:
    """Before spawning: one line naming the script's line, instead of multiprocessing's
    bootstrapping error from every worker."""
    where = unguarded_main_line()
    if where is not None:
        raise RuntimeError(f"{where}: {GUARD_HINT}")
