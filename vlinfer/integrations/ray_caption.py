"""Batch captioning on a Ray cluster: Ray Data streams rows of image paths through a pool of actors,
each holding one vlinfer engine, and the driver writes the records as blocks come back.

The guarantees are the single-process captioner's (vlinfer/captioning/): the output is the state.
Every block that comes back is appended and fsync'ed (JSONL) or written as one part file, atomically
(Parquet), before the next one is taken, so a killed job loses at most the blocks in flight, and
`resume=True` skips every path already recorded. Blocks are sized to one engine batch, so "in
flight" is at most a batch per replica plus Ray's small prefetch.

Rows in: {"path": str} or {"path": str, "bytes": bytes} (the bytes are the image; the path names
it), with optional "prompt" (str) and "sampling" (a JSON object of SamplingParams fields) overriding
the job's defaults. Rows out: the caption records of captioning.make_record (path, caption, tokens,
size, num_image_tokens, error), in input order within each block. A path that is not local (s3://,
gs://, hdfs://, ...) is read on the actor through pyarrow's filesystems, the ones Ray Data reads
tables from."""
import json
import time

from vlinfer.captioning import (IMAGE_RECORD_FIELDS, CaptionSummary, OutputWriter, collect_images,
                                error_record, image_limits, make_record, recorded)
from vlinfer.captioning.inputs import key, media
from vlinfer.captioning.output import recorded_errors
from vlinfer.inputs.limits import text_only
from vlinfer.integrations import require_ray
from vlinfer.integrations.ray_data import (EngineStage, check_sizes, connect, input_dataset,
                                           run_stage)


class CaptionStage(EngineStage):
    """A Ray Data map_batches stage: one engine per actor, built once, captioning each batch it is
    given."""

    def __init__(self, model: str, engine_options: dict, prompt: str, sampling: dict,
                 max_pixels: int | None, threads: int | None = None):
        super().__init__(threads)
        from vlinfer import LLM
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
        # one engine run per distinct sampling setting, in row order
        groups: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            # a JSON string, or an object when the table holds one
            sampling = row.get("sampling") or ""
            groups.setdefault(
                sampling if isinstance(sampling, str) else json.dumps(sampling, sort_keys=True),
                []).append(i)
        for sampling_json, indices in groups.items():
            try:
                params = SamplingParams(
                    **{**self.sampling, **(json.loads(sampling_json) if sampling_json else {})})
            except (ValueError, TypeError) as e:  # a row's bad options: its error, not the job's
                for i in indices:
                    records[i] = error_record(rows[i]["path"], f"sampling: {e}")
                continue
            conversations = []
            for i in indices:
                row = rows[i]
                try:
                    image = media(row)
                except OSError as e:
                    image = None
                    records[i] = error_record(row["path"], f"cannot read {row['path']!r}: {e}")
                conversations.append([{
                    "role": "user",
                    "content": [{"type": "image", "image": image},
                                {"type": "text", "text": row.get("prompt") or self.prompt}]
                }])
            try:
                outputs = self.llm.chat(conversations, params, use_tqdm=False,
                                        mm_processor_kwargs=self.mm_kwargs)
            # some images were unreadable; the rest of the batch still ran
            except RequestError as e:
                outputs = e.outputs
            for i, output in zip(indices, outputs):
                if records[i] is None:
                    records[i] = make_record(rows[i]["path"], output)
        return {name: [r[name] for r in records] for name in IMAGE_RECORD_FIELDS}


# ---- the job ----
def caption_on_ray(inputs: list[str], out: str, *, model: str, engine_options: dict | None = None,
                   prompt: str = "Describe this image.", sampling: dict | None = None,
                   batch_size: int = 8, max_pixels: int | None = None, resume: bool = False,
                   overwrite: bool = False, replicas: int = 1, address: str | None = None,
                   cpus_per_replica: float | None = None, gpus_per_replica: float = 0,
                   progress: bool = True) -> CaptionSummary:
    """Caption `inputs` (folders, globs, paths, .txt lists, or Parquet/JSONL/CSV tables with a
    'path' column) on a Ray cluster (`address`, or a local one started here) with `replicas` engine
    actors into `out` (.jsonl, or a folder ending in .parquet)."""
    check_sizes(replicas, batch_size)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the caption prompt must be a non-empty string")
    ray = require_ray()
    from vlinfer.loading import resolve_model
    # a missing model fails here, not in every actor; the embedded one is built once, here
    resolve_model(model)
    done = {key(r["path"]): r for r in recorded(out, resume, overwrite)}
    connect(ray, address)
    ds, total, skipped = input_dataset(ray, inputs, set(done), batch_size, _file_rows, key,
                                       optional=("bytes", "prompt", "sampling"))
    previous_errors = recorded_errors(done.keys(), done)
    captioned = errors = tokens = 0
    start = time.perf_counter()
    from tqdm.auto import tqdm
    with OutputWriter(out, IMAGE_RECORD_FIELDS) as writer, \
            tqdm(total=total - skipped, unit="img", desc="caption (ray)", disable=not progress,
                 dynamic_ncols=True) as bar:
        if ds is not None:
            blocks = run_stage(
                ray, ds, CaptionStage,
                dict(model=model, engine_options=engine_options or {}, prompt=prompt,
                     sampling=sampling or {}, max_pixels=max_pixels), batch_size=batch_size,
                replicas=replicas, cpus_per_replica=cpus_per_replica,
                gpus_per_replica=gpus_per_replica)
            for records in blocks:
                writer.write(records)
                for record in records:
                    errors += record["error"] is not None
                    captioned += record["error"] is None
                    tokens += record["tokens"]
                elapsed = time.perf_counter() - start
                bar.set_postfix({"tok/s": f"{tokens / elapsed:.1f}", "errors": errors},
                                refresh=False)
                bar.update(len(records))
    return CaptionSummary(total, skipped, captioned, errors, tokens,
                          time.perf_counter() - start, out, previous_errors)


def _file_rows(inputs: list[str]) -> list[dict]:
    return [{"path": path} for path in collect_images(inputs)]
