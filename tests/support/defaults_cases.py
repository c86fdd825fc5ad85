"""Builders and constants of tests/project/test_defaults.py that other test modules use too
(load_demo): imported from here by every one of them, that module included."""
import importlib.util
from pathlib import Path

from dependencies import REPO

ROOT = Path(REPO)


def load_demo():
    spec = importlib.util.spec_from_file_location("vlinfer_demo_defaults",
                                                  ROOT / "apps" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
