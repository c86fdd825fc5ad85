"""Search images (or clips) by text: cosine ranking over Qwen3-VL-Embedding vectors, then, with
--reranker, the top hits reranked by a Qwen3-VL-Reranker.

    python examples/search.py examples/images --query "a red house"                  # embeds the
    folder first
    python -m vlinfer embed photos/ --out embeddings.parquet                          # index once
    ...
    python examples/search.py embeddings.parquet --query "a red house" --top-k 3      # ... search
    many times
    python examples/search.py embeddings.parquet --query "a red house" --reranker
    qwen3-vl-reranker-2b

The query is embedded with the task's instruction, the items were with the default one (the Qwen
embedder's format: docs/retrieval.md). An index made by `vlinfer embed` (a folder of Parquet parts,
or a JSONL file) records its model: the query is embedded by the same one. Without the real weights
in the Hugging Face cache the default embedder is vlinfer's embedded toy embedder
(tools/train_toy_embedder.py), which finds the drawn world's objects (examples/images/red_house.png
for "a red house") and knows nothing else (the loader says so).
"""
import argparse
import json
import os

from vlinfer import Pipeline
from vlinfer.captioning import embed_rows, file_rows, is_video

QUERY_INSTRUCTION = "Retrieve images or text relevant to the user's query."
DEFAULT_EMBEDDER = "qwen3-vl-embedding"


def read_index(path: str) -> list[dict]:
    """The records of a `vlinfer embed` output: {path, vector, model, instruction, error}."""
    if path.rstrip("/").endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "source", help="a folder / glob of images and clips, or an index made by `vlinfer embed` "
        "(embeddings.parquet or a .jsonl file)")
    p.add_argument("--query", required=True, help="what to look for, in words")
    p.add_argument("--top-k", type=int, default=5, help="results to print (default: 5)")
    p.add_argument("--model", default=None,
                   help=f"the embedder (default: the index's, else {DEFAULT_EMBEDDER})")
    p.add_argument(
        "--reranker", default=None, metavar="MODEL",
        help="rerank the cosine top --candidates with this reranker (e.g. qwen3-vl-reranker-2b)")
    p.add_argument("--candidates", type=int, default=20,
                   help="cosine hits the reranker reads (default: 20)")
    p.add_argument("--instruction", default=QUERY_INSTRUCTION,
                   help=f"the query's instruction: {QUERY_INSTRUCTION!r}")
    p.add_argument("--kv-cache-mb", type=int, default=512,
                   help="each engine's KV cache in MiB (default: 512)")
    args = p.parse_args(argv)
    engine = dict(kv_cache_bytes=args.kv_cache_mb << 20)

    indexed = args.source.rstrip("/").endswith((".parquet", ".jsonl"))
    records = read_index(args.source) if indexed else None
    if records is not None:
        models = {r["model"] for r in records}
        if len(models) != 1 or (args.model and args.model not in models):
            raise SystemExit(
                f"error: {args.source} holds vectors of {sorted(models)}; the query needs the same "
                "embedder (pass --model accordingly)")
        model = models.pop()
    else:
        model = args.model or DEFAULT_EMBEDDER
    embedder = Pipeline(model, **{**engine, "runner": "pooling"})
    # the folder's items, embedded as `vlinfer embed` embeds them (errors recorded, not raised)
    if records is None:
        records = embed_rows(embedder, file_rows([args.source]))
    hits = [r for r in records if r["error"] is None]
    skipped = len(records) - len(hits)
    if not hits:
        raise SystemExit(f"error: nothing searchable in {args.source} ({skipped} unreadable)")
    # The query's vector as long as the items' (an index made with --dimensions keeps that many).
    query, = embedder.embed(texts=[args.query], instruction=args.instruction,
                            dimensions=len(hits[0]["vector"]))
    for hit in hits:
        hit["cosine"] = sum(a * b for a, b in zip(query, hit["vector"]))
    hits.sort(key=lambda hit: -hit["cosine"])

    print(f"query: {args.query!r}; {len(hits)} items embedded by {model!r}"
          + (f", {skipped} unreadable skipped" if skipped else ""))
    if args.reranker is None:
        for rank, hit in enumerate(hits[:args.top_k], 1):
            print(f"{rank:3}. cosine {hit['cosine']:.4f}  {hit['path']}")
        return
    candidates = hits[:max(args.candidates, args.top_k)]
    for hit in candidates:
        if not os.path.isfile(hit["path"]):
            raise SystemExit(
                f"error: the reranker reads each item, and {hit['path']!r} is not a file here")
    reranker = Pipeline(args.reranker, **{**engine, "runner": "pooling"})
    documents = [{"video" if is_video(hit["path"]) else "image": hit["path"]} for hit in candidates]
    ranked = reranker.rerank(args.query, documents, top_k=args.top_k)
    for rank, result in enumerate(ranked, 1):
        hit = candidates[result["index"]]
        print(f"{rank:3}. score {result['score']:.4f}  cosine {hit['cosine']:.4f}  {hit['path']}")


if __name__ == "__main__":
    main()
