"""Faults in the batch jobs' output with nothing lost. `vlinfer caption` (JSONL) and `vlinfer embed`
(JSONL and
Parquet) meet a fault planted at a random point of their output writing
(tests/support/fault_points.py): a
SIGKILL in the
middle of a batch's write, between two batches, or with a Parquet part whole but not yet renamed
into the folder;
or a disk that fills up in the middle of a write. Then:
- after a kill, `--resume` finishes the job: every input is in the output exactly once, with the
  record a run
  without faults gives it, and every record that was whole before the kill is unchanged;
- a full disk ends the run with exit code 3 and an error naming the output and the cause; the output
  keeps the
  batches before, whole, and nothing of the failed one (no half-written record, no temporary part);
  `--resume`
  then finishes the job as above.
Which batch and how much of it reached the disk are drawn from seeded generators; which fault where:
DEFAULT_POINTS
in the default suite, every one SLOW_ROUNDS times in the slow tier."""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from images import picture
from vlinfer.cli import main
from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl

from dependencies import REPO
DRIVER = os.path.join(REPO, "tests", "support", "fault_points.py")
TIMEOUT_S = 400  # a bound for a hung subprocess, not a speed check
ITEMS, BATCH = 10, 2  # five batches: a fault lands at one of the first four
ENGINE = ["--max-model-len", "512", "--kv-cache-size", "32M", "--no-progress"]
JOBS = {  # name -> (output file name, the points that apply to it)
    "caption-jsonl": ("captions.jsonl", ["mid-write", "between", "disk-full"]),
    "embed-jsonl": ("vectors.jsonl", ["mid-write", "between", "disk-full"]),
    "embed-parquet": ("vectors.parquet", ["mid-write", "between", "before-rename", "disk-full"]),
}
# The default suite: every point once, a full disk under both formats; the slow tier: every point of
# every job, SLOW_ROUNDS times over.
DEFAULT_POINTS = [("caption-jsonl", "mid-write"), ("caption-jsonl", "disk-full"),
                  ("embed-jsonl", "between"), ("embed-parquet", "before-rename"),
                  ("embed-parquet", "mid-write"), ("embed-parquet", "disk-full")]
SLOW_ROUNDS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The pictures, the embedder checkpoint, and each job's output from a run without faults."""
    root = tmp_path_factory.mktemp("faults")
    images = root / "images"
    images.mkdir()
    for i in range(ITEMS):
        picture(32 + i % 4 * 8, 48, 200 + i).save(images / f"p{i:02d}.png")
    embedder = build_tiny_qwen3_vl(str(root / "embedder"), seed=0, tie_word_embeddings=False)
    clean = {}
    for job, (name, _) in JOBS.items():
        out = root / f"clean-{name}"
        assert main(args(job, images, embedder, out)) == 0
        clean[job] = records(out)
    return images, embedder, clean


def args(job: str, images, embedder, out) -> list[str]:
    if job.startswith("caption"):
        return [
            "caption",
            str(images), "--out",
            str(out), "--batch-size",
            str(BATCH), "--max-pixels", "4096", "--max-tokens", "4", *ENGINE
        ]
    return [
        "embed",
        str(images), "--model", embedder, "--out",
        str(out), "--batch-size",
        str(BATCH), *ENGINE
    ]


def records(out) -> dict[str, dict]:
    """The output's records by path; fails if a path is recorded twice or a JSONL line is not whole
    JSON."""
    if str(out).endswith(".parquet"):
        rows = [
            r for part in sorted(out.glob("part-*.parquet"))
            for r in pq.read_table(str(part)).to_pylist()
        ]
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = [r["path"] for r in rows]
    assert len(paths) == len(set(paths)), "an input recorded twice"
    return {r["path"]: r for r in rows}


def whole(out) -> dict[str, bytes]:
    """What of the output is whole: the complete JSONL lines, or the Parquet parts, as bytes."""
    if str(out).endswith(".parquet"):
        return {p.name: p.read_bytes()
                for p in sorted(out.glob("part-*.parquet"))} if out.exists() else {}
    data = out.read_bytes() if out.exists() else b""
    return {"lines": data[:data.rfind(b"\n") + 1]}


def same_record(job: str, got: dict, want: dict) -> None:
    if job.startswith("caption"):
        assert got == want
    else:
        assert got["error"] is None and got["model"] == want["model"]
        np.testing.assert_allclose(got["vector"], want["vector"], atol=1e-5, rtol=0)


def run_with_fault(setup, tmp_path, job: str, point: str, k: int, cut: float) -> None:
    images, embedder, clean = setup
    out = tmp_path / JOBS[job][0]
    planted = subprocess.run(
        [sys.executable, DRIVER, point,
         str(k), str(cut), *args(job, images, embedder, out)], cwd=REPO, capture_output=True,
        text=True, timeout=TIMEOUT_S)
    before = whole(out)
    if point == "disk-full":
        assert planted.returncode == 3, planted.stderr[-3000:]
        assert "No space left on device" in planted.stderr and str(
            out) in planted.stderr, planted.stderr[-3000:]
        # The batches before the failed one, whole; nothing of it: no half line, no temporary part.
        done = records(out)
        assert len(done) == (k - 1) * BATCH
        if out.suffix == ".jsonl":
            assert out.read_bytes() == before["lines"]
        else:
            assert not [p for p in out.iterdir() if not p.name.startswith("part-")]
    else:
        # killed where the driver planted it
        assert planted.returncode == -9, planted.stderr[-3000:]
        # Whole records: the batches before; with "between" the k-th too; a JSONL batch cut
        # mid-write may have whole lines of its first records.
        done = len(records(out) if out.suffix == ".parquet" else
                   [json.loads(line) for line in before["lines"].decode().splitlines()])
        first = (k - (point != "between")) * BATCH
        assert first <= done <= first + (BATCH - 1) * (point == "mid-write" and
                                                       out.suffix == ".jsonl")
    resumed = subprocess.run(
        [sys.executable, "-m", "vlinfer", *args(job, images, embedder, out), "--resume"], cwd=REPO,
        capture_output=True, text=True, timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = whole(out)
    for name, data in before.items():  # nothing whole before the fault was rewritten or lost
        assert after[name].startswith(data) if name == "lines" else after[name] == data
    got = records(out)
    assert sorted(got) == sorted(clean[job])  # every input exactly once
    for path, record in got.items():
        same_record(job, record, clean[job][path])


def draws(seed: int, points: list[tuple[str, str]]) -> list[tuple[str, str, int, float]]:
    """(job, point, k, cut) per (job, point): a random batch k, a random share cut of it written."""
    rng = random.Random(seed)
    return [(job, point, rng.randint(1, ITEMS // BATCH - 1), round(rng.uniform(0.05, 0.95), 3))
            for job, point in points]


@pytest.mark.parametrize("job, point, k, cut", draws(0, DEFAULT_POINTS))
def test_fault_then_resume(setup, tmp_path, job, point, k, cut):
    run_with_fault(setup, tmp_path, job, point, k, cut)


@pytest.mark.slow  # many more points: `make test-full` and CI run it
@pytest.mark.parametrize(
    "job, point, k, cut",
    draws(1, [(job, point) for _ in range(SLOW_ROUNDS) for job, (_, points) in JOBS.items()
              for point in points]))
def test_many_faults_then_resume(setup, tmp_path, job, point, k, cut):
    run_with_fault(setup, tmp_path, job, point, k, cut)
