"""A batch job's output, which is its state: a JSONL file (appended and fsync'ed batch by batch) or
a folder ending in .parquet (one part file per batch, each written atomically). A run killed at any
point loses at most the batches in flight; a resumed run reads the records back and skips every key
already there (results and errors alike). The captioner, the embedder and their Ray jobs all write
through here."""
import json
import logging
import os
import re

from vlinfer.captioning.inputs import CaptionInputError, require_pyarrow

logger = logging.getLogger("vlinfer")


class OutputWriteError(OSError):
    """A batch could not be written (disk full, quota, a read-only or vanished output): the output
    keeps every batch written before, whole, and none of this one; --resume continues from there
    once the cause is fixed."""


def is_parquet(out: str) -> bool:
    return out.rstrip("/").lower().endswith(".parquet")


def arrow_schema(fields: dict[str, str]):
    """A record's field table ({name: Arrow type name}) as one pyarrow schema for every part: a
    field added to the table is a column here."""
    pa = require_pyarrow("Parquet output")
    types = {
        "string": pa.string(), "int64": pa.int64(), "double": pa.float64(),
        "list<int64>": pa.list_(pa.int64()), "list<float>": pa.list_(pa.float32())
    }
    return pa.schema([(name, types[kind]) for name, kind in fields.items()])


def check_output(out: str, resume: bool, overwrite: bool) -> None:
    """Refuse to mix two runs in one output by accident: an existing output needs resume or
    overwrite."""
    if resume and overwrite:
        raise CaptionInputError("pass either --resume or --overwrite, not both")
    if is_parquet(out):
        if os.path.isfile(out):
            raise CaptionInputError(
                f"--out {out!r} is a file; a .parquet output is a folder of part files (one per "
                "batch): remove the file or name another --out")
        if _parts(out) and not (resume or overwrite):
            raise CaptionInputError(
                f"{out} already has results; pass --resume to continue it or --overwrite to "
                "start over")
        return
    if os.path.isdir(out):
        raise CaptionInputError(
            f"--out {out!r} is a folder; give a file name such as records.jsonl, or a folder "
            "ending in .parquet")
    if os.path.exists(out) and os.path.getsize(out) and not (resume or overwrite):
        raise CaptionInputError(
            f"{out} already exists; pass --resume to continue it or --overwrite to start over")


def recorded(out: str, resume: bool, overwrite: bool) -> list[dict]:
    """check_output, then the records already in `out` (resume), or none after removing them
    (overwrite)."""
    check_output(out, resume, overwrite)
    if overwrite:
        if is_parquet(out):
            for name in _parts(out):
                os.remove(os.path.join(out, name))
        elif os.path.exists(out):
            os.remove(out)
        return []
    if not resume:
        return []
    if not is_parquet(out):
        return read_records(out)
    import pyarrow.parquet as pq
    return [r for name in _parts(out) for r in pq.read_table(os.path.join(out, name)).to_pylist()]


def _parts(out: str) -> list[str]:
    return sorted(n for n in os.listdir(out)
                  if n.endswith(".parquet")) if os.path.isdir(out) else []


