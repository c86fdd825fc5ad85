"""`python -m vlinfer embed` (vlinfer/cli/embed.py, captioning/embedder.py) and examples/search.py
on a tiny random Qwen3-VL opened with runner="pooling": a folder with a broken file gives one row
per file, the vectors Pipeline.embed gives and an error row; texts from a table; --dimensions; a run
SIGKILLed between batches and resumed embeds every item exactly once; the Ray Data job gives the
local rows (slow: a Ray cluster); the search example ranks by cosine, and with a reranker by its
scores."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from processes import sigkill_when
from images import picture
from vlinfer import Pipeline
from vlinfer.cli import main
from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl

from dependencies import REPO
TOL = 1e-5
ENGINE = dict(max_model_len=512, kv_cache_bytes=32 * 2 ** 20)
ENGINE_FLAGS = ["--max-model-len", "512", "--kv-cache-size", "32M"]
RERANKER = {
    "architectures": ["Qwen3VLForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True
}
# a bound for a hung subprocess, not a speed check (a busy 2-core machine)
SUBPROCESS_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("embedder")), seed=0,
                               tie_word_embeddings=False)


@pytest.fixture(scope="module")
def reranker(checkpoint, tmp_path_factory) -> str:
    """The same checkpoint declared a Qwen3-VL reranker in its config.json (what hf_overrides sets
    for an alias)."""
    import shutil
    folder = str(tmp_path_factory.mktemp("reranker"))
    shutil.copytree(checkpoint, folder, dirs_exist_ok=True)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, **RERANKER}, f)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """5 pictures (PNG and JPEG) and a broken PNG."""
    path = tmp_path_factory.mktemp("images")
    for i in range(5):
        picture(40 + 8 * i, 64 - 4 * i, i).save(path / f"img_{i}.{'jpg' if i == 2 else 'png'}")
    (path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return path


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return Pipeline(checkpoint, runner="pooling", **ENGINE)


def embed(checkpoint, *args) -> int:
    return main(["embed", *args, "--model", checkpoint, *ENGINE_FLAGS, "--no-progress"])


def rows_by_path(out) -> dict[str, dict]:
    rows = pq.read_table(str(out)).to_pylist() if str(out).endswith(".parquet") else \
        [json.loads(line) for line in open(out)]
    paths = [r["path"] for r in rows]
    assert len(paths) == len(set(paths)), "an item recorded twice"
    return {r["path"]: r for r in rows}


def assert_vectors(rows: dict, expected: dict) -> None:
    assert set(rows) == set(expected)
    for path, vector in expected.items():
        assert rows[path]["error"] is None and len(rows[path]["vector"]) == len(vector), path
        np.testing.assert_allclose(rows[path]["vector"], vector, atol=TOL, rtol=0, err_msg=path)


def test_folder_gives_pipeline_vectors_and_an_error_row(checkpoint, folder, pipe, tmp_path, capsys):
    out = tmp_path / "embeddings.parquet"
    # 1: an unreadable file
    assert embed(checkpoint, str(folder), "--out", str(out), "--batch-size", "2") == 1
    assert re.match(r"embedded 5 item\(s\), 1 error\(s\) in ", capsys.readouterr().out)
    table = pq.read_table(str(out))
    assert table.schema.names == ["path", "vector", "model", "instruction", "error"]
    assert table.schema.field("vector").type == pa.list_(pa.float32())
    rows = rows_by_path(out)
    broken = rows.pop(str(folder / "broken.png"))
    assert broken["vector"] is None and "cannot identify image format" in broken["error"]
    assert {r["model"] for r in [*rows.values(), broken]} == {checkpoint}
    paths = sorted(rows)
    assert_vectors(rows, dict(zip(paths, pipe.embed(images=paths))))
    # Nothing left to do on a rerun; an existing output without --resume / --overwrite is refused.
    # the recorded error stands
    assert embed(checkpoint, str(folder), "--out", str(out), "--resume") == 1
    assert "0 item(s)" in capsys.readouterr().out and len(rows_by_path(out)) == 6
    assert embed(checkpoint, str(folder), "--out", str(out)) == 2
    assert "--resume" in capsys.readouterr().err


def test_texts_of_a_table_instruction_and_dimensions(checkpoint, pipe, tmp_path, capsys):
    """A `vlinfer caption` output as the table: its captions embedded, named by their paths; a row
    without a caption is an error row. Then a CSV of ids and texts, with an instruction and 8
    dimensions, into JSONL."""
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps(r) + "\n" for r in [
        {"path": "a.png", "caption": "A red house.", "error": None},
        {"path": "b.png", "caption": "Two blue stars.", "error": None},
        {"path": "c.png", "caption": None, "error": "cannot identify image file"}]))
    out = tmp_path / "captions.parquet"
    assert embed(checkpoint, str(captions), "--text-column", "caption", "--out", str(out)) == 1
    rows = rows_by_path(out)
    assert rows.pop("c.png")["error"] == "no text to embed (the row's text is None)"
    assert_vectors(
        rows, dict(zip(["a.png", "b.png"], pipe.embed(texts=["A red house.", "Two blue stars."]))))

    table = tmp_path / "docs.csv"
    table.write_text('id,body\nd1,"A red house, two stars."\nd2,A yellow sun.\n')
    out = tmp_path / "docs.jsonl"
    instruction = "Represent the document for retrieval"
    assert embed(checkpoint, str(table), "--text-column", "body", "--id-column", "id",
                 "--instruction", instruction, "--dimensions", "8", "--out", str(out)) == 0
    expected = pipe.embed(texts=["A red house, two stars.", "A yellow sun."],
                          instruction=instruction, dimensions=8)
    assert_vectors(rows_by_path(out), {"d1": expected[0], "d2": expected[1]})
    # One output, one vector space: a resumed run with another length, instruction or model is
    # refused.
    # as the prompt had it
    assert all(r["instruction"] == instruction + "." for r in rows_by_path(out).values())
    assert embed(
        checkpoint,
        str(table),
        "--text-column",
        "body",
        "--id-column",
        "id",
        "--out",
        str(out),
        # nothing left: no vector of another length written
        "--instruction",
        instruction,
        "--resume") == 0
    table.write_text(table.read_text() + "d3,A green tree.\n")
    assert embed(checkpoint, str(table), "--text-column", "body", "--id-column", "id", "--out",
                 str(out), "--instruction", instruction, "--resume") == 2
    assert "a vector of 128 dimensions beside" in capsys.readouterr().err
    assert embed(
        checkpoint,
        str(table),
        "--text-column",
        "body",
        "--id-column",
        "id",
        "--out",
        str(out),
        # the default instruction: refused before the model loads
        "--dimensions",
        "8",
        "--resume") == 2
    assert (f"embedded with the instruction {instruction + '.'!r}, "
            "not \"Represent the user's input.\"") in capsys.readouterr().err
    assert main([
        "embed",
        str(table), "--text-column", "body", "--id-column", "id", "--out",
        str(out), "--resume", "--model", "qwen3-vl-tiny", *ENGINE_FLAGS, "--no-progress"
    ]) == 2
    assert f"holds records of model {checkpoint!r}" in capsys.readouterr().err
    assert len(rows_by_path(out)) == 2
    # Bad inputs are refused before any model loads.
    assert embed(checkpoint, str(table), "--text-column", "text", "--id-column", "id", "--out",
                 str(tmp_path / "x.parquet")) == 2
    assert "no 'text' column" in capsys.readouterr().err
    assert embed(checkpoint, str(table), "--text-column", "body", "--out",
                 str(tmp_path / "x.parquet")) == 2
    assert "no 'path' column (naming each row)" in capsys.readouterr().err
    assert embed(checkpoint, str(tmp_path), "--text-column", "body", "--out",
                 str(tmp_path / "x.parquet")) == 2
    assert "reads the texts of a table" in capsys.readouterr().err


def cli(checkpoint: str, *args) -> list[str]:
    return [
        sys.executable, "-m", "vlinfer", "embed", *args, "--model", checkpoint, *ENGINE_FLAGS,
        "--no-progress"
    ]


def test_records_from_before_the_instruction_column_resume():
    """An output written before records carried their instruction resumes (its instruction is
    unknown, so not checked); one that records another instruction does not."""
    from vlinfer.captioning.embedder import recorded_length
    from vlinfer.captioning.inputs import CaptionInputError
    legacy = [{"path": "a.png", "vector": [0.6, 0.8], "model": "m", "error": None}]
    assert recorded_length(legacy, "m", "Find pictures", "out.jsonl") == 2
    other = [dict(legacy[0], instruction="Find pictures.")]
    # recorded as the prompt had it
    assert recorded_length(other, "m", "Find pictures", "out.jsonl") == 2
    with pytest.raises(CaptionInputError,
                       match="embedded with the instruction 'Find pictures.', not \"Represent"):
        recorded_length(other, "m", None, "out.jsonl")


def test_kill_between_batches_then_resume(checkpoint, pipe, tmp_path):
    images = tmp_path / "many"
    images.mkdir()
    for i in range(24):
        picture(32 + i % 5 * 8, 48, 100 + i).save(images / f"p{i:02d}.png")
    out = tmp_path / "embeddings.parquet"

    def parts() -> list[str]:
        return sorted(p.name for p in out.glob("part-*.parquet")) if out.is_dir() else []

    sigkill_when(cli(checkpoint, str(images), "--out", str(out), "--batch-size", "2"),
                 lambda: len(parts()) >= 3, SUBPROCESS_TIMEOUT_S, REPO)
    before = {name: (out / name).read_bytes() for name in parts()}
    done_before = sum(pq.read_table(str(out / name)).num_rows for name in before)
    assert 6 <= done_before < 24, done_before
    resumed = subprocess.run(
        cli(checkpoint, str(images), "--out", str(out), "--batch-size", "4", "--resume"), cwd=REPO,
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"embedded {24 - done_before} item(s), 0 error(s)" in resumed.stdout
    assert f"{done_before} already recorded, skipped" in resumed.stdout
    # nothing rewritten or lost
    assert all((out / name).read_bytes() == data for name, data in before.items())
    rows = rows_by_path(out)  # every image exactly once
    paths = sorted(str(p) for p in images.glob("*.png"))
    assert sorted(rows) == paths
    assert_vectors(rows, dict(zip(paths, pipe.embed(images=paths))))


def search_example():
    """examples/search.py as a module (its constants)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("search_example",
                                                  os.path.join(REPO, "examples", "search.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def search(*args) -> list[str]:
    """The example's printed lines, run in this process (its main() is what `python
    examples/search.py` runs)."""
    import contextlib
    import io
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        search_example().main([*args, "--kv-cache-mb", "32"])
    return printed.getvalue().splitlines()


def test_search_example_ranks_by_cosine_then_by_the_reranker(checkpoint, reranker, folder, pipe,
                                                             tmp_path):
    out = tmp_path / "index.parquet"
    assert embed(checkpoint, str(folder), "--out", str(out)) == 1
    query = "a red house beside a tree"
    vector = np.array(pipe.embed(texts=[query], instruction=search_example().QUERY_INSTRUCTION)[0])
    rows = {path: r for path, r in rows_by_path(out).items() if r["error"] is None}
    by_cosine = sorted(rows, key=lambda path: -float(vector @ np.array(rows[path]["vector"])))
    lines = search(str(out), "--query", query, "--top-k", "3")
    assert lines[0].startswith(
        f"query: {query!r}; 5 items embedded by {checkpoint!r}, 1 unreadable skipped")
    assert [line.split()[-1] for line in lines[1:]] == by_cosine[:3]
    # The folder itself (embedded by the example as `vlinfer embed` embeds it): the same ranking.
    assert search(str(folder), "--model", checkpoint, "--query", query, "--top-k",
                  "3")[1:] == lines[1:]
    # Reranked: the reranker's scores over the cosine top 4, best first.
    lines = search(str(out), "--query", query, "--top-k", "2", "--candidates", "4", "--reranker",
                   reranker)
    ranked = Pipeline(reranker, runner="pooling",
                      **ENGINE).rerank(query, [{"image": p} for p in by_cosine[:4]], top_k=2)
    printed = [(line.split()[-1], float(line.split()[2])) for line in lines[1:]]
    assert [path for path, _ in printed] == [by_cosine[r["index"]] for r in ranked]
    np.testing.assert_allclose([score for _, score in printed], [r["score"] for r in ranked],
                               atol=1e-4)


@pytest.mark.slow  # a Ray cluster and two engine actors
def test_ray_job_gives_the_local_rows(cluster, checkpoint, folder, tmp_path):
    local, on_ray = tmp_path / "local.parquet", tmp_path / "ray.parquet"
    assert embed(checkpoint, str(folder), "--out", str(local)) == 1
    result = subprocess.run(
        cli(checkpoint, str(folder), "--out", str(on_ray), "--batch-size", "2", "--ray", cluster,
            "--replicas", "2"), cwd=REPO, capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 1, result.stderr[-3000:]  # 1: the broken file's error row
    assert "embedded 5 item(s), 1 error(s)" in result.stdout
    expected, rows = rows_by_path(local), rows_by_path(on_ray)
    assert set(rows) == set(expected)
    for path, row in rows.items():
        assert [row[k] for k in ("model", "instruction", "error")] == \
            [expected[path][k] for k in ("model", "instruction", "error")], path
        if row["error"] is None:
            np.testing.assert_allclose(row["vector"], expected[path]["vector"], atol=TOL, rtol=0,
                                       err_msg=path)
