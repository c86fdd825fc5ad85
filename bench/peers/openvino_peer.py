"""OpenVINO GenAI as a benchmark peer; run with the OpenVINO venv's python (see
bench/peers/__init__.py, which also exports the checkpoints to OpenVINO IR):

    .venv-openvino/bin/python bench/peers/openvino_peer.py request.json result.json

The request: {"model": an exported IR folder, "precision": INFERENCE_PRECISION_HINT ("bf16",
"f32"), "kv_cache_precision": KV_CACHE_PRECISION ("u8", "bf16", "f32"), "threads",
"max_num_batched_tokens", "max_num_seqs", "cache_size_gb", "runs": [{"name", "kind", "prompts",
"images", "max_tokens": [n per prompt], "repeat"}]}. Both precisions are set explicitly: the CPU
plugin picks bf16 on AVX512-BF16 CPUs by itself, and optimum-intel writes KV_CACHE_PRECISION=f16
into the IR, which wins over the plugin's u8 default unless set.

Run kinds, each greedy with EOS ignored and the prompt taken as written (no chat template):
- "batch": ContinuousBatchingPipeline, every request added at once (its vision encoder runs inside
  add_request), then steps until all finish; per request the seconds to its first token. prompts:
  strings with Qwen's vision placeholders, images: per prompt a list of image files.
- "text_batch": ContinuousBatchingPipeline.generate on token ids (prompts: lists of ids).
- "single": VLMPipeline, one request at a time (its own single-stream path); per repeat the wall
  seconds and the pipeline's own time to first token and time per output token.
Start-up (pipelines built, models compiled) is timed apart; one warm-up request comes first.
"""
import os
import sys
import time

from protocol import serve  # beside this script


def images_of(paths):
    import numpy as np
    import openvino as ov
    from PIL import Image
    return [ov.Tensor(np.ascontiguousarray(np.asarray(Image.open(p).convert("RGB"))[None]))
            for p in paths]


def config(max_tokens: int):
    import openvino_genai as g
    c = g.GenerationConfig()
    c.max_new_tokens = c.min_new_tokens = max_tokens
    c.ignore_eos, c.do_sample, c.apply_chat_template = True, False, False
    return c


def run_batch(pipe, run: dict) -> dict:
    """Every request added, then steps until all finish: (seconds, outputs, time to first token
    of each)."""
    seconds, ttft, outputs = [], [], None
    for _ in range(run.get("repeat", 1)):
        start = time.perf_counter()
        handles = [pipe.add_request(i, prompt, images_of(paths), config(n))
                   for i, (prompt, paths, n) in enumerate(zip(run["prompts"], run["images"],
                                                             run["max_tokens"]))]
        first, tokens = [None] * len(handles), [[] for _ in handles]
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter() - start
            for i, handle in enumerate(handles):
                if handle.can_read():
                    for out in handle.read().values():
                        tokens[i].extend(out.generated_ids)
                    if first[i] is None and tokens[i]:
                        first[i] = now
        seconds.append(time.perf_counter() - start)
        for i, handle in enumerate(handles):  # what the last step left unread
            if handle.can_read():
                for out in handle.read().values():
                    tokens[i].extend(out.generated_ids)
        check(run, tokens)
        outputs = outputs or tokens
        ttft = ttft or [t if t is not None else seconds[-1] for t in first]
        print(f"openvino_peer: {run['name']}: {seconds[-1]:.2f}s", flush=True)
    return {"seconds": seconds, "outputs": outputs, "ttft": ttft}


def run_text_batch(pipe, run: dict) -> dict:
    import numpy as np
    import openvino as ov
    seconds, outputs = [], None
    for _ in range(run.get("repeat", 1)):
        ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in run["prompts"]]
        start = time.perf_counter()
        results = pipe.generate(ids, [config(n) for n in run["max_tokens"]])
        seconds.append(time.perf_counter() - start)
        tokens = [list(map(int, r.m_generation_ids[0])) for r in results]
        check(run, tokens)
        outputs = outputs or tokens
        print(f"openvino_peer: {run['name']}: {seconds[-1]:.2f}s", flush=True)
    return {"seconds": seconds, "outputs": outputs}


def run_single(pipe, run: dict) -> dict:
    """VLMPipeline, the first prompt alone, `repeat` times: wall seconds, and the pipeline's own
    time to first token and mean time per output token (both in seconds)."""
    seconds, ttft, tpot, text = [], [], [], None
    paths = run["images"][0] if run.get("images") else []
    for _ in range(run.get("repeat", 1)):
        start = time.perf_counter()
        out = pipe.generate(run["prompts"][0], images=images_of(paths),
                            generation_config=config(run["max_tokens"][0]))
        seconds.append(time.perf_counter() - start)
        metrics = out.perf_metrics
        ttft.append(metrics.get_ttft().mean / 1e3)
        tpot.append(metrics.get_tpot().mean / 1e3)
        text = text if text is not None else out.texts[0]
        print(f"openvino_peer: {run['name']}: {seconds[-1]:.2f}s", flush=True)
    return {"seconds": seconds, "ttft": ttft, "tpot": tpot, "text": text}


def check(run: dict, tokens: list) -> None:
    produced, wanted = sum(map(len, tokens)), sum(run["max_tokens"])
    assert produced == wanted, f"{run['name']}: {produced} tokens came back, {wanted} requested"


def handle(request: dict) -> dict:
    start = time.perf_counter()
    import openvino_genai as g
    import_s = time.perf_counter() - start
    properties = {"INFERENCE_PRECISION_HINT": request["precision"],
                  "KV_CACHE_PRECISION": request["kv_cache_precision"]}
    if request.get("threads"):
        properties["INFERENCE_NUM_THREADS"] = int(request["threads"])
    kinds = {run["kind"] for run in request["runs"]}
    start = time.perf_counter()
    pipes = {}
    if kinds & {"batch", "text_batch"}:
        scheduler = g.SchedulerConfig()
        scheduler.max_num_batched_tokens = int(request["max_num_batched_tokens"])
        scheduler.max_num_seqs = int(request.get("max_num_seqs", 256))
        scheduler.cache_size = max(1, int(round(request.get("cache_size_gb", 4))))
        scheduler.dynamic_split_fuse = True
        scheduler.enable_prefix_caching = False
        pipes["batch"] = pipes["text_batch"] = g.ContinuousBatchingPipeline(
            request["model"], scheduler, "CPU", properties)
    if "single" in kinds:
        pipes["single"] = g.VLMPipeline(request["model"], "CPU", **properties)
    startup_s = time.perf_counter() - start
    runners = {"batch": run_batch, "text_batch": run_text_batch, "single": run_single}
    start = time.perf_counter()
    for run in request["runs"]:  # warm-up: each pipeline's first request, a token or two
        warm = dict(run, name="warm-up", prompts=run["prompts"][:1],
                    images=(run.get("images") or [[]])[:1], max_tokens=[2], repeat=1)
        runners[run["kind"]](pipes[run["kind"]], warm)
    warmup_s = time.perf_counter() - start
    runs = {run["name"]: runners[run["kind"]](pipes[run["kind"]], run)
            for run in request["runs"]}
    return {"version": g.__version__, "import_s": import_s, "startup_s": startup_s,
            "warmup_s": warmup_s, "runs": runs, "properties": properties,
            "env": {k: v for k, v in os.environ.items() if k.startswith("OV_")}}


if __name__ == "__main__":
    sys.exit(serve(handle))
