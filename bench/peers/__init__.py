"""Peer engines for the benchmarks: vLLM's CPU backend, llama.cpp (llama-cpp-python) and OpenVINO
GenAI, each installed in its own venv by `make peers` (their torch/numpy pins are not ours) and run
here as a subprocess with that venv's python.

The protocol is two JSON files. The benchmark writes a request (model path, dtype, threads, and a
list of runs: the prompts as token ids, max_tokens per prompt, a repeat count; greedy, EOS ignored);
the peer script (`vllm_peer.py`, `llamacpp_peer.py` beside this file) writes a result: its version,
start-up seconds (not part of any timing), and per run the wall seconds of each repeat plus the
generated token ids of the first one. The peer's own log goes to a file in the cache folder, whose
tail is shown when it fails.

This module also writes the peers' inputs from the weights vlinfer runs, once, into vlinfer's cache
folder: the SmolLM2 GGUF dequantized to a float32 safetensors Hugging Face folder (for vLLM) and to
an all-F32 GGUF (for llama.cpp). Both are dequantized by the same gguf-package code transformers
(and so vlinfer's loader) uses. For OpenVINO it exports a Hugging Face folder to OpenVINO IR with
the venv's optimum-cli, once per folder and weight format (openvino_ir).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PEERS = {  # name -> (label, venv folder in the repo root, script beside this file)
    "vllm": ("vLLM-CPU", ".venv-vllm", "vllm_peer.py"),
    "llama.cpp": ("llama.cpp", ".venv-llamacpp", "llamacpp_peer.py"),
    "openvino": ("OpenVINO GenAI", ".venv-openvino", "openvino_peer.py"),
}
# optimum-intel 2.2.0 caps each architecture's export at some transformers versions: Qwen3-VL at
# 5.0 (the venv's), Qwen3.5 between 5.2.0 and 5.2.x; `make peers` puts 5.2.0 in a folder of the
# venv put first on PYTHONPATH for these model types' exports.
EXPORT_TRANSFORMERS = {"qwen3_5": "transformers-5.2", "qwen3_5_moe": "transformers-5.2",
                       "qwen3_5_text": "transformers-5.2", "qwen3_5_moe_text": "transformers-5.2"}


class PeerError(RuntimeError):
    pass


def label(name: str) -> str:
    return PEERS[name][0]


def python(name: str) -> str | None:
    """The peer venv's python, or None when `make peers` has not installed it."""
    venv = os.path.join(REPO, PEERS[name][1])
    return os.path.join(venv, "bin", "python") if os.path.exists(os.path.join(
        venv, ".installed")) else None


def not_installed(name: str) -> str:
    return f"{label(name)}: not installed (make peers)"


def usable(name: str, model: str) -> bool:
    """Whether this peer can run `model` here; says why not otherwise, so a benchmark runs the rest
    without it. vLLM's peer runs text models; llama.cpp's reads a GGUF."""
    from vlinfer import loading
    if python(name) is None:
        print(not_installed(name), flush=True)
        return False
    if name == "openvino":
        return True
    if name == "vllm" and not is_text_model(model):
        print(
            f"{label(name)}: skipped ({model} is not a text-only model; the peer runs text models)",
            flush=True)
        return False
    if name == "llama.cpp" and not loading.resolve_model(model).gguf_file:
        print(f"{label(name)}: skipped ({model} is not a GGUF; the peer reads GGUF files)",
              flush=True)
        return False
    return True


def try_run(name: str, request: dict) -> dict | None:
    """run(name, request), or None after printing why it failed. vLLM's start is announced: it
    compiles for minutes before its first line of output."""
    if name == "vllm":
        print(
            f"{label(name)}: starting (its start-up compiles for a few minutes; log "
            f"{cache_dir()}/peer-{name}.log)",
            flush=True)
    try:
        return run(name, request)
    except PeerError as e:
        print(e, flush=True)
        return None


