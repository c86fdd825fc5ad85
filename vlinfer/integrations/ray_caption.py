"""Batch captioning on a Ray cluster: Ray Data streams rows of image paths through a pool of actors, each holding
one vlinfer engine, and the driver writes the records as blocks come back.

The guarantees are the single-process captioner's (vlinfer/captioning/): the output is the state. Every block that
comes back is appended and fsync'ed (JSONL) or written as one part file, atomically (Parquet), before the next one
is taken, so a killed job loses at most the blocks in flight, and `resume=True` skips every path already recorded.
Blocks are sized to one engine batch, so "in flight" is at most a batch per replica plus Ray's small prefetch.

Rows in: {"path": str} or {"path": str, "bytes": bytes} (the bytes are the image; the path names it), with
optional "prompt" (str) and "sampling" (a JSON object of SamplingParams fields) overriding the job's defaults.
Rows out: the caption records of captioning.make_record (path, caption, tokens, size, num_image_tokens, error), in
input order within each block. A path that is not local (s3://, gs://, hdfs://, ...) is read on the actor through
pyarrow's filesystems, the ones Ray Data reads tables from."""
import json
import logging
import math
import os
import time

from vlinfer.captioning import (IMAGE_RECORD_FIELDS, CaptionInputError, CaptionSummary, check_output, error_record,
                                image_limits, make_record, read_records)
from vlinfer.inputs.limits import text_only
from vlinfer.integrations import require_ray
from vlinfer.platform import set_process_threads

logger = logging.getLogger("vlinfer")

TABLE_SUFFIXES = (".parquet", ".jsonl", ".json")


def parquet_schema():
    """The caption record's field table (captioning.records.IMAGE_RECORD_FIELDS) as one pyarrow schema for every
    part: a field added there is a column here."""
    import pyarrow as pa
    types = {"string": pa.string(), "int64": pa.int64(), "double": pa.float64(), "list<int64>": pa.list_(pa.int64())}
    return pa.schema([(name, types[kind]) for name, kind in IMAGE_RECORD_FIELDS.items()])


def _remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _read_remote(path: str) -> bytes:
    import pyarrow.fs
    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    with fs.open_input_stream(inner) as f:
        return f.read()


class CaptionStage:
    """A Ray Data map_batches stage: one engine per actor, built once, captioning each batch it is given."""

    def __init__(self, model: str, engine_options: dict, prompt: str, sampling: dict, max_pixels: int | None,
                 threads: int | None = None):
        from vlinfer import LLM
        if threads:  # an actor's share of the node's cores; torch would otherwise take them all
            set_process_threads(threads)
        self.llm = LLM(model, **engine_options)
        if not self.llm.engine.is_multimodal:
            raise ValueError(text_only(model, "images"))
        self.prompt, self.sampling = prompt, sampling
        self.mm_kwargs = image_limits(self.llm, max_pixels)

    def __call__(self, batch: dict) -> dict:
        from vlinfer import SamplingParams
        from vlinfer.outputs import RequestError
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        records: list[dict | None] = [None] * len(rows)
        groups: dict[str, list[int]] = {}  # one engine run per distinct sampling setting, in row order
        for i, row in enumerate(rows):
            sampling = row.get("sampling") or ""  # a JSON string, or an object when the table holds one
            groups.setdefault(sampling if isinstance(sampling, str) else json.dumps(sampling, sort_keys=True),
                              []).append(i)
        for sampling_json, indices in groups.items():
            try:
                params = SamplingParams(**{**self.sampling, **(json.loads(sampling_json) if sampling_json else {})})
            except (ValueError, TypeError) as e:  # a row's bad options: its error, not the job's
                for i in indices:
                    records[i] = error_record(rows[i]["path"], f"sampling: {e}")
                continue
            conversations = []
            for i in indices:
                row = rows[i]
                try:
                    image = row.get("bytes") or (_read_remote(row["path"]) if _remote(row["path"]) else row["path"])
                except OSError as e:
                    image = None
                    records[i] = error_record(row["path"], f"cannot read {row['path']!r}: {e}")
                conversations.append([{"role": "user", "content": [
                    {"type": "image", "image": image}, {"type": "text", "text": row.get("prompt") or self.prompt}]}])
            try:
                outputs = self.llm.chat(conversations, params, use_tqdm=False, mm_processor_kwargs=self.mm_kwargs)
            except RequestError as e:  # some images were unreadable; the rest of the batch still ran
                outputs = e.outputs
            for i, output in zip(indices, outputs):
                if records[i] is None:
                    records[i] = make_record(rows[i]["path"], output)
        return {name: [r[name] for r in records] for name in IMAGE_RECORD_FIELDS}


# ---- outputs: a JSONL file, or a folder of Parquet part files ----
def _is_parquet(out: str) -> bool:
    return out.rstrip("/").endswith(".parquet")


def _recorded(out: str, resume: bool, overwrite: bool) -> list[dict]:
    """The records already in `out` (resume), after refusing to mix two runs by accident."""
    if not _is_parquet(out):
        check_output(out, resume, overwrite)
        if overwrite and os.path.exists(out):
            os.remove(out)
        return read_records(out) if resume else []
    if resume and overwrite:
        raise CaptionInputError("pass either --resume or --overwrite, not both")
    parts = sorted(n for n in os.listdir(out) if n.endswith(".parquet")) if os.path.isdir(out) else []
    if parts and not (resume or overwrite):
        raise CaptionInputError(f"{out} already has results; pass --resume to continue it or --overwrite to "
                                "start over")
    if overwrite:
        for name in parts:
            os.remove(os.path.join(out, name))
        return []
    import pyarrow.parquet as pq
    return [r for name in parts for r in pq.read_table(os.path.join(out, name)).to_pylist()]


