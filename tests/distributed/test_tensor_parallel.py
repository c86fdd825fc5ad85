"""Tensor parallelism on CPU (gloo), 2 ranks, float32: the same greedy tokens and prompt logits as
transformers (and as one rank), each rank holding and reading only its shard, failures that surface
as errors from the event itself (a closed connection, the watchdog, a worker's report) rather than a
timeout, no orphan workers, two engines side by side, and the torchrun (multi-node) launch path on
two local "nodes"."""
import gc
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from engine_checks import assert_block_pool_empty

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM, SamplingParams
from vlinfer.distributed import TensorParallelError
from vlinfer.engine import SchedulerOutput

# several processes per test (ranks, torchrun): `make test-full` and CI run it, `make test` leaves
# it out
pytestmark = pytest.mark.slow

from dependencies import REPO as ROOT
NUM_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
rng = random.Random(0)
PROMPTS = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 17, 31, 70)]
# 4 query heads on 2 ranks: "kv2" splits the 2 KV heads, "kv1" (MQA) replicates the single KV head
# on both ranks.
TEXT_MODELS = {"qwen3-kv2": ("qwen3", True, 2), "llama-kv1": ("llama", False, 1)}
OPTIONS = dict(dtype="float32", kv_cache_bytes=4 * 2**20, max_num_batched_tokens=32,
               max_model_len=256)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds=15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def text_models(tmp_path_factory):
    """name -> (checkpoint folder, the transformers model saved there)."""
    models = {}
    for name, (family, tie, kv) in TEXT_MODELS.items():
        path = str(tmp_path_factory.mktemp(name))
        models[name] = path, build_checkpoint(path, tiny_text_config(family, tie, kv))
    return models


@pytest.fixture(scope="module")
def text_checkpoints(text_models):
    return {name: path for name, (path, _) in text_models.items()}


def hf_greedy(model, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    """transformers' arg-max continuation, EOS included (what ignore_eos=True generates)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_new):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(text_models):
    """Per model: transformers' greedy tokens and prompt logits (what every engine must give), and
    one rank's."""
    refs = {}
    for name, (path, model) in text_models.items():
        with torch.no_grad():
            logits = torch.cat([model(torch.tensor([p])).logits[0] for p in PROMPTS[:3]])
        llm = LLM(path, **OPTIONS)
        one_rank = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        refs[name] = SimpleNamespace(tokens=[hf_greedy(model, p) for p in PROMPTS], logits=logits,
                                     one_rank_tokens=one_rank, one_rank_logits=prompt_logits(llm))
    return refs


def prompt_logits(llm) -> torch.Tensor:
    engine = llm.engine
    seqs = [engine.make_sequence(p) for p in PROMPTS[:3]]
    for seq in seqs:
        assert engine.block_manager.allocate(seq, seq.num_tokens)
    logits = engine.model_runner.prompt_logits(SchedulerOutput(seqs, [s.num_tokens for s in seqs]))
    for seq in seqs:
        engine.block_manager.free(seq)
    return logits


@pytest.fixture(scope="module")
def tp_engines(text_checkpoints):
    """One TP=2 engine per text model, alive together for the whole module: one meets its worker on
    a port the OS picks, the other on an explicit distributed_init_method."""
    engines = {"qwen3-kv2": LLM(text_checkpoints["qwen3-kv2"], tensor_parallel_size=2, **OPTIONS),
               "llama-kv1": LLM(text_checkpoints["llama-kv1"], tensor_parallel_size=2, **OPTIONS,
                                distributed_init_method=f"tcp://127.0.0.1:{free_port()}")}
    yield engines
    for llm in engines.values():
        llm.close()


@pytest.mark.parametrize("name", list(TEXT_MODELS))
def test_greedy_matches_transformers_and_one_rank(tp_engines, references, name):
    llm, ref = tp_engines[name], references[name]
    # max_num_batched_tokens=32: prompts are prefilled in chunks, batched with other requests'
    # decodes.
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref.tokens == ref.one_rank_tokens
    assert_block_pool_empty(llm)
    logits = prompt_logits(llm)
    # the whole vocabulary, gathered from both ranks' halves
    assert logits.shape == ref.logits.shape
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref.one_rank_logits, ref.logits, rtol=1e-4, atol=1e-4)