class OutputWriter:
    """Writes record batches to `out`: appended to the JSONL file and fsync'ed, or one Parquet part
    per batch with the schema of `fields` (records with a key not in it are refused, never cut)."""

    def __init__(self, out: str, fields: dict[str, str]):
        self.out, self.fields, self.parquet = out, fields, is_parquet(out)
        if self.parquet:
            self.schema = arrow_schema(fields)
            os.makedirs(out, exist_ok=True)
            # After the highest part there: a part removed by hand never gets a later batch's part
            # written over it.
            numbers = [int(n[5:-8]) for n in _parts(out) if re.fullmatch(r"part-\d+\.parquet", n)]
            self.part, self.file = max(numbers, default=-1) + 1, None
        else:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            # unbuffered: a failed write leaves nothing to flush later
            self.file = open(out, "ab", buffering=0)

    def write(self, records: list[dict]) -> None:
        """Append one batch, whole or not at all: an OSError midway (ENOSPC, EDQUOT, EIO, ...) takes
        back what reached the output and raises OutputWriteError naming it."""
        try:
            if self.parquet:
                self._parquet(records)
            else:
                self._jsonl(records)
        except OSError as e:
            raise OutputWriteError(
                e.errno, f"cannot write a batch of {len(records)} record(s) to {self.out}: "
                f"{e.strerror or e}; nothing of that batch was kept, the batches before it "
                "are whole: fix the cause and run again with --resume") from e

    def _jsonl(self, records: list[dict]) -> None:
        fd = self.file.fileno()
        size = os.fstat(fd).st_size
        try:
            write_records(self.file, records)
        except OSError:
            os.ftruncate(fd, size)  # the part of the batch that reached the file goes
            os.fsync(fd)
            raise

    def _parquet(self, records: list[dict]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        unknown = {k for r in records for k in r} - set(self.fields)
        if unknown:
            raise KeyError(
                f"record fields {sorted(unknown)} are not in the output's field table "
                f"{list(self.fields)}"
            )
        name = f"part-{self.part:06d}.parquet"
        # hidden: readers of the folder (pyarrow, pandas) skip it
        tmp = os.path.join(self.out, f".{name}.tmp")
        # One schema for every part: inferred per batch, a batch without an error (or a caption)
        # typed that column null, and a folder of parts with null and string columns failed to read
        # back as one table.
        try:
            pq.write_table(pa.Table.from_pylist(records, schema=self.schema), tmp)
            # a part is whole or absent: a kill never leaves half
            os.replace(tmp, os.path.join(self.out, name))
        except OSError:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        self.part += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> "OutputWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- JSONL ----
def read_records(out: str, repair: bool = True) -> list[dict]:
    """The records in an existing JSONL output. A last line cut short by a kill is dropped (and,
    with repair, cut from the file so the next record starts on a clean line); a damaged line
    anywhere else is an error, since then the file is not what a batch job writes."""
    if not os.path.exists(out):
        return []
    with open(out, "rb") as f:
        data = f.read()
    # tail: what follows the last newline (b"" when the file ends with one)
    *complete, tail = data.split(b"\n")
    records = []
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            records.append(_parse_record(line))
        except ValueError as e:
            raise CaptionInputError(f"{out} line {i + 1} is not a record of this job ({e}); "
                                    "fix or remove the file, or write to another --out") from e
    fix = None
    if tail.strip():
        try:
            records.append(_parse_record(tail))
            fix = "newline"  # a whole record whose newline never made it
        except ValueError:
            fix = "truncate"
            logger.warning(
                "%s: dropping a truncated last line (%d bytes) left by an interrupted run", out,
                len(tail))
    if repair and fix:
        with open(out, "r+b") as f:
            if fix == "truncate":
                f.truncate(len(data) - len(tail))
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
    return records


def _parse_record(line: bytes) -> dict:
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        raise ValueError("no 'path' field")
    return record


def write_records(f, records: list[dict]) -> None:
    """One batch of records appended to the unbuffered binary file f and fsync'ed."""
    data = memoryview("".join(json.dumps(r, ensure_ascii=False) + "\n"
                              for r in records).encode("utf-8"))
    while data:  # a raw write may take only part of the bytes
        data = data[f.write(data):]
    # on disk before the next batch starts: a kill or power cut loses at most one batch
    os.fsync(f.fileno())


# ---- resuming ----
def recorded_errors(keys, done: dict[str, dict]) -> int:
    """How many of the inputs already recorded (done: key -> record) are recorded as errors."""
    return sum(1 for k in keys if (done.get(k) or {}).get("error"))


def skipped_note(skipped: int, previous_errors: int) -> str:
    """The end of a resumed run's summary line."""
    return (f"; {skipped} already recorded, skipped ({previous_errors} of them errors)"
            if skipped else "")
