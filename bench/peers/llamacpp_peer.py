"""llama.cpp (through llama-cpp-python, built from source by `make peers`) as a benchmark peer; run
with that venv's python (see bench/peers/__init__.py):

    .venv-llamacpp/bin/python bench/peers/llamacpp_peer.py request.json result.json

The request: {"model": .gguf path, "threads", "n_ctx", "runs": [{"name", "prompts": [[token ids]],
"max_tokens": [n per prompt], "repeat"}], optional "prompt_lookup": {"num_pred_tokens",
"max_ngram_size"}}. One sequence at a time (llama.cpp's single-stream case): the prompt in one
batch, then one token per step, greedy (argmax of the last logits), EOS ignored, the KV cache
overwritten from position 0 for every prompt. With "prompt_lookup", llama-cpp- python's own
prompt-lookup decoding (LlamaPromptLookupDecoding as the Llama's draft_model) through
Llama.generate, which evaluates the proposed tokens with the last one and keeps those its greedy
sampler agrees with. One warm-up prompt comes before the first timed run; loading the model is timed
apart.
"""
import sys
import time

from protocol import serve, time_runs  # beside this script


def cpu_has_amx_int8() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " amx_int8" in line for line in f)


def without_extra_buffers(llama_cpp) -> None:
    """Load models with use_extra_bufts off: on CPUs with AMX-INT8, ggml puts Q4/Q8 weights in its
    AMX buffer, and ggml_backend_amx_mul_mat segfaults on the first decode on our machines (gdb
    backtrace, 2026-12-01); off, llama.cpp runs its ordinary CPU kernels (AVX-512 VNNI here), as on
    any CPU without AMX. llama-cpp-python has no argument for it, so the default model params it
    starts from are wrapped."""
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_cpp.llama_model_default_params = params


def handle(request: dict) -> dict:
    import llama_cpp
    import numpy as np
    start = time.perf_counter()
    threads = request["threads"]
    extra_buffers = not cpu_has_amx_int8()
    if not extra_buffers:
        without_extra_buffers(llama_cpp)
    lookup = request.get("prompt_lookup")
    draft = None
    if lookup is not None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup["num_pred_tokens"],
                                          max_ngram_size=lookup["max_ngram_size"])
    llm = llama_cpp.Llama(model_path=request["model"], n_ctx=request["n_ctx"], n_batch=512,
                          n_threads=threads, n_threads_batch=threads, logits_all=False,
                          verbose=False, draft_model=draft)
    startup_s = time.perf_counter() - start
    vocab = llm.n_vocab()

    def one_with_lookup(prompt, max_tokens):
        llm.reset()  # no prefix reuse between prompts, as in `one`
        out = []
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == max_tokens:
                return out

    def one(prompt, max_tokens):
        if draft is not None:
            return one_with_lookup(prompt, max_tokens)
        llm.reset()  # n_tokens = 0: the next eval drops the cache past position 0 and refills it
        llm.eval(prompt)
        out = []
        while True:
            # Without logits_all, llama-cpp-python keeps no scores; the context holds the last
            # token's logits.
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                           shape=(vocab, ))
            out.append(int(np.argmax(logits)))
            if len(out) == max_tokens:
                return out
            llm.eval(out[-1:])

    def generate(prompts, max_tokens):
        return [one(p, n) for p, n in zip(prompts, max_tokens)]

    start = time.perf_counter()
    generate([[1, 2, 3]], [4])
    warmup_s = time.perf_counter() - start
    runs = time_runs(generate, request["runs"], tag="llamacpp_peer: ")
    return {
        "version": llama_cpp.__version__, "startup_s": startup_s, "warmup_s": warmup_s,
        "runs": runs,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip() +
        (""
         if extra_buffers else " (AMX/repack weight buffers off: ggml's AMX matmul crashes here)")
    }


if __name__ == "__main__":
    sys.exit(serve(handle))
