"""vLLM's CPU backend as a benchmark peer; run with the vLLM venv's python (see
bench/peers/__init__.py):

    .venv-vllm/bin/python bench/peers/vllm_peer.py request.json result.json

The request: {"model": HF folder, "dtype", "max_model_len", "max_num_seqs", "kv_cache_gb",
"kv_cache_dtype" (vLLM's names; its CPU backend takes auto and fp8 / fp8_e4m3 / fp8_e5m2, fp8 only
with AVX-512 or AMX), "cpus", "runs": [{"name", "prompts": [[token ids]], "max_tokens": [n per
prompt], "repeat"}]}, and optionally "lora": {"max_loras", "max_lora_rank", "adapters": [[name, id,
PEFT folder], ...]} with each run's "loras": [an index into those adapters, or null, per prompt]
(enable_lora=True; vLLM's CPU backend runs LoRA through its torch punica ops, and turns its
torch.compile off when LoRA is on). Each run is one LLM.generate of all its prompts, greedy, EOS
ignored; one warm-up generate comes before the first timed run (one per adapter with LoRA, so every
adapter is loaded before the timing). Start-up (LLM(): model load, torch.compile, KV cache
allocation) is timed apart. vLLM starts its engine in a spawned process, so everything runs under
the __main__ guard.
"""
import os
import sys
import time

from protocol import serve, time_runs  # beside this script


def handle(request: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(request.get("kv_cache_gb", 4)))
    # vLLM's "auto" binding keeps one core per worker for its scheduler process, which on a 2-core
    # machine leaves its model one thread; bind its OpenMP threads to the same cores the other
    # engines use instead.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", request["cpus"])
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import_s = time.perf_counter() - start
    start = time.perf_counter()
    lora, adapters = request.get("lora"), []
    options = {}
    if lora:
        from vllm.lora.request import LoRARequest
        adapters = [LoRARequest(name, int(i), path) for name, i, path in lora["adapters"]]
        options = dict(enable_lora=True, max_loras=lora["max_loras"],
                       max_lora_rank=lora["max_lora_rank"],
                       max_cpu_loras=max(lora["max_loras"], len(adapters)))
    llm = LLM(model=request["model"], dtype=request["dtype"],
              max_model_len=request["max_model_len"], max_num_seqs=request.get("max_num_seqs", 256),
              kv_cache_dtype=request.get("kv_cache_dtype", "auto"), seed=0, **options)
    startup_s = time.perf_counter() - start

    def generator(loras=None):
        def generate(prompts, max_tokens):
            params = [
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens
            ]
            kw = {} if loras is None else dict(
                lora_request=[None if i is None else adapters[i] for i in loras])
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                use_tqdm=False, **kw)
            return [o.outputs[0].token_ids for o in outs]
        return generate

    start = time.perf_counter()
    for i in ([None] if not adapters else range(len(adapters))):
        generator(None if i is None else [i])([[1, 2, 3]], [4])
    warmup_s = time.perf_counter() - start
    runs = {}
    # time_runs calls generate(prompts, max_tokens): each run's adapters bound here
    for run in request["runs"]:
        runs.update(time_runs(generator(run.get("loras")), [run], tag="vllm_peer: "))
    return {
        "version": vllm.__version__, "import_s": import_s, "startup_s": startup_s,
        "warmup_s": warmup_s, "runs": runs,
        "env": {k: v
                for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
    }


if __name__ == "__main__":
    sys.exit(serve(handle))
