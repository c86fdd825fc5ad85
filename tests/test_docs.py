"""What a newcomer reads is true: the README stays short and types no test counts, the default
model is called what it is, every app's --port shows its default."""
import os
import re

from conftest import REPO
from test_defaults import load_demo

README = os.path.join(REPO, "README.md")
# The README is the first page: past this, readers stop; details go to docs/.
README_MAX_LINES = 400


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_readme_stays_within_its_length():
    lines = _read(README).count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to docs/"


def test_readme_types_no_test_counts():
    """A count of tests typed into the README goes stale with the next test; the hostile-input cases
    are the one count stated, and tests/test_serve_hostile.py checks it against the collection."""
    counts = re.findall(r"\b\d[\d,]*\s+(?:tests?|passed|failed|skipped|deselected)\b",
                        _read(README))
    assert not counts, counts


def test_the_default_model_is_not_called_random_weight():
    """Offline, qwen3-vl falls back to the trained toy, not to the random-weight model: the examples'
    README and serve --help say so."""
    from vlinfer.cli.serve import build_parser
    from vlinfer.loading.sources import EMBEDDED_MODELS, OFFLINE_FALLBACK
    assert "random" not in EMBEDDED_MODELS[OFFLINE_FALLBACK["qwen3-vl"]]
    model_help = next(a.help for a in build_parser()._actions if a.dest == "model")
    for where, text in (("examples/README.md", _read(os.path.join(REPO, "examples", "README.md"))),
                        ("serve --help --model", model_help)):
        assert not re.search(r"random[- ]weight", text), where
        assert "toy" in text, where


def test_every_port_flag_shows_its_default():
    from vlinfer.cli.serve import build_parser
    for name, parser in (("serve", build_parser()), ("apps/demo.py", load_demo().build_parser())):
        port = next(a for a in parser._actions if a.dest == "port")
        assert f"default: {port.default}" in re.sub(r"\s+", " ", parser.format_help()), name
