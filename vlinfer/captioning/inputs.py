"""What a batch job (`vlinfer caption`, `vlinfer embed`, here or on Ray) reads: files named by
folders, globs and .txt lists, or rows of a table (Parquet, JSONL, CSV); each row's key, the path
its record is written under, which a resumed run skips; and a row's media, read from where it lives
(a local path, a remote one, bytes in the row)."""
import os
from collections.abc import Iterable

# folders, globs and lists are expanded there (Pipeline.caption takes them too)
from vlinfer.multimodal.media_paths import (IMAGE_EXTENSIONS, CaptionInputError, collect_images,
                                            is_remote, key)
from vlinfer.multimodal.video_io import VIDEO_EXTENSIONS

TABLE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


def is_video(path: str) -> bool:
    return path.lower().endswith(VIDEO_EXTENSIONS)


# ---- tables ----
def is_table(path: str) -> bool:
    return path.lower().rstrip("/").endswith(TABLE_SUFFIXES)


def tables_in(inputs: list[str]) -> list[str]:
    """The inputs when they are all tables, [] when none is; a mix is an error."""
    tables = [i for i in inputs if is_table(i)]
    if tables and len(tables) != len(inputs):
        raise CaptionInputError(
            "give either tables (.parquet/.jsonl/.csv) or files/folders/globs, not both")
    return tables


def table_columns(names: list[str], id_column: str = "path", text_column: str | None = None,
                  optional: tuple[str, ...] = ("bytes",)) -> dict[str, str]:
    """{table column: row key} for the rows a job reads: the id column as "path" (the files' paths,
    or any unique name of a text), the text column as "text" (texts to embed), and the optional
    columns the table has (a caption table's prompt and sampling, an image's bytes) as they are. A
    missing column is an error."""
    if text_column is not None and text_column == id_column:
        raise CaptionInputError(
            f"the text column and the id column are both {id_column!r}; name each row by "
            "another column (--id-column)")
    for column, role in ((id_column, "naming each row"), (text_column, "holding the texts")):
        if column is not None and column not in names:
            raise CaptionInputError(
                f"the table has no {column!r} column ({role}); its columns: {list(names)}")
    columns = {id_column: "path"}
    if text_column is not None:
        columns[text_column] = "text"
    else:
        columns.update({name: name for name in optional if name in names})
    return columns


def read_table_rows(tables: list[str], id_column: str = "path",
                    text_column: str | None = None) -> list[dict]:
    """The rows of local tables (pyarrow reads them) in table order, each as {row key: value}
    (table_columns)."""
    pa = require_pyarrow("reading tables")
    rows = []
    for path in tables:
        lower = path.lower().rstrip("/")
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq
            table = pq.read_table(path)
        elif lower.endswith(".csv"):
            import pyarrow.csv
            table = pyarrow.csv.read_csv(path, convert_options=csv_options(id_column, text_column))
        else:
            import pyarrow.json
            table = pyarrow.json.read_json(path)
        columns = table_columns(table.column_names, id_column, text_column)
        table = pa.table({field: table.column(name) for name, field in columns.items()})
        rows.extend(table.to_pylist())
    return rows


def csv_options(id_column: str = "path", text_column: str | None = None):
    """A CSV's id and text columns read as text (CSV has no types: an id 17 is the name "17", not a
    number)."""
    import pyarrow as pa
    import pyarrow.csv
    return pyarrow.csv.ConvertOptions(
        column_types={c: pa.string()
                      for c in (id_column, text_column) if c})


def require_pyarrow(what: str):
    try:
        import pyarrow
    except ImportError as e:
        raise CaptionInputError(f"{what} needs pyarrow: pip install pyarrow") from e
    return pyarrow


# ---- a row's key and media ----
def check_names(names: Iterable, key_of, column: str = "path") -> None:
    """Every row named (a non-empty string in `column`), and each key (key_of(name)) once: a row
    listed twice would be done, and recorded, twice."""
    seen = set()
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise CaptionInputError(
                f"row {i} of the table: its {column!r} value {name!r} is not a name (a "
                "non-empty string)")
        if key_of(name) in seen:
            raise CaptionInputError(
                f"{column} {name!r} names two rows of the input; each row needs its own")
        seen.add(key_of(name))


def media(row: dict):
    """A row's image or video as the engine takes it: the bytes in the row, a remote file read
    through pyarrow's filesystems (s3://, gs://, hdfs://, the ones Ray Data reads tables from), or
    the local path."""
    if row.get("bytes"):
        return row["bytes"]
    path = row["path"]
    if not is_remote(path):
        return path
    import pyarrow.fs
    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    with fs.open_input_stream(inner) as f:
        return f.read()
