"""Embedding in bulk (`vlinfer embed`, here or on Ray): images, videos or texts in, one record per
item out, with its vector in the Qwen embedder's format (Pipeline.embed's), the model's name, or the
error that item met.

A row is {"path"} (a file: a video by its extension, else an image; "bytes" in the row stand for the
file) or {"path", "text"} (a text from a table; "path" is the row's id). The output is the state, as
for captions (output.py): each batch is written before the next starts, a resumed run skips every
key already recorded, and a resumed run refuses a model, an instruction or a vector length other
than the recorded ones (one output, one vector space)."""
import time
from dataclasses import dataclass

from vlinfer.captioning.inputs import (CaptionInputError, check_names, collect_images, is_video,
                                       key, media, read_table_rows, tables_in)
from vlinfer.captioning.output import (OutputWriter, check_output, recorded, recorded_errors,
                                       skipped_note)
from vlinfer.caption_records import request_error
from vlinfer.inputs.retrieval import embedding_instruction
from vlinfer.outputs import RequestError
from vlinfer.pipeline import embedding_prompt
from vlinfer.pooling_params import PoolingParams

# Every field of an embedding record, in order, with its column type (Arrow's type names): the
# Parquet schema and the Ray job's columns are built from this one table. The vector is float32, as
# the model computes it; the instruction is the system turn the item was embedded with
# (inputs/retrieval.py embedding_instruction).
EMBED_RECORD_FIELDS = {
    "path": "string", "vector": "list<float>", "model": "string", "instruction": "string",
    "error": "string"
}


def embed_record(path: str, model: str, instruction: str, vector: list[float] | None = None,
                 error: str | None = None) -> dict:
    return {
        "path": path, "vector": vector, "model": model, "instruction": instruction, "error": error
    }


# ---- inputs ----
def input_rows(inputs: list[str], text_column: str | None = None,
               id_column: str = "path") -> list[dict]:
    """The rows to embed, in input order: the rows of tables (.parquet/.jsonl/.csv: the files of
    their id column, or with text_column the texts of that column named by the id column), else
    file_rows(inputs). A key that names two rows is an error."""
    tables = tables_in(inputs)
    if not tables:
        return file_rows(inputs, text_column)
    rows = read_table_rows(tables, id_column, text_column)
    if not rows:
        raise CaptionInputError(f"no rows to embed in {', '.join(tables)}")
    check_names((row["path"] for row in rows), lambda name: row_key(name, text_column is not None),
                id_column)
    return rows


def file_rows(inputs: list[str], text_column: str | None = None) -> list[dict]:
    """The images and videos that folders, globs, paths and .txt lists name, each once."""
    if text_column is not None:
        raise CaptionInputError(
            "--text-column reads the texts of a table (.parquet/.jsonl/.csv); the inputs are "
            "files")
    return [{"path": path} for path in collect_images(inputs, videos=True)]


def row_key(path: str, text: bool) -> str:
    """What a record is known by: a file's path as inputs.key makes it, a text's id as given."""
    return path if text else key(path)


# ---- a batch ----
def check_embedder(pipe, dimensions: int | None = None) -> None:
    """Before any row: the model is an embedder (runner="pooling", task embed: a generator or a
    reranker has no vectors) whose vectors have at least `dimensions` entries."""
    pooling = pipe.engine.pooling
    if pooling is None or pooling.task != "embed":
        what = "a generation model" if pooling is None else f"a {pooling.task} model (a reranker)"
        raise ValueError(
            f"model {pipe.model!r} runs as {what}; embedding needs an embedder opened with "
            "runner='pooling', such as --model qwen3-vl-embedding-2b")
    pooling.check(PoolingParams(dimensions=dimensions, task="embed"), pipe.model)


def embed_rows(pipe, rows: list[dict], instruction: str | None = None,
               dimensions: int | None = None) -> list[dict]:
    """One record per row, in row order, from one engine run (LLM.embed over the rows' prompts, as
    Pipeline.embed runs them). A row that cannot be embedded (an unreadable image, a row without
    text) is recorded with its error; the rest still run."""
    records: list[dict | None] = [None] * len(rows)
    prompts, indices = [], []
    applied = embedding_instruction(instruction)
    for i, row in enumerate(rows):
        try:
            prompts.append(embedding_prompt(pipe.engine, _item(row), instruction))
            indices.append(i)
        except OSError as e:
            records[i] = embed_record(row["path"], pipe.model, applied,
                                      error=f"cannot read {row['path']!r}: {e}")
        except ValueError as e:
            records[i] = embed_record(row["path"], pipe.model, applied, error=str(e))
    try:
        outputs = pipe.llm.embed(prompts, PoolingParams(
            dimensions=dimensions), use_tqdm=False) if prompts else []
    # some items were rejected (an unreadable image); the others were embedded
    except RequestError as e:
        outputs = e.outputs
    for i, output in zip(indices, outputs):
        path = rows[i]["path"]
        records[i] = embed_record(path, pipe.model, applied,
                                  error=request_error(output.error, is_video(path))) \
            if output.error else \
            embed_record(path, pipe.model, applied, vector=output.outputs.embedding)
    return records


