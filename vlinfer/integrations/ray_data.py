"""What the Ray Data jobs (ray_caption, ray_embed) share: joining the cluster, the dataset of rows
still to do, the stage base that sizes an actor's threads, and the stream of record blocks the
driver writes.

Rows come from folders, globs, paths and .txt lists (made on the driver), or from Parquet / JSONL /
CSV tables read by Ray Data (any filesystem it reads). The dataset is filtered against the keys
already recorded, then cut into blocks of one batch before the engines start, so a killed job loses
at most the blocks in flight."""
import logging
import math

from vlinfer.captioning.inputs import check_names, csv_options, table_columns, tables_in
from vlinfer.platform import set_process_threads

logger = logging.getLogger("vlinfer")


def connect(ray, address: str | None) -> None:
    """Join `address` (None: ray.init's choice, 'auto': the running cluster); our own progress bar
    covers the whole cluster, so Ray Data's per-operator bars and log lines, which would repeat it,
    are off."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=logger.isEnabledFor(logging.INFO))
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def input_dataset(ray, inputs: list[str], done: set[str], batch_size: int, file_rows, key_of,
                  id_column: str = "path", text_column: str | None = None,
                  optional: tuple[str, ...] = ("bytes", )):
    """(dataset of the rows still to do, in blocks of batch_size, or None; how many rows in all; how
    many of them are already recorded). file_rows(inputs) makes the rows of non-table inputs;
    key_of(path) is a row's key in `done`; a table's columns are picked and renamed by
    inputs.table_columns."""
    tables = tables_in(inputs)
    if not tables:
        rows = file_rows(inputs)
        todo = [row for row in rows if key_of(row["path"]) not in done]
        blocks = max(1, math.ceil(len(todo) / batch_size))
        return (ray.data.from_items(todo, override_num_blocks=blocks) if todo else None), \
            len(rows), len(rows) - len(todo)
    readers = [_reader(ray, table, id_column, text_column) for table in tables]
    ds = readers[0].union(*readers[1:]) if len(readers) > 1 else readers[0]
    columns = table_columns(ds.schema().names if ds.schema() else [], id_column, text_column,
                            optional)
    ds = ds.select_columns(list(columns))
    renamed = {name: field for name, field in columns.items() if name != field}
    if renamed:
        ds = ds.rename_columns(renamed)
    ids = [row["path"] for row in ds.select_columns(["path"]).take_all()]
    check_names(ids, key_of, id_column)
    total = len(ids)
    if done:
        ds = ds.filter(lambda row: key_of(row["path"]) not in done)
    remaining = total - sum(1 for name in ids if key_of(name) in done)
    # Read, filtered and cut into blocks of one batch before the engines start: the engine actors
    # then hold the CPUs, and read tasks queued behind them would wait forever; and a killed job
    # loses at most the blocks in flight only when a block is a batch, not a whole file.
    ds = ds.repartition(max(1, math.ceil(remaining /
                                         batch_size))).materialize() if remaining else None
    return ds, total, total - remaining


def _reader(ray, table: str, id_column: str, text_column: str | None):
    lower = table.lower().rstrip("/")
    if lower.endswith(".parquet"):
        return ray.data.read_parquet(table)
    if lower.endswith(".csv"):
        return ray.data.read_csv(table, convert_options=csv_options(id_column, text_column))
    return ray.data.read_json(table)


class EngineStage:
    """A map_batches stage holding one engine per actor: the base sets the actor's share of the
    node's cores before the engine is built (torch would otherwise take them all)."""

    def __init__(self, threads: int | None = None):
        if threads:
            set_process_threads(threads)


def run_stage(ray, ds, stage: type, stage_kwargs: dict, *, batch_size: int, replicas: int,
              cpus_per_replica: float | None, gpus_per_replica: float):
    """The record blocks of `stage` over `ds` with `replicas` actors, as lists of records, as they
    come back."""
    cpus = cpus_per_replica or max(1.0, ray.cluster_resources().get("CPU", 1) // replicas)
    results = ds.map_batches(
        stage, batch_size=batch_size, concurrency=replicas, num_cpus=cpus,
        num_gpus=gpus_per_replica or None, batch_format="default", fn_constructor_kwargs={
            **stage_kwargs, "threads": int(cpus) if not gpus_per_replica else None
        })
    for block in results.iter_batches(batch_size=None, batch_format="pyarrow"):
        yield block.to_pylist()


def check_sizes(replicas: int, batch_size: int) -> None:
    if replicas < 1 or batch_size < 1:
        raise ValueError(f"replicas and batch_size must be >= 1, got {replicas} and {batch_size}")