def cpus(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as a list vLLM's VLLM_CPU_OMP_THREADS_BIND
    takes."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))


def cache_dir() -> str:
    from vlinfer.loading import cache_dir as vlinfer_cache
    path = vlinfer_cache()
    os.makedirs(path, exist_ok=True)
    return path


def run(name: str, request: dict, timeout: float = 3600) -> dict:
    """Run one peer on `request`; returns its result dict, plus `process_s` (the subprocess's whole
    wall time) and `log` (its log file). Raises PeerError with the log's tail when it fails."""
    script = os.path.join(HERE, PEERS[name][2])
    log = os.path.join(cache_dir(), f"peer-{name}.log")
    env = {
        k: v
        for k, v in os.environ.items() if k not in ("PYTHONHOME", "PYTHONPATH", "VIRTUAL_ENV")
    }
    with tempfile.TemporaryDirectory(prefix="vlinfer-peer-") as tmp:
        req, res = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req, "w") as f:
            json.dump(request, f)
        start = time.perf_counter()
        with open(log, "w") as out:
            try:
                rc = subprocess.run([python(name), script, req, res], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = f"timed out after {timeout:.0f}s"
        elapsed = time.perf_counter() - start
        if rc != 0 or not os.path.exists(res):
            with open(log, errors="replace") as f:
                tail = "".join(f.readlines()[-25:])
            raise PeerError(f"{label(name)} failed (exit {rc}); last lines of {log}:\n{tail}")
        with open(res) as f:
            result = json.load(f)
    result.update(process_s=elapsed, log=log)
    return result


def is_text_model(model: str) -> bool:
    from vlinfer import loading
    config = loading.load_config(loading.resolve_model(model))
    return all(a.endswith("ForCausalLM") for a in config.architectures or ["?"])


def _gguf_source(model: str):
    from vlinfer import loading
    source = loading.resolve_model(model)
    if not source.gguf_file:
        raise PeerError(
            f"model {model!r} is not a GGUF; the peers' inputs are written from the SmolLM2 GGUF")
    return source


def dense_model(model: str, dtype: str):
    """A plain transformers model (no GGUF quantizer attached) holding the dequantized weights
    vlinfer runs, in `dtype`. transformers' own GGUF loading keeps the quantizer and computes
    through float32 dequant kernels (and refuses save_pretrained), so the weights go through
    vlinfer's loader into a model built from the config."""
    import torch
    from transformers import AutoModelForCausalLM
    from vlinfer import loading
    source = loading.resolve_model(model)
    if not source.gguf_file:
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=getattr(torch, dtype))
    config = loading.load_config(source)
    dense = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    state = dict(loading.iterate_weights(source, config))
    missing, unexpected = dense.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    dense.tie_weights()
    return dense


def _cached(name: str, build) -> str:
    """cache_dir()/name, built once by build(tmp_path) into a temporary path and renamed when
    complete."""
    path = os.path.join(cache_dir(), name)
    if not os.path.exists(path):
        tmp = os.path.join(cache_dir(), f".{name}.partial-{os.getpid()}")
        start = time.perf_counter()
        build(tmp)
        os.rename(tmp, path)
        print(f"wrote {path} in {time.perf_counter() - start:.0f}s (once)", flush=True)
    return path


def hf_folder(model: str = "smollm2") -> str:
    """The model's GGUF dequantized to float32 and saved as a Hugging Face folder (safetensors,
    config, tokenizer), for vLLM (a model that already is such a folder is used as it is).
    rope_theta is also written flat in config.json for readers that predate transformers 5's
    rope_parameters."""
    from vlinfer import loading
    if not loading.resolve_model(model).gguf_file:
        return loading.resolve_model(model).folder
    source = _gguf_source(model)
    stem = os.path.splitext(source.gguf_file)[0]

    def build(tmp):
        from transformers import AutoTokenizer
        shutil.rmtree(tmp, ignore_errors=True)
        dense_model(model, "float32").save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(source.folder,
                                      gguf_file=source.gguf_file).save_pretrained(tmp)
        config_path = os.path.join(tmp, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            config.setdefault("rope_theta", rope["rope_theta"])
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)

    return _cached(f"bench-{stem}-f32-hf", build)


