"""What a newcomer reads is true: the README stays short and types no test counts, every claim of
docs/correctness.md names the test files behind it (its tests column, each file existing), the
default model is called what it is, every app's --port shows its default; every Python block of the
README and docs/ runs offline as written, or names what it needs and the offline file that runs the
same calls; the retrieval aliases and their errors behave as the README's block needs."""
import glob
import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest

from dependencies import REPO
from defaults_cases import load_demo

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
    are the one count stated, and tests/serve/test_serve_hostile.py checks it against the
    collection."""
    counts = re.findall(r"\b\d[\d,]*\s+(?:tests?|passed|failed|skipped|deselected)\b",
                        _read(README))
    assert not counts, counts


CORRECTNESS = os.path.join(REPO, "docs", "correctness.md")


def unbacked_claims(text: str) -> list[str]:
    """The rows of the correctness table (| what | check | tests |) whose tests cell names no test
    file of the repository (`tests/.../test_*.py`), by their first words."""
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows and rows[0] == "| what | check | tests |", rows[:1]
    found = []
    for row in rows[1:]:
        tests_cell = row.rstrip(" |").rsplit(" | ", 1)[-1]
        named = re.findall(r"`(tests/[\w/]+/test_\w+\.py|tests/test_\w+\.py)`", tests_cell)
        if not named or not all(os.path.exists(os.path.join(REPO, n)) for n in named):
            found.append(row[2:].split(" | ")[0])
    return found


def test_every_correctness_claim_names_its_tests():
    assert unbacked_claims(_read(CORRECTNESS)) == []


def test_a_claim_without_a_test_or_with_a_missing_one_is_found():
    table = ("| what | check | tests |\n|---|---|---|\n"
             "| ok | a check | `tests/models/test_text_parity.py` |\n"
             "| no test | a claim |  |\n"
             "| gone | a claim | `tests/models/test_no_such_file.py` |\n")
    assert unbacked_claims(table) == ["no test", "gone"]


def test_the_default_model_is_not_called_random_weight():
    """Offline, qwen3-vl falls back to the trained toy, not to the random-weight model: the
    examples' README and serve --help say so."""
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


# ```python            : runs offline as written (a page's blocks in order, one namespace per page)
# ```python needs="WHAT" twin=PATH : needs WHAT; PATH runs the same calls offline (a test, an
#                                    example)
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```$", re.M | re.S)
MARK = re.compile(r'^ needs="([^"]+)" twin=(\S+)$')


def doc_pages() -> list[str]:
    return [README] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def python_blocks(path: str) -> list[tuple[int, str, str]]:
    """(line, info string after 'python', code) of each fenced Python block."""
    text = _read(path)
    return [(text[:m.start()].count("\n") + 1, m.group(1), m.group(2))
            for m in FENCE.finditer(text)]


def test_every_python_block_runs_offline_or_names_its_needs_and_twin():
    blocks = {page: python_blocks(page) for page in doc_pages()}
    assert sum(map(len, blocks.values())) >= 10
    for page, found in blocks.items():
        for line, info, _ in found:
            if not info.strip():
                continue
            mark = MARK.match(info)
            assert mark, f"{page}:{line}: info string {info!r}: needs=\"...\" twin=PATH or nothing"
            assert os.path.isfile(os.path.join(REPO, mark.group(2))), f"{page}:{line}: no twin"


RUNNER = """
import json, sys, traceback
for page, blocks in json.load(open(sys.argv[1])):
    namespace = {"__name__": "__doc_block__"}
    for line, code in blocks:
        try:
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {page}:{line}", file=sys.stderr)
            sys.exit(1)
        print(f"ran {page}:{line}", flush=True)
"""


# Pages whose blocks load several models (the README's: every model, captions of a folder, about two
# minutes on two vCPUs): the slow tier; the rest run by default.
SLOW_PAGES = ("README.md", "speculative.md")


def _offline_pages() -> list:
    """Each page with offline blocks, SLOW_PAGES marked slow."""
    pages = [(page, [(line, code) for line, info, code in python_blocks(page) if not info.strip()])
             for page in doc_pages()]
    return [pytest.param(os.path.relpath(page, REPO), blocks, id=os.path.basename(page),
                         marks=[pytest.mark.slow] if os.path.basename(page) in SLOW_PAGES
                         else [])
            for page, blocks in pages if blocks]


@pytest.mark.parametrize("page, blocks", _offline_pages())
def test_the_offline_blocks_run_as_written(page, blocks, tmp_path):
    """From the repository root with the Hugging Face hub offline, a page's blocks in order in one
    namespace: the embedded toys and SmolLM2 answer each."""
    (tmp_path / "blocks.json").write_text(json.dumps([(page, blocks)]))
    (tmp_path / "runner.py").write_text(textwrap.dedent(RUNNER))
    run = subprocess.run([sys.executable, str(tmp_path / "runner.py"),
                          str(tmp_path / "blocks.json")], capture_output=True, text=True,
                         timeout=900, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("ran ") == len(blocks)


def test_the_readme_has_offline_blocks():
    assert len(next(p for p in _offline_pages() if p.id == "README.md").values[1]) >= 4


@pytest.fixture(scope="module")
def toy_embedder():
    from vlinfer import Pipeline
    return Pipeline("qwen3-vl-embedding-2b", max_model_len=1024, kv_cache_bytes=16 << 20)


def test_the_2b_retrieval_aliases_fall_back_to_the_toys_offline(toy_embedder, monkeypatch):
    from vlinfer.loading import resolve_model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for alias, toy in (("qwen3-vl-embedding-2b", "qwen3-vl-toy-embedding"),
                       ("qwen3-vl-reranker-2b", "qwen3-vl-toy-reranker"),
                       ("qwen3-vl-reranker", "qwen3-vl-toy-reranker")):
        source, expected = resolve_model(alias), resolve_model(toy)
        assert source.embedded and source.name == alias
        assert (source.path, source.runner, source.hf_overrides, source.rerank_format) == \
            (expected.path, expected.runner, expected.hf_overrides, expected.rerank_format)
    assert toy_embedder.engine.pooling.task == "embed"


def test_dimensions_beyond_the_toy_are_one_error(toy_embedder):
    """Said once for the request, not once per item (the README's block asked for 512 of 128)."""
    with pytest.raises(ValueError) as e:
        toy_embedder.embed(texts=["a red house", "a blue star", "two dogs"], dimensions=512)
    assert type(e.value) is ValueError
    assert str(e.value).count("dimensions=512") == 1
    assert "larger than the model's embedding size 128" in str(e.value)


def test_text_outside_the_toys_vocabulary_is_warned(toy_embedder, caplog):
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        toy_embedder.embed(texts=["a red house"])
    assert not [r for r in caplog.records if "outside the toy's vocabulary" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        toy_embedder.embed(texts=["quantum chromodynamics"])
    warned = [r.getMessage() for r in caplog.records if "outside the toy's vocabulary" in
              r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("qwen3-vl-embedding-2b: "), warned