def test_int8_kv_cache_on_two_ranks_equals_one_rank(text_checkpoints, references):
    """Each rank stores its KV heads in int8 with their own per-row scales: the prompt logits equal
    one rank's int8 run within 5e-3, not float32 summation order alone: the row-parallel sums
    reach the next layer's K and V in another order, and a value on a rounding edge then stores
    one int8 step (1/127 of its row's largest) apart; and transformers' within the stated int8
    tolerance."""
    from kv_cache_dtype_cases import TOLERANCE
    path = text_checkpoints["qwen3-kv2"]
    one = prompt_logits(LLM(path, **OPTIONS, kv_cache_dtype="int8"))
    with LLM(path, tensor_parallel_size=2, **OPTIONS, kv_cache_dtype="int8") as llm:
        pool = llm.engine.model_runner.cache_pool
        assert pool.kv_scales.shape[-1] == 1  # this rank's one KV head of two
        two = prompt_logits(llm)
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)
        assert_block_pool_empty(llm)
    torch.testing.assert_close(two, one, rtol=5e-3, atol=5e-3)
    ref = references["qwen3-kv2"].logits
    assert ((two - ref).abs().max() / ref.abs().max()).item() < TOLERANCE["int8"]


def test_c8_static_int8_checkpoint_on_two_ranks_equals_one_rank(text_checkpoints, tmp_path):
    """msModelSlim C8 scales are per KV channel: each rank takes its KV heads' share, so two ranks
    give one rank's logits."""
    from kv_cache_schemes_cases import c8_scales, kv_rows, write_variant
    src = text_checkpoints["qwen3-kv2"]
    path = write_variant(src, str(tmp_path / "c8"), c8_scales(kv_rows(src)),
                         description={"model_quant_type": "FLOAT", "kv_cache_type": "C8"})
    one = prompt_logits(LLM(path, **OPTIONS))
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as llm:
        assert llm.engine.resolved.kv_cache_dtype == torch.int8
        layer = llm.engine.model_runner.cache_pool.layers[0]
        assert layer.static_kv_scales.k_scale.shape == (1, 16)
        two = prompt_logits(llm)
    torch.testing.assert_close(two, one, rtol=5e-3, atol=5e-3)


