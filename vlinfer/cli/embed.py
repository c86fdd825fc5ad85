"""`vlinfer embed`: a folder / glob / list of images and clips, or a table of files or texts, into
one vector per item (the Qwen3-VL-Embedding format), in a resumable Parquet or JSONL output, here or
on a Ray cluster."""
import sys

from vlinfer.cli.options import engine_options
from vlinfer.cli.shared import EMBED_MODEL, add_batch_job_args, add_model_args

# items per engine run: an embedding is one prefill, so a batch costs about one caption's
EMBED_BATCH_SIZE = 16


def cmd_embed(args) -> int:
    model = args.model or EMBED_MODEL
    from vlinfer import PoolingParams
    PoolingParams(dimensions=args.dimensions)  # a bad --dimensions fails before the model loads
    if args.runner == "generate":
        raise ValueError(
            "--runner generate: `vlinfer embed` runs the pooling runner (leave --runner out)")
    if args.ray is not None:
        return _embed_on_ray(args, model)
    from vlinfer.captioning import embed_files, input_rows
    from vlinfer.captioning.embedder import check_resumable
    # bad inputs / output fail before the load
    rows = input_rows(args.inputs, args.text_column, args.id_column)
    check_resumable(args.out, args.resume, args.overwrite, model, args.instruction)
    from vlinfer import Pipeline
    pipe = Pipeline(model, **{**engine_options(args), "runner": "pooling"})
    summary = embed_files(pipe, rows, args.out, instruction=args.instruction,
                          dimensions=args.dimensions, batch_size=args.batch_size,
                          resume=args.resume, overwrite=args.overwrite,
                          progress=not args.no_progress)
    print(summary.line())
    if pipe.embedded:
        print(
            f"note: {model!r} ran {pipe.engine.source.about}: its vectors find that world's "
            "objects only; fetch "
            "real weights with: huggingface-cli download Qwen/Qwen3-VL-Embedding-2B",
            file=sys.stderr)
    return 1 if summary.errors or summary.previous_errors else 0


def _embed_on_ray(args, model: str) -> int:
    from vlinfer.integrations import MissingDependencyError
    try:
        from vlinfer.integrations.ray_embed import embed_on_ray
        summary = embed_on_ray(args.inputs, args.out, model=model,
                               engine_options=engine_options(args), text_column=args.text_column,
                               id_column=args.id_column, instruction=args.instruction,
                               dimensions=args.dimensions, batch_size=args.batch_size,
                               resume=args.resume, overwrite=args.overwrite, replicas=args.replicas,
                               address=args.ray or None, progress=not args.no_progress)
    except MissingDependencyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.line())
    return 1 if summary.errors or summary.previous_errors else 0


def add_parser(sub):
    k = sub.add_parser(
        "embed", help="embed a folder / glob / table of images, clips or texts into vectors",
        description="Embed images, video clips or texts in batches with a Qwen3-VL-Embedding model "
        "(Pipeline.embed's vectors: L2-normalized, the instruction as the system turn), "
        "one record per item: {path, vector (float32), model, error}. The output is "
        "written batch by batch; --resume continues an interrupted run, embedding only "
        "the items not yet recorded. Unreadable items are recorded with their error and "
        "the run goes on (exit code 1 at the end). Read the output with "
        "pyarrow.parquet.read_table(OUT) or pandas.read_parquet(OUT).")
    k.add_argument(
        "inputs", nargs="+", metavar="DIR_OR_GLOB_OR_TABLE",
        help="a folder (its image and video files, sorted), a quoted glob ('photos/**/*.jpg'), "
             "file "
        "paths, a .txt file listing one path per line, or Parquet/JSONL/CSV tables: of files (a "
        "'path' column) or of texts (--text-column)")
    k.add_argument(
        "--out", required=True, help=
        "a folder ending in .parquet (e.g. embeddings.parquet: one part file per batch, read back "
        "as one table) or a .jsonl file")
    k.add_argument(
        "--text-column", default=None, metavar="NAME",
        help="embed the texts of this table column (e.g. 'caption' of a `vlinfer caption` output) "
        "instead of files")
    k.add_argument(
        "--id-column", default="path", metavar="NAME", help=
        "the table column naming each row, recorded as its path and used to resume (default: path)")
    k.add_argument(
        "--instruction", default=None,
        help="the embedder's instruction for every item (default: the model's \"Represent the "
             "user's "
        "input.\"); index documents with the default, and give queries the task's instruction")
    k.add_argument(
        "--dimensions", type=int, default=None, metavar="K",
        help="keep each vector's leading K entries, normalized again (Matryoshka; default: all)")
    add_batch_job_args(k, EMBED_BATCH_SIZE, "items")
    add_model_args(k, EMBED_MODEL)
    k.set_defaults(func=cmd_embed)
    return k
