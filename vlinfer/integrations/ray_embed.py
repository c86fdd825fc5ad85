"""Batch embedding on a Ray cluster: Ray Data streams rows (files, or a table's texts) through a
pool of actors, each holding one embedder, and the driver writes the records as blocks come back.

The records are the single-process embedder's (captioning/embedder.py embed_rows, called here per
block): path, vector, model, error; the guarantees are its too: each block is written before the
next is taken (a JSONL file appended and fsync'ed, or one Parquet part per block), `resume=True`
skips every key already recorded, and a resumed job refuses another model or vector length than the
recorded ones."""
import time

from vlinfer.captioning import EMBED_RECORD_FIELDS, EmbedSummary, OutputWriter, embed_rows, recorded
from vlinfer.captioning.embedder import (EmbedTally, check_embedder, file_rows, recorded_length,
                                         row_key)
from vlinfer.captioning.output import recorded_errors
from vlinfer.integrations import require_ray
from vlinfer.integrations.ray_data import (EngineStage, check_sizes, connect, input_dataset,
                                           run_stage)


class EmbedStage(EngineStage):
    """A Ray Data map_batches stage: one embedder per actor (Pipeline, runner="pooling"), embedding
    each batch."""

    def __init__(self, model: str, engine_options: dict, instruction: str | None,
                 dimensions: int | None, threads: int | None = None):
        super().__init__(threads)
        from vlinfer import Pipeline
        self.pipe = Pipeline(model, **{**engine_options, "runner": "pooling"})
        check_embedder(self.pipe, dimensions)
        self.instruction, self.dimensions = instruction, dimensions

    def __call__(self, batch: dict) -> dict:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        records = embed_rows(self.pipe, rows, self.instruction, self.dimensions)
        return {name: [r[name] for r in records] for name in EMBED_RECORD_FIELDS}


def embed_on_ray(inputs: list[str], out: str, *, model: str, engine_options: dict | None = None,
                 text_column: str | None = None, id_column: str = "path",
                 instruction: str | None = None, dimensions: int | None = None,
                 batch_size: int = 16, resume: bool = False, overwrite: bool = False,
                 replicas: int = 1, address: str | None = None,
                 cpus_per_replica: float | None = None, gpus_per_replica: float = 0,
                 progress: bool = True) -> EmbedSummary:
    """Embed `inputs` (folders, globs, paths, .txt lists of images and videos; or Parquet/JSONL/CSV
    tables: the files of their id column, or with text_column that column's texts named by the id
    column) on a Ray cluster (`address`, or a local one started here) with `replicas` embedder
    actors into `out` (.jsonl, or a folder ending in .parquet)."""
    check_sizes(replicas, batch_size)
    ray = require_ray()
    from vlinfer.loading import resolve_model
    # a missing model fails here, not in every actor; the embedded one is built once, here
    resolve_model(model)
    texts = text_column is not None
    done = {row_key(r["path"], texts): r for r in recorded(out, resume, overwrite)}
    length = recorded_length(list(done.values()), model, instruction, out)
    connect(ray, address)

    def key_of(path: str) -> str:
        return row_key(path, texts)

    ds, total, skipped = input_dataset(ray, inputs, set(done), batch_size,
                                       lambda i: file_rows(i, text_column), key_of,
                                       id_column=id_column, text_column=text_column)
    previous_errors = recorded_errors(done.keys(), done)
    start = time.perf_counter()
    from tqdm.auto import tqdm
    with OutputWriter(out, EMBED_RECORD_FIELDS) as writer, \
            tqdm(total=total - skipped, unit="item", desc="embed (ray)", disable=not progress,
                 dynamic_ncols=True) as bar:
        tally = EmbedTally(writer, bar, length, out)
        if ds is not None:
            blocks = run_stage(
                ray, ds, EmbedStage,
                dict(model=model, engine_options=engine_options or {}, instruction=instruction,
                     dimensions=dimensions), batch_size=batch_size, replicas=replicas,
                cpus_per_replica=cpus_per_replica, gpus_per_replica=gpus_per_replica)
            for records in blocks:
                tally.add(records)
    return EmbedSummary(total, skipped, tally.embedded, tally.errors,
                        time.perf_counter() - start, out, previous_errors)