def openvino_ir(folder: str, weight_format: str = "fp32", task: str | None = None,
                timeout: float = 7200) -> str:
    """`folder` (a Hugging Face checkpoint) exported to OpenVINO IR by the OpenVINO venv's
    optimum-cli, offline, once: cached under cache_dir()/openvino-ir/ by the folder's name, its
    config's hash and the weight format (fp32 keeps the weights as they are; int8 is OpenVINO's
    default deployment for models over 1B parameters). The export log goes beside it. A real 2B
    checkpoint takes minutes and ~15 GB of memory."""
    import hashlib
    with open(os.path.join(folder, "config.json"), "rb") as f:
        raw = f.read()
    config = json.loads(raw)
    model_type = config.get("model_type", "")
    task = task or ("image-text-to-text" if "vision_config" in config
                    else "text-generation-with-past")
    stem = f"{os.path.basename(os.path.normpath(folder))}-{hashlib.sha1(raw).hexdigest()[:8]}"
    root = os.path.join(cache_dir(), "openvino-ir")
    os.makedirs(root, exist_ok=True)
    out = os.path.join(root, f"{stem}-{weight_format}")
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    venv = os.path.join(REPO, PEERS["openvino"][1])
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONHOME", "PYTHONPATH", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    if model_type in EXPORT_TRANSFORMERS:
        env["PYTHONPATH"] = os.path.join(venv, EXPORT_TRANSFORMERS[model_type])
    log = out + ".log"
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    print(f"{label('openvino')}: exporting {folder} ({model_type}, {weight_format} weights) to "
          f"{out} once; log {log}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([os.path.join(venv, "bin", "optimum-cli"), "export", "openvino",
                             "--model", folder, "--task", task, "--weight-format", weight_format,
                             partial], stdout=f, stderr=subprocess.STDOUT, env=env,
                            timeout=timeout).returncode
    if rc != 0:
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-15:])
        raise PeerError(f"{label('openvino')} export failed (exit {rc}); last lines of {log}:\n"
                        f"{tail}")
    open(os.path.join(partial, ".complete"), "w").close()
    shutil.rmtree(out, ignore_errors=True)
    os.rename(partial, out)
    print(f"exported in {time.perf_counter() - start:.0f}s", flush=True)
    return out


def try_openvino_ir(folder: str, weight_format: str = "fp32") -> str | None:
    """openvino_ir, or None after printing why it could not export (or that the venv is absent).
    """
    if python("openvino") is None:
        print(not_installed("openvino"), flush=True)
        return None
    try:
        return openvino_ir(folder, weight_format)
    except (PeerError, subprocess.TimeoutExpired) as e:
        print(e, flush=True)
        return None


def f32_gguf(model: str = "smollm2") -> str:
    """The model's GGUF with every tensor dequantized to F32 (same names, metadata and tokenizer),
    for llama.cpp."""
    source = _gguf_source(model)
    stem = os.path.splitext(source.gguf_file)[0]

    def build(tmp):
        import gguf
        import numpy as np
        reader = gguf.GGUFReader(source.path)
        arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
        writer = gguf.GGUFWriter(tmp, arch)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # written by GGUFWriter itself
            value = field.contents()
            if field.name == gguf.Keys.General.FILE_TYPE:
                value = int(gguf.LlamaFileType.ALL_F32)
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.ascontiguousarray(
                gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return _cached(f"bench-{stem}-f32.gguf", build)


if __name__ == "__main__":  # python bench/peers/__init__.py: write both peer inputs now
    print(hf_folder(), f32_gguf(), sep="\n")
    sys.exit(0)
