"""vlinfer on a Ray cluster (vlinfer.integrations): captioning with Ray Data and replicas behind one
endpoint with Ray Serve, on a local cluster this module starts (`ray start --head` on loopback, 2
CPUs) and stops.

200 small images (5 broken) captioned by 2 replicas equal the single-process captioner's records; a
CLI run killed halfway and resumed records every path exactly once; 32 concurrent image requests
through the official openai client against 2 Serve replicas equal offline greedy, and with one
replica killed mid-run its requests fail with an error while the rest complete and the replica comes
back. Slow (a cluster, several engines): `make test-full`."""
import base64
import concurrent.futures
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from processes import RAY, free_port as _free_port, sigkill_after_lines
from vlinfer import LLM, SamplingParams
from vlinfer.captioning import caption_files, collect_images
from vlinfer.integrations import MissingDependencyError

pytestmark = pytest.mark.slow

MODEL = "qwen3-vl-tiny"
# one image token per picture: the tests are about the bookkeeping, not the model
MAX_PIXELS = 32 * 32
MAX_TOKENS = 4
ENGINE = dict(max_model_len=256, kv_cache_bytes=16 * 2 ** 20)
from dependencies import REPO
@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """195 drawings (PNG/JPEG, 24..48 px) and 5 broken files."""
    folder = tmp_path_factory.mktemp("ray_images")
    rng = np.random.RandomState(1)
    for i in range(195):
        w, h = int(rng.randint(24, 49)), int(rng.randint(24, 49))
        pixels = rng.randint(0, 256, (h, w, 3)).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:03d}.{'png' if i % 4 else 'jpg'}")
    whole = (folder / "img_001.png").read_bytes()
    (folder / "broken_0.png").write_bytes(whole[:len(whole) // 2])
    (folder / "broken_1.jpg").write_bytes(rng.bytes(500))
    (folder / "broken_2.png").write_bytes(b"")
    (folder / "broken_3.webp").write_bytes(b"RIFF....WEBP")
    (folder / "broken_4.png").write_bytes(b"\x89PNG\r\n\x1a\n" + rng.bytes(100))
    return folder


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory):
    """The single-process captioner's records over the same folder: path -> record."""
    out = tmp_path_factory.mktemp("ref") / "captions.jsonl"
    with LLM(MODEL, **ENGINE) as llm:
        caption_files(llm, collect_images([str(images)]), str(out), batch_size=16,
                      max_pixels=MAX_PIXELS,
                      sampling_params=SamplingParams(temperature=0,
                                                     max_tokens=MAX_TOKENS), progress=False)
    return {r["path"]: r for r in map(json.loads, out.read_text().splitlines())}


def check_records(records: list[dict], reference: dict) -> None:
    paths = [r["path"] for r in records]
    assert len(paths) == len(set(paths)) == 200, "a path is missing or recorded twice"
    assert set(paths) == set(reference)
    assert sum(r["error"] is None for r in records) == 195
    broken = {os.path.basename(r["path"]) for r in records if r["error"]}
    assert broken == {
        f"broken_{i}.{ext}"
        for i, ext in enumerate(("png", "jpg", "png", "webp", "png"))
    }
    for r in records:
        ref = reference[r["path"]]
        # greedy: the same caption, token count and image size as one process
        if ref["error"] is None:
            assert (r["caption"], r["tokens"], r["size"], r["num_image_tokens"]) == \
                (ref["caption"], ref["tokens"], ref["size"], ref["num_image_tokens"]), r["path"]
        else:
            assert r["caption"] is None and r["error"] == ref["error"]


def test_two_replicas_caption_what_one_process_does(cluster, images, reference, tmp_path):
    from vlinfer.integrations.ray_caption import caption_on_ray
    out = tmp_path / "captions.jsonl"
    summary = caption_on_ray([str(images)], str(out), model=MODEL, engine_options=ENGINE,
                             batch_size=16, sampling=dict(temperature=0, max_tokens=MAX_TOKENS),
                             max_pixels=MAX_PIXELS, replicas=2, cpus_per_replica=1, progress=False)
    assert (summary.captioned, summary.errors, summary.total) == (195, 5, 200)
    check_records([json.loads(line) for line in out.read_text().splitlines()], reference)
    # The same job over a Parquet table of the paths, written as Parquet parts; then nothing left to
    # do.
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = tmp_path / "paths.parquet"
    pq.write_table(pa.table({"path": sorted(reference)}), table)
    parts = tmp_path / "captions.parquet"
    caption_on_ray([str(table)], str(parts), model=MODEL, engine_options=ENGINE, batch_size=32,
                   sampling=dict(temperature=0, max_tokens=MAX_TOKENS), max_pixels=MAX_PIXELS,
                   replicas=2, cpus_per_replica=1, progress=False)
    check_records(pq.read_table(parts).to_pylist(), reference)
    again = caption_on_ray([str(table)], str(parts), model=MODEL, engine_options=ENGINE,
                           resume=True, replicas=2, cpus_per_replica=1, progress=False)
    assert (again.captioned, again.skipped, again.previous_errors) == (0, 200, 5)


def cli(cluster: str, *args) -> list[str]:
    return [sys.executable, "-m", "vlinfer", "caption", *args, "--ray", cluster, "--replicas", "2",
            "--model", MODEL, "--max-tokens", str(MAX_TOKENS), "--max-pixels", str(MAX_PIXELS),
            "--max-model-len", "256", "--kv-cache-size", "16M", "--no-progress"]


def test_cli_killed_halfway_then_resumed(cluster, images, reference, tmp_path):
    out = tmp_path / "captions.jsonl"
    sigkill_after_lines(cli(cluster, str(images), "--out", str(out), "--batch-size", "8"), out, 40,
                        240, REPO)
    before = out.read_text()
    done_before = before.count("\n")
    assert 40 <= done_before < 200, done_before
    resumed = subprocess.run(
        cli(cluster, str(images), "--out", str(out), "--batch-size", "16", "--resume"), cwd=REPO,
        capture_output=True, text=True, timeout=300)
    # finished; some images could not be read
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    # nothing written before the kill was rewritten or lost
    assert out.read_text().startswith(before)
    check_records([json.loads(line) for line in out.read_text().splitlines()], reference)
    assert f"{done_before} already recorded, skipped" in resumed.stdout


def data_uri(path) -> str:
    image = Image.open(path).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _replica_pids(handle, want: int = 2, timeout: float = 60) -> set[int]:
    pids, deadline = set(), time.time() + timeout
    while len(pids) < want and time.time() < deadline:
        pids.add(handle.pid.remote().result())
    return pids


def test_serve_replicas_answer_and_survive_a_kill(cluster, images):
    import openai
    from ray import serve
    from vlinfer.integrations import ray_serve
    from vlinfer.serve import ServeConfig
    paths = [p for p in collect_images([str(images)])
             if os.path.basename(p).startswith("img_")][:32]
    config = ServeConfig(served_model_names=(MODEL,))
    port = _free_port()
    ray_serve.start(MODEL, ENGINE, config, replicas=2, port=port, cpus_per_replica=1)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120,
                               max_retries=0)

        def ask(path, max_tokens=MAX_TOKENS):
            answer = client.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=max_tokens, messages=[{
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data_uri(path)}},
                                {"type": "text", "text": "Describe this image."}]
                }], extra_body={
                    "mm_processor_kwargs": {"max_pixels": MAX_PIXELS, "min_pixels": MAX_PIXELS}
                })
            return answer.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(ask, paths))
        with LLM(MODEL, **ENGINE) as llm:
            offline = llm.chat([[{
                "role": "user", "content": [{"type": "image", "image": data_uri(p)},
                                            {"type": "text", "text": "Describe this image."}]
            }] for p in paths], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                               use_tqdm=False, mm_processor_kwargs={
                                   "max_pixels": MAX_PIXELS, "min_pixels": MAX_PIXELS
                               })
        assert answers == [o.outputs[0].text for o in offline]

        # Kill one replica while 32 longer requests are in flight: its requests fail, the others
        # complete.
        handle = serve.get_deployment_handle(ray_serve.DEPLOYMENT, app_name=ray_serve.DEPLOYMENT)
        victim = sorted(_replica_pids(handle))[0]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            # 200 tokens each (max_model_len 256): with 48, a fast CPU (AMD EPYC, 2026-12-02)
            # finished all 32 before the kill at 1 s, and no request failed
            futures = [pool.submit(ask, p, 200) for p in paths]
            time.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            results = []
            for f in futures:
                try:
                    results.append(f.result(timeout=180))  # an error or an answer, never a hang
                except openai.APIError as e:
                    results.append(e)
        failed = [r for r in results if isinstance(r, Exception)]
        assert failed and len(failed) < len(results), [type(r).__name__ for r in results]
        assert all(isinstance(r, str) for r in results if not isinstance(r, Exception))
        # The controller replaces the dead replica: two live ones again, neither the victim, and
        # both answer.
        deadline = time.time() + 120
        while time.time() < deadline:
            status = serve.status().applications[ray_serve.DEPLOYMENT].deployments[
                ray_serve.DEPLOYMENT]
            if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == 2:
                break
            time.sleep(1)
        pids = _replica_pids(handle)
        assert len(pids) == 2 and victim not in pids
        assert ask(paths[0]) == answers[0]
    finally:
        serve.shutdown()


