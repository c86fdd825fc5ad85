"""Batch captioning (vlinfer.captioning and `python -m vlinfer caption`): inputs, per-image errors,
and a run killed with SIGKILL then resumed without redoing or losing any image. Uses the embedded
tiny Qwen3-VL with a few image tokens per picture and 4 output tokens, so the whole file stays well
under a minute and a half."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image, ImageDraw

from processes import sigkill_after_lines
from vlinfer import LLM, RequestError, SamplingParams
from vlinfer.captioning import (DEFAULT_PROMPT, CaptionInputError, caption_files, collect_images,
                                read_records)

MODEL = "qwen3-vl-tiny"
# a few image tokens per picture: the test is about the bookkeeping, not the model
MAX_PIXELS = 64 * 64
BROKEN = ("broken_truncated.png", "broken_random.jpg", "broken_empty.png")
from dependencies import REPO
RECORD_KEYS = {"path", "caption", "tokens", "size", "num_image_tokens", "error"}


def drawing(rng: np.random.RandomState) -> Image.Image:
    w, h = int(rng.randint(64, 161)), int(rng.randint(48, 121))
    img = Image.new("RGB", (w, h), tuple(int(c) for c in rng.randint(0, 256, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.randint(2, 6))):
        x0, y0 = int(rng.randint(0, w - 8)), int(rng.randint(0, h - 8))
        box = [x0, y0, x0 + int(rng.randint(4, w - x0)), y0 + int(rng.randint(4, h - y0))]
        color = tuple(int(c) for c in rng.randint(0, 256, 3))
        (d.ellipse if rng.rand() < 0.5 else d.rectangle)(box, fill=color)
    return img


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """47 readable drawings (PNG and JPEG, 64x48 to 160x120) and 3 broken files, 50 in all."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.RandomState(0)
    for i in range(47):
        drawing(rng).save(folder / f"img_{i:02d}.{'png' if i % 3 else 'jpg'}")
    whole = (folder / "img_01.png").read_bytes()
    (folder / BROKEN[0]).write_bytes(whole[:len(whole) // 2])  # a PNG cut in half
    (folder / BROKEN[1]).write_bytes(rng.bytes(2000))  # random bytes named .jpg
    (folder / BROKEN[2]).write_bytes(b"")  # an empty file
    (folder / "notes.txt").write_text("not an image: skipped by extension\n")
    return folder


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=512, kv_cache_bytes=32 * 2 ** 20)


def check_file(out, folder) -> list[dict]:
    """The finished output: every input exactly once, 47 captions, 3 errors naming the broken files.
    """
    with open(out) as f:
        lines = f.read().splitlines()
    records = [json.loads(line) for line in lines]  # every line is whole JSON
    paths = [r["path"] for r in records]
    assert len(paths) == len(set(paths)) == 50, "a path is missing or recorded twice"
    assert set(paths) == set(collect_images([str(folder)]))
    assert all(set(r) == RECORD_KEYS for r in records)
    errors = {os.path.basename(r["path"]): r["error"] for r in records if r["error"]}
    assert set(errors) == set(BROKEN), errors
    assert "truncated" in errors["broken_truncated.png"]
    assert "cannot identify image format" in errors["broken_random.jpg"]
    good = [r for r in records if not r["error"]]
    assert len(good) == 47
    for r in good:
        assert isinstance(r["caption"], str) and 1 <= r["tokens"] <= 4
        assert len(
            r["size"]
        ) == 2 and r["size"][0] * r["size"][1] <= MAX_PIXELS and r["num_image_tokens"] >= 1
    return records


def test_collect_images(image_dir, tmp_path, monkeypatch):
    paths = collect_images([str(image_dir)])
    assert len(paths) == 50 and paths == sorted(paths) and not any(
        p.endswith(".txt") for p in paths)
    assert collect_images([str(image_dir / "img_0*.png")
                           ]) == [p for p in paths if "img_0" in p and p.endswith(".png")]
    listing = tmp_path / "list.txt"
    listing.write_text(
        f"# two images, one twice, one relative to this list\n{paths[3]}\n\n{paths[3]}\n"
        f"{os.path.relpath(paths[0], tmp_path)}\n")
    # the relative entry is not valid from here: taken from the list
    monkeypatch.chdir(tmp_path.parent.parent)
    assert [os.path.abspath(p) for p in collect_images([str(listing)])] == [paths[3], paths[0]]
    # kept, and recorded as an error when captioned
    assert collect_images(["missing.png"]) == ["missing.png"]
    with pytest.raises(CaptionInputError, match="no files match"):
        collect_images([str(image_dir / "*.gif")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CaptionInputError, match="no image files"):
        collect_images([str(empty)])


def test_read_records_tolerates_only_a_truncated_tail(tmp_path):
    out = tmp_path / "c.jsonl"
    out.write_text(
        '{"path": "a.png", "error": null}\n{"path": "b.png", "error": "x"}\n{"path": "c.p')
    assert [r["path"] for r in read_records(str(out))] == ["a.png", "b.png"]
    # the partial line is cut, so the next record starts cleanly
    assert out.read_text().endswith('"x"}\n')
    # a whole last record missing its newline: kept
    out.write_text('{"path": "a.png"}\n{"path": "b.png"}')
    assert len(read_records(str(out))) == 2 and out.read_text().endswith("}\n")
    out.write_text('{"path": "a.png"}\ngarbage\n{"path": "b.png"}\n')
    with pytest.raises(CaptionInputError, match="line 2"):
        read_records(str(out))


def test_caption_folder_records_errors_and_goes_on(llm, image_dir, tmp_path):
    out = tmp_path / "captions.jsonl"
    paths = collect_images([str(image_dir)])
    params = SamplingParams(temperature=0, max_tokens=4)
    summary = caption_files(llm, paths, str(out), batch_size=8, sampling_params=params,
                            max_pixels=MAX_PIXELS, progress=False)
    assert (summary.captioned, summary.errors, summary.skipped) == (47, 3, 0)
    records = check_file(out, image_dir)
    assert [r["path"] for r in records] == paths  # batches are written in input order
    # Each record holds its own image's caption: every batch of eight (the first holds the 3
    # broken files) again, as one chat call of the same conversations and image limits (the
    # captioner lowers min_pixels to max_pixels): the same batch, the same numbers.
    limits = {"max_pixels": MAX_PIXELS, "min_pixels": MAX_PIXELS}
    answered = 0
    for start in range(0, len(paths), 8):
        batch = [[{
            "role": "user", "content": [{"type": "image", "image": p},
                                        {"type": "text", "text": DEFAULT_PROMPT}]
        }] for p in paths[start:start + 8]]
        try:
            again = llm.chat(batch, params, use_tqdm=False, mm_processor_kwargs=limits)
        except RequestError as e:  # a broken file in the batch: its error, the others' outputs
            again = e.outputs
        assert len(again) == len(batch)
        for record, out_ in zip(records[start:start + 8], again):
            if out_.error is None:
                assert (record["caption"],
                        record["tokens"]) == (out_.outputs[0].text.strip(),
                                              len(out_.outputs[0].token_ids)), record["path"]
                assert record["size"] == out_.images[0]["size"]
                answered += 1
            else:
                assert record["caption"] is None and record["error"] in out_.error
    assert answered == 47
    assert summary.tokens == sum(r["tokens"] for r in records)
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()
    # Nothing to do a second time; without resume/overwrite an existing file is refused.
    again = caption_files(llm, paths, str(out), sampling_params=params, max_pixels=MAX_PIXELS,
                          resume=True, progress=False)
    assert (again.captioned, again.errors, again.skipped, again.previous_errors) == (0, 0, 50, 3)
    with pytest.raises(CaptionInputError, match="--resume"):
        caption_files(llm, paths, str(out), progress=False)


def cli(*args) -> list[str]:
    return [
        sys.executable, "-m", "vlinfer", "caption", *args, "--model", MODEL, "--max-tokens", "4",
        "--max-pixels",
        str(MAX_PIXELS), "--max-model-len", "512", "--kv-cache-size", "32M"
    ]


def test_kill_then_resume(image_dir, tmp_path):
    out = tmp_path / "captions.jsonl"
    sigkill_after_lines(cli(str(image_dir), "--out", str(out), "--batch-size", "2"), out, 10, 120,
                        REPO)
    before = out.read_text()
    done_before = before.count("\n")
    assert 10 <= done_before < 50, done_before
    # A kill can also land in the middle of a write: leave half a record behind for --resume to cope
    # with.
    with open(out, "a") as f:
        f.write('{"path": "' + str(image_dir / "img_46.png")[:20])
    resumed = subprocess.run(
        cli(str(image_dir), "--out", str(out), "--batch-size", "8", "--resume", "--no-progress"),
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 1, resumed.stderr  # 1: finished, but some images could not be read
    records = check_file(out, image_dir)
    # nothing written before the kill was rewritten or lost
    assert out.read_text().startswith(before)
    done_after = [r["path"] for r in records[done_before:]]
    assert set(done_after).isdisjoint(r["path"] for r in records[:done_before])
    summary = resumed.stdout.strip().splitlines()[-1]
    new_errors = sum(1 for r in records[done_before:] if r["error"])
    assert summary.startswith(
        f"captioned {50 - done_before - new_errors} image(s), {new_errors} error(s)"), summary
    assert f"{done_before} already recorded, skipped" in summary, summary
    assert "truncated last line" in resumed.stderr and "MEANINGLESS" in resumed.stderr


def test_cli_refuses_before_loading_the_model(image_dir, tmp_path, monkeypatch):
    import vlinfer.cli.caption as caption_command
    from vlinfer.cli import main
    loads = []
    monkeypatch.setattr(caption_command, "build_llm", lambda *args: loads.append(args))
    out = tmp_path / "exists.jsonl"
    out.write_text('{"path": "x.png"}\n')
    assert main(["caption", str(image_dir), "--out", str(out), "--model", "no-such-model"]) == 2
    assert main(["caption",
                 str(tmp_path / "nothing*.png"), "--out",
                 str(tmp_path / "o.jsonl")]) == 2
    # both refused up front, before the model load (seen, not inferred from a clock)
    assert loads == []


def test_records_and_the_parquet_schema_share_one_field_list():
    """make_record's and error_record's records have exactly caption.IMAGE_RECORD_FIELDS, in order,
    and the Ray captioner's Parquet schema types each of them: a field added to the record cannot be
    dropped from the table."""
    from types import SimpleNamespace

    from vlinfer.captioning import IMAGE_RECORD_FIELDS, VIDEO_FIELDS, error_record, make_record
    from vlinfer.captioning.output import arrow_schema
    completion = SimpleNamespace(text=" a red square ", token_ids=[1, 2, 3], finish_reason="stop")
    ok = make_record(
        "a.png",
        SimpleNamespace(error=None, images=[{"size": [32, 32], "num_tokens": 4}],
                        outputs=[completion]))
    broken = make_record("b.png", SimpleNamespace(error="image 0: cannot identify image file"))
    assert tuple(ok) == tuple(broken) == tuple(error_record("c.png",
                                                            "x")) == tuple(IMAGE_RECORD_FIELDS)
    assert ok["caption"] == "a red square" and broken["error"] == "cannot identify image file"
    assert tuple(error_record("c.mp4", "x", video=True)) == (*IMAGE_RECORD_FIELDS, *VIDEO_FIELDS)
    schema = arrow_schema(IMAGE_RECORD_FIELDS)
    assert tuple(schema.names) == tuple(IMAGE_RECORD_FIELDS)
    assert [str(schema.field(name).type).replace("list<item: int64>", "list<int64>")
            for name in schema.names] == list(IMAGE_RECORD_FIELDS.values())