def _item(row: dict) -> dict:
    """A row as Pipeline.embed's item: its text, or its file as an image or a video."""
    if "text" in row:
        if not isinstance(row["text"], str):
            raise ValueError(f"no text to embed (the row's text is {row['text']!r})")
        return {"text": row["text"]}
    return {"video" if is_video(row["path"]) else "image": media(row)}


# ---- the run's consistency: one output, one vector space ----
def check_resumable(out: str, resume: bool, overwrite: bool, model: str,
                    instruction: str | None = None) -> None:
    """What embed_files refuses about `out`, checked before a model loads: an existing output
    without resume or overwrite, and (resume) records of another model or instruction, or of mixed
    vector lengths."""
    check_output(out, resume, overwrite)
    if resume:
        recorded_length(recorded(out, resume, overwrite=False), model, instruction, out)


def recorded_length(done: list[dict], model: str, instruction: str | None, out: str) -> int | None:
    """The vector length of the records already in `out`, after refusing records of another model or
    embedded with another instruction (records written before vlinfer recorded the instruction have
    none: not checked)."""
    models = {r.get("model") for r in done} - {model}
    if models:
        raise CaptionInputError(
            f"{out} holds records of model {sorted(map(str, models))[0]!r}, not {model!r}: one "
            "output holds one model's vectors (write to another --out, or --overwrite)")
    applied = embedding_instruction(instruction)
    others = {r["instruction"] for r in done if r.get("instruction") is not None} - {applied}
    if others:
        raise CaptionInputError(
            f"{out} holds records embedded with the instruction {sorted(others)[0]!r}, not "
            f"{applied!r}: one output holds one instruction's vectors (pass that --instruction, "
            "write to another --out, or --overwrite)")
    return check_lengths(done, None, out)


def check_lengths(records: list[dict], length: int | None, out: str) -> int | None:
    """Every vector `length` long (None: the first one's); returns the length."""
    for r in records:
        if r.get("vector") is not None:
            if length is None:
                length = len(r["vector"])
            elif len(r["vector"]) != length:
                raise CaptionInputError(
                    f"{r['path']}: a vector of {len(r['vector'])} dimensions beside {out}'s of "
                    f"{length} (another --dimensions than the recorded run's?): write to "
                    "another --out, or --overwrite")
    return length


class EmbedTally:
    """What a run has written: every batch's vectors one length (check_lengths), appended to the
    output, counted, shown on the bar. The local and the Ray run write through one."""

    def __init__(self, writer, bar, length: int | None, out: str):
        self.writer, self.bar, self.length, self.out = writer, bar, length, out
        self.embedded = self.errors = 0

    def add(self, records: list[dict]) -> None:
        self.length = check_lengths(records, self.length, self.out)
        self.writer.write(records)
        self.errors += sum(r["error"] is not None for r in records)
        self.embedded += sum(r["error"] is None for r in records)
        self.bar.set_postfix({"errors": self.errors}, refresh=False)
        self.bar.update(len(records))


# ---- the run ----
@dataclass
class EmbedSummary:
    total: int  # distinct inputs
    skipped: int  # already in the output (resume)
    embedded: int  # this run
    errors: int  # this run
    seconds: float
    out: str
    previous_errors: int = 0  # error records among the skipped inputs

    def line(self) -> str:
        rate = f"{self.embedded / self.seconds:.2f} items/s" if self.seconds > 0 else "-"
        return (
            f"embedded {self.embedded} item(s), {self.errors} error(s) in {self.seconds:.1f}s "
            f"({rate}) -> "
            f"{self.out}" + skipped_note(self.skipped, self.previous_errors))


def embed_files(pipe, rows: list[dict], out: str, instruction: str | None = None,
                dimensions: int | None = None, batch_size: int = 16, resume: bool = False,
                overwrite: bool = False, progress: bool = True) -> EmbedSummary:
    """Embed `rows` (input_rows) with `pipe` (a Pipeline opened with runner="pooling") into `out`: a
    JSONL file, or a folder ending in .parquet of part files, one per batch of batch_size rows."""
    check_embedder(pipe, dimensions)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    texts = any("text" in row for row in rows)
    done = {row_key(r["path"], texts): r for r in recorded(out, resume, overwrite)}
    length = recorded_length(list(done.values()), pipe.model, instruction, out)
    todo = [row for row in rows if row_key(row["path"], texts) not in done]
    skipped = len(rows) - len(todo)
    previous_errors = recorded_errors((row_key(row["path"], texts) for row in rows), done)
    from tqdm.auto import tqdm
    start = time.perf_counter()
    with OutputWriter(out, EMBED_RECORD_FIELDS) as writer, \
            tqdm(total=len(todo), unit="item", desc="embed", disable=not progress,
                 dynamic_ncols=True) as bar:
        tally = EmbedTally(writer, bar, length, out)
        for begin in range(0, len(todo), batch_size):
            tally.add(embed_rows(pipe, todo[begin:begin + batch_size], instruction, dimensions))
    return EmbedSummary(len(rows), skipped, tally.embedded, tally.errors,
                        time.perf_counter() - start, out, previous_errors)