def test_each_rank_loads_only_its_shard(tp_engines, text_checkpoints):
    from safetensors import safe_open
    for name, llm in tp_engines.items():
        config = tiny_text_config(*TEXT_MODELS[name])
        ranks = llm.engine.model_runner.describe_all()
        assert len(ranks) == 2
        file = os.path.join(text_checkpoints[name], "model.safetensors")
        with safe_open(file, "pt") as f:
            # fp32
            checkpoint_bytes = sum(
                torch.Size(f.get_slice(k).get_shape()).numel() * 4 for k in f.keys())
        kv_per_rank = max(1, config.num_key_value_heads // 2)
        head_dim, hidden, inter = config.head_dim, config.hidden_size, config.intermediate_size
        for info in ranks:
            params = {n: shape for n, (shape, _) in info["params"].items()}
            assert params["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 2 * kv_per_rank) *
                                                                          head_dim, hidden)
            assert params["model.layers.0.self_attn.o_proj.weight"] == (hidden, 2 * head_dim)
            # half of gate + half of up
            assert params["model.layers.0.mlp.gate_up_proj.weight"] == (inter, hidden)
            assert params["model.layers.0.mlp.down_proj.weight"] == (hidden, inter // 2)
            assert params["model.embed_tokens.weight"] == (config.vocab_size // 2, hidden)
            # The KV pool holds this rank's KV heads only (the replicated one for kv1).
            assert info["kv_cache_shape"][4] == kv_per_rank
            # Each rank holds, and read from the file, well under the whole model: its shard plus
            # the small replicated norms (a tied LM head is the embedding, stored once).
            assert info["param_bytes"] < 0.6 * checkpoint_bytes, (name, info["param_bytes"],
                                                                  checkpoint_bytes)
            assert info["checkpoint_bytes_read"] < 0.6 * checkpoint_bytes
        # Together the ranks read every byte of the split weights exactly once; what both keep,
        # twice: the norms and, with one KV head for two ranks, k_proj and v_proj.
        replicated = sum(b for n, (_, b) in ranks[0]["params"].items() if "norm" in n)
        if config.num_key_value_heads < 2:
            replicated += config.num_hidden_layers * 2 * kv_per_rank * head_dim * hidden * 4
        assert sum(r["checkpoint_bytes_read"] for r in ranks) == checkpoint_bytes + replicated


def test_two_tp_engines_at_once(tp_engines, references):
    """Both engines live in this process at once, each with its own store, port, groups and worker;
    their steps interleave."""
    engines = [tp_engines[name].engine for name in TEXT_MODELS]
    ids = [[e.add_request(p, GREEDY) for p in PROMPTS] for e in engines]
    done = [dict() for _ in engines]
    while any(e.has_unfinished_requests() for e in engines):
        for engine, finished in zip(engines, done):
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out.outputs[0].token_ids
    for name, request_ids, finished in zip(TEXT_MODELS, ids, done):
        assert [finished[r] for r in request_ids] == references[name].tokens


def test_qwen3_vl_with_images_matches_transformers_and_one_rank(tmp_path_factory):
    from transformers import Qwen3VLForConditionalGeneration
    from qwen3_vl_engine_cases import CASES, hf_greedy as hf_vl_greedy, hf_inputs, requests
    from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
    path = build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("vl-kv1")), seed=0, num_heads=4,
                               num_kv_heads=1, head_dim=32, mrope_section=(6, 5, 5), vision_depth=2,
                               deepstack_visual_indexes=[0, 1], tie_word_embeddings=False)
    cases = requests()[:4]  # one image; two images around text; text only; a small image
    assert len(CASES) >= 4
    options = dict(dtype="float32", kv_cache_bytes=16 * 2**20, max_model_len=1024,
                   max_num_batched_tokens=48)
    one_rank = LLM(path, **options)
    reference = [o.outputs[0].token_ids for o in one_rank.generate(cases, GREEDY, use_tqdm=False)]
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    # transformers, with its own processor's placeholder expansion and pixels.
    assert reference == [hf_vl_greedy(model, *hf_inputs(one_rank, text, images), num_new=NUM_NEW)
                         for text, images in CASES[:4]]
    with LLM(path, tensor_parallel_size=2, **options) as llm:
        # A 48-token budget cuts prefill chunks through the images: each rank gets just its chunk's
        # image rows.
        outs = llm.generate(cases, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        vision = llm.engine.model_runner.vision
        assert vision.num_images_encoded == 3  # on rank 0, once per distinct image
        ranks = llm.engine.model_runner.describe_all()
        visual = [
            sum(b for n, (_, b) in r["params"].items() if n.startswith("model.visual."))
            for r in ranks
        ]
        assert visual[0] > 0 and visual[1] == 0  # the vision tower lives on rank 0 only
        assert ranks[1]["params"]["model.language_model.layers.0.self_attn.qkv_proj.weight"][0] == (
            (2 + 2) * 32, 128)
        assert_block_pool_empty(llm)


def assert_seen_not_waited_out(error: BaseException) -> None:
    """The failure was noticed from the event (a closed connection, the watchdog, the worker's own
    report), not by waiting out distributed_timeout_s: checked on the error and its causes, not by a
    clock, which a loaded machine could break."""
    chain, e = [], error
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert not any("timed out" in c.lower() or "did not answer within" in c for c in chain), chain


def test_killed_worker_is_an_error_at_the_next_step(text_checkpoints):
    llm = LLM(text_checkpoints["llama-kv1"], tensor_parallel_size=2, **OPTIONS)
    engine = llm.engine
    (pid,) = engine.driver.worker_pids.values()
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(pid, signal.SIGKILL)
    steps = 0
    with pytest.raises(TensorParallelError, match=r"rank 1 .*killed by SIGKILL") as info:
        while engine.has_unfinished_requests():
            steps += 1
            engine.step()
    # the first step that needs it fails
    assert steps == 1, f"{steps} steps ran after the worker was killed"
    assert_seen_not_waited_out(info.value)
    with pytest.raises(TensorParallelError, match="closed"):  # and it stays an error, at once
        engine.step()
    assert not wait_gone([pid])
    llm.close()


def test_worker_exception_is_reported(text_checkpoints, monkeypatch):
    monkeypatch.setenv("VLINFER_TEST_WORKER_FAULT", "1:4")  # rank 1 raises at its 4th step
    llm = LLM(text_checkpoints["qwen3-kv2"], tensor_parallel_size=2, **OPTIONS)
    (pid,) = llm.engine.driver.worker_pids.values()
    with pytest.raises(TensorParallelError, match="(?s)rank 1.*injected fault at step 4") as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_seen_not_waited_out(info.value)
    assert not wait_gone([pid])
    assert_block_pool_empty(llm)  # the failed run's requests were aborted


def test_hung_worker_times_out(text_checkpoints, monkeypatch):
    # rank 1 stops answering at its 4th step
    monkeypatch.setenv("VLINFER_TEST_WORKER_FAULT", "1:4:hang")
    llm = LLM(text_checkpoints["qwen3-kv2"], tensor_parallel_size=2, distributed_timeout_s=2,
              **OPTIONS)
    (pid,) = llm.engine.driver.worker_pids.values()
    # The message names the 2 s timeout: that, not a clock bound on the test, shows which path
    # fired.
    with pytest.raises(TensorParallelError, match="did not answer within distributed_timeout_s=2"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not wait_gone([pid])  # the hung worker was stopped


def test_del_closes_workers_and_leaves_no_shared_memory(text_checkpoints):
    before = shm_entries()
    llm = LLM(text_checkpoints["qwen3-kv2"], tensor_parallel_size=2, **OPTIONS)
    pids = list(llm.engine.driver.worker_pids.values())
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    assert not wait_gone(pids)
    assert shm_entries() - before == set()


def test_closing_the_last_engine_restores_sigterm(text_checkpoints):
    """A TP engine closes its workers on SIGTERM through a handler of its own; once the last engine
    is closed the process's SIGTERM is what it was before (its own process: other tests' engines
    hold the handler here)."""
    code = (
        f"import signal\nfrom vlinfer import LLM\n"
        f"llm = LLM({text_checkpoints['qwen3-kv2']!r}, tensor_parallel_size=2, **{OPTIONS!r})\n"
        f"during = signal.getsignal(signal.SIGTERM)\n"
        f"llm.close()\n"
        "print('DURING', during is not signal.SIG_DFL, 'AFTER', signal.getsignal(signal.SIGTERM) "
        "is signal.SIG_DFL)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DURING True AFTER True" in out.stdout


SCRIPT = """
import json, os, sys, time
from vlinfer import LLM, SamplingParams

# A user's program, where Ctrl-C raises KeyboardInterrupt (tests/conftest.py makes sure the run
# does not hand it an ignored SIGINT).
if __name__ == "__main__":
    path, mode = sys.argv[1], sys.argv[2]
    llm = LLM(path, tensor_parallel_size=2, dtype="float32", kv_cache_bytes=4 * 2 ** 20,
              max_model_len=256)
    # only rank 0 gets here; the other rank served it inside LLM(...) and exited
    if mode == "torchrun":
        prompts = json.loads(sys.argv[3])
        params = SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    else:
        print("WORKERS " + json.dumps(list(llm.engine.driver.worker_pids.values())), flush=True)
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
        # the next generate starts now: a signal from here on lands mid-generation
        print("GENERATING []", flush=True)
        # until interrupted: one generate can end (max_model_len) before the signal comes
        while True:
            llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
""" % NUM_NEW


def start_script(tmp_path, name: str, *args, env=None, launcher=()):
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    stderr = open(tmp_path / f"{name}.stderr", "w")  # a file, not a pipe nobody drains
    proc = subprocess.Popen([*launcher, str(script), *args], stdout=subprocess.PIPE, stderr=stderr,
                            text=True, env=env, start_new_session=True)
    stderr.close()  # the child has its own copy
    proc.stderr_path = tmp_path / f"{name}.stderr"
    return proc


def stderr_tail(proc) -> str:
    return proc.stderr_path.read_text()[-3000:]


def read_marker(proc, marker: str, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if not line:
                break  # the script ended
            if line.startswith(marker):
                return json.loads(line[len(marker):])
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no {marker!r} line within {timeout:.0f} s; stderr:\n{stderr_tail(proc)}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signals_leave_no_orphans(text_checkpoints, tmp_path, sig):
    proc = start_script(tmp_path, "rank0", text_checkpoints["qwen3-kv2"], "signal",
                        launcher=(sys.executable, ))
    try:
        workers = read_marker(proc, "WORKERS ")
        # one generate done, the next one running: the signal lands mid-generation
        read_marker(proc, "GENERATING ")
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        assert proc.returncode != 0
        assert not wait_gone(workers), "worker outlived rank 0"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_nodes(text_checkpoints, references, tmp_path):
    """The multi-node recipe on one host: two torchrun agents (node ranks 0 and 1, one process
    each), meeting at the node-0 agent's store through MASTER_ADDR / MASTER_PORT, as two machines
    would."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = free_port()
    prompts = json.dumps(PROMPTS)
    nodes = []
    for node_rank in (0, 1):
        launcher = (torchrun, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node_rank}",
                    "--master-addr=127.0.0.1", f"--master-port={port}")
        nodes.append(
            start_script(tmp_path, f"node{node_rank}", text_checkpoints["llama-kv1"], "torchrun",
                         prompts, launcher=launcher, env={"OMP_NUM_THREADS": "1"}))
    try:
        tokens = read_marker(nodes[0], "TOKENS ")
        assert tokens == references["llama-kv1"].tokens
        # rank 0 closes the engine at exit; rank 1's LLM(...) then returns by exiting
        for node in nodes:
            node.wait(timeout=60)
            assert node.returncode == 0, stderr_tail(node)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