class _Writer:
    def __init__(self, out: str):
        self.out, self.parquet = out, _is_parquet(out)
        if self.parquet:
            os.makedirs(out, exist_ok=True)
            self.part = len([n for n in os.listdir(out) if n.endswith(".parquet")])
            self.file = None
        else:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            self.file = open(out, "a", encoding="utf-8")

    def write(self, records: list[dict]) -> None:
        if not self.parquet:
            self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            self.file.flush()
            os.fsync(self.file.fileno())
            return
        import pyarrow as pa
        import pyarrow.parquet as pq
        name = os.path.join(self.out, f"part-{self.part:06d}.parquet")
        # One schema for every part: inferred per block, a block without an error (or a caption) typed that column
        # null, and a folder of parts with null and string columns failed to read back as one table.
        pq.write_table(pa.Table.from_pylist(records, schema=parquet_schema()), name + ".tmp")
        os.replace(name + ".tmp", name)  # a part is whole or absent: a kill never leaves half of one
        self.part += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# ---- inputs ----
def _input_dataset(ray, inputs: list[str], done: set[str], batch_size: int):
    """(dataset of rows still to caption, how many input paths, how many of them are already recorded)."""
    from vlinfer.captioning import collect_images
    tables = [i for i in inputs if i.lower().rstrip("/").endswith(TABLE_SUFFIXES)]
    if tables and len(tables) != len(inputs):
        raise CaptionInputError("give either tables of paths (.parquet/.jsonl) or images/folders/globs, not both")
    if not tables:
        paths = collect_images(inputs)
        todo = [p for p in paths if _key(p) not in done]
        rows = [{"path": p} for p in todo]
        blocks = max(1, math.ceil(len(rows) / batch_size))
        return (ray.data.from_items(rows, override_num_blocks=blocks) if rows else None), len(paths), \
            len(paths) - len(todo)
    readers = [ray.data.read_parquet(t) if t.lower().rstrip("/").endswith(".parquet") else ray.data.read_json(t)
               for t in tables]
    ds = readers[0].union(*readers[1:]) if len(readers) > 1 else readers[0]
    if "path" not in (ds.schema().names if ds.schema() else []):
        raise CaptionInputError(f"{', '.join(tables)}: the table needs a 'path' column")
    total = ds.count()
    ds = ds.filter(lambda row: _key(row["path"]) not in done) if done else ds
    remaining = ds.count()
    # Read, filtered and cut into blocks of one batch before the engines start: the engine actors then hold the
    # CPUs, and read tasks queued behind them would wait forever; and a killed job loses at most the blocks in
    # flight only when a block is a batch, not a whole file.
    ds = ds.repartition(max(1, math.ceil(remaining / batch_size))).materialize() if remaining else None
    return ds, total, total - remaining


def _key(path: str) -> str:
    return path if _remote(path) else os.path.abspath(path)


# ---- the job ----
def caption_on_ray(inputs: list[str], out: str, *, model: str, engine_options: dict | None = None,
                   prompt: str = "Describe this image.", sampling: dict | None = None, batch_size: int = 8,
                   max_pixels: int | None = None, resume: bool = False, overwrite: bool = False, replicas: int = 1,
                   address: str | None = None, cpus_per_replica: float | None = None, gpus_per_replica: float = 0,
                   progress: bool = True) -> CaptionSummary:
    """Caption `inputs` (folders, globs, paths, .txt lists, or Parquet/JSONL tables with a 'path' column) on a Ray
    cluster (`address`, or a local one started here) with `replicas` engine actors into `out` (.jsonl, or a
    folder ending in .parquet)."""
    if replicas < 1 or batch_size < 1:
        raise ValueError(f"replicas and batch_size must be >= 1, got {replicas} and {batch_size}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the caption prompt must be a non-empty string")
    ray = require_ray()
    from vlinfer.loading import resolve_model
    resolve_model(model)  # a missing model fails here, not in every actor; the embedded one is built once, here
    done = {_key(r["path"]): r for r in _recorded(out, resume, overwrite)}
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=logger.isEnabledFor(logging.INFO))
    # Our own progress bar covers the whole cluster; Ray Data's per-operator bars and log lines would repeat it.
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ds, total, skipped = _input_dataset(ray, inputs, set(done), batch_size)
    previous_errors = sum(1 for r in done.values() if r.get("error"))
    cpus = cpus_per_replica or max(1.0, ray.cluster_resources().get("CPU", 1) // replicas)
    writer = _Writer(out)
    captioned = errors = tokens = 0
    start = time.perf_counter()
    from tqdm.auto import tqdm
    try:
        with tqdm(total=total - skipped, unit="img", desc="caption (ray)", disable=not progress,
                  dynamic_ncols=True) as bar:
            if ds is not None:
                results = ds.map_batches(
                    CaptionStage, batch_size=batch_size, concurrency=replicas, num_cpus=cpus,
                    num_gpus=gpus_per_replica or None, batch_format="default",
                    fn_constructor_kwargs=dict(model=model, engine_options=engine_options or {}, prompt=prompt,
                                               sampling=sampling or {}, max_pixels=max_pixels,
                                               threads=int(cpus) if not gpus_per_replica else None))
                for block in results.iter_batches(batch_size=None, batch_format="pyarrow"):
                    records = block.to_pylist()
                    writer.write(records)
                    for record in records:
                        errors += record["error"] is not None
                        captioned += record["error"] is None
                        tokens += record["tokens"]
                    elapsed = time.perf_counter() - start
                    bar.set_postfix({"tok/s": f"{tokens / elapsed:.1f}", "errors": errors}, refresh=False)
                    bar.update(len(records))
    finally:
        writer.close()
    return CaptionSummary(total, skipped, captioned, errors, tokens, time.perf_counter() - start, out,
                          previous_errors)
