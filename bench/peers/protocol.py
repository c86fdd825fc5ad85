"""The request/result side shared by the peer scripts (stdlib only: each peer venv imports it from
this folder) and the timing loop they share with the benchmarks."""
import json
import sys
import time


def time_runs(generate, runs: list[dict], tag: str = "") -> dict:
    """Time generate(prompts, max_tokens) -> token id lists over each run's `repeat` repeats: per
    run name, the wall seconds of every repeat and the outputs of the first. Every requested token
    must come back (EOS ignored)."""
    results = {}
    for run in runs:
        seconds, outputs = [], None
        for _ in range(run.get("repeat", 1)):
            start = time.perf_counter()
            got = generate(run["prompts"], run["max_tokens"])
            seconds.append(time.perf_counter() - start)
            produced, wanted = sum(map(len, got)), sum(run["max_tokens"])
            assert produced == wanted, (f"{run['name']}: {produced} tokens came back, "
                                        f"{wanted} requested")
            outputs = outputs or [list(map(int, o)) for o in got]
        results[run["name"]] = {"seconds": seconds, "outputs": outputs}
        print(f"{tag}{run['name']}: " + ", ".join(f"{s:.2f}s" for s in seconds), flush=True)
    return results


def serve(handler) -> int:
    """A peer script's main: `python PEER.py request.json result.json`; handler(request) -> result
    dict."""
    request_path, result_path = sys.argv[1:3]
    with open(request_path) as f:
        request = json.load(f)
    result = handler(request)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0