def test_without_ray_the_flags_say_what_to_install(monkeypatch, tmp_path, capsys):
    import builtins
    from vlinfer.cli import main
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    from vlinfer.integrations import require_ray
    with pytest.raises(MissingDependencyError, match=r"vlinfer\[ray\]"):
        require_ray()
    (tmp_path / "a.png").write_bytes(b"")
    assert main(["caption", str(tmp_path), "--out", str(tmp_path / "o.jsonl"), "--ray"]) == 2
    assert "pip install 'vlinfer[ray]'" in capsys.readouterr().err


def test_parquet_parts_share_one_schema_whatever_their_rows(tmp_path):
    """Parts written from blocks where no row has an error, where every caption is missing, or both
    kinds mix: the folder reads back as one table (a column inferred as null in one part and string
    in another did not)."""
    import pyarrow.parquet as pq
    from vlinfer.captioning import IMAGE_RECORD_FIELDS, OutputWriter
    out = str(tmp_path / "captions.parquet")
    writer = OutputWriter(out, IMAGE_RECORD_FIELDS)
    ok = {
        "path": "a.png", "caption": "words", "tokens": 4, "size": [32, 32], "num_image_tokens": 1,
        "error": None
    }
    broken = {"path": "b.png", "caption": None, "tokens": 0, "size": None, "num_image_tokens": None,
              "error": "image 0: cannot identify image file"}
    writer.write([ok])
    writer.write([broken])
    writer.write([dict(ok, path="c.png"), dict(broken, path="d.png")])
    writer.close()
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["path"] for r in rows) == ["a.png", "b.png", "c.png", "d.png"]
    assert {r["path"]: r
            for r in rows}["a.png"] == ok and {r["path"]: r
                                               for r in rows}["b.png"] == broken
