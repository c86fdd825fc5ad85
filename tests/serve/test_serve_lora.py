"""LoRA adapters on the OpenAI-compatible server, through the official `openai` client: two adapters
and the base model chosen by `model` on one tiny random Qwen3-VL (float32), every answer equal to
LLM.generate / LLM.chat with the same LoRARequest; /v1/models listing them (parent: the base model);
an unknown name a 404 while the server goes on; a bad adapter at startup a clear error naming it;
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter when --allow-runtime-lora-updating allows
them, and refused otherwise."""
import argparse
import concurrent.futures
from types import SimpleNamespace

import httpx
import openai
import pytest

from vlinfer import LLM, LoRARequest, SamplingParams
from vlinfer.cli.serve import build_parser, lora_module
from vlinfer.cli.serve import main as serve_main
from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.serve import ServeConfig, build_app
from vlinfer.serve.config import LoRAModule
from serve_helpers import ServerThread
from lora_surfaces_cases import ATTENTION, EVERY_LINEAR, make_vl_adapter

BASE = "tiny-vl"
KEY = "test-key-lora"
ENGINE = dict(dtype="float32", max_model_len=1024, kv_cache_bytes=32 << 20, enable_lora=True,
              max_loras=2, max_lora_rank=8)
MESSAGES = [{"role": "user", "content": "Tell me about shapes."}]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
    return build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("vl")), seed=0,
                               tie_word_embeddings=False)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """name -> folder: two adapters of rank 4 and 8, and one of rank 16 (above the server's
    max_lora_rank)."""
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": make_vl_adapter(checkpoint, str(root / "sql"), 4, ATTENTION, 1),
            "poet": make_vl_adapter(checkpoint, str(root / "poet"), 8, EVERY_LINEAR, 2),
            "wide": make_vl_adapter(checkpoint, str(root / "wide"), 16, ATTENTION, 3)}


@pytest.fixture(scope="module")
def offline(checkpoint, adapters):
    """What each model answers through LLM (greedy): chat and completion, per adapter (None: the
    base model)."""
    llm = LLM(checkpoint, **ENGINE)
    loras = {None: None, "sql": LoRARequest("sql", 1, adapters["sql"]),
             "poet": LoRARequest("poet", 2, adapters["poet"])}
    chat, completion = {}, {}
    for name, lora in loras.items():
        chat[name] = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
                              lora_request=lora)[0].outputs[0].text
        completion[name] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6),
                                        use_tqdm=False, lora_request=lora)[0].outputs[0].text
    # the adapters change the answers
    assert len(set(chat.values())) == 3 and len(set(completion.values())) == 3
    llm.close()
    return SimpleNamespace(chat=chat, completion=completion)


@pytest.fixture(scope="module")
def served(checkpoint, adapters):
    engine = LLMEngine(checkpoint, **ENGINE)
    loop = EngineLoop(engine)
    config = ServeConfig(
        served_model_names=(BASE, ), api_key=KEY,
        lora_modules=(LoRAModule("sql", adapters["sql"]), LoRAModule("poet", adapters["poet"],
                                                                     BASE)))
    try:
        with ServerThread(build_app(loop, config)) as url:
            yield SimpleNamespace(url=url, engine=engine, loop=loop)
    finally:
        loop.close()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, timeout=60, max_retries=0) as c:
        yield c


def chat(client, model: str, **kw) -> str:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                       **kw)
    assert r.model == model
    return r.choices[0].message.content


def complete(client, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.model == model
    return r.choices[0].text


def test_models_lists_each_adapter_with_its_parent(client, adapters):
    models = client.models.list().data
    assert [m.id for m in models] == [BASE, "sql", "poet"]
    assert models[0].parent is None
    assert [(m.parent, m.root) for m in models[1:]] == [(BASE, adapters["sql"]),
                                                        (BASE, adapters["poet"])]


def test_model_chooses_the_adapter_in_one_batch(client, offline):
    """The base model and both adapters, chat and completions, all at once (one engine step holds
    two adapters): each answer is LLM's with the same LoRARequest."""
    names = [BASE, "sql", "poet"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(chat, client, name) for name in names]
        completions = [pool.submit(complete, client, name) for name in names]
        got_chat, got_completion = [f.result() for f in chats], [f.result() for f in completions]
    keys = [None, "sql", "poet"]
    assert got_chat == [offline.chat[k] for k in keys]
    assert got_completion == [offline.completion[k] for k in keys]
    r = client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=8, temperature=0,
                                       n=2)
    # every choice runs the adapter
    assert [c.message.content for c in r.choices] == [offline.chat["sql"]] * 2


def test_streamed_answers_run_the_adapter(client, offline):
    chunks = list(
        client.chat.completions.create(model="poet", messages=MESSAGES, max_tokens=8, temperature=0,
                                       stream=True))
    assert {c.model for c in chunks} == {"poet"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks
                   if c.choices) == offline.chat["poet"]
    streamed = client.completions.create(model="sql", prompt=PROMPT, max_tokens=6, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == offline.completion["sql"]


def test_an_unknown_adapter_is_a_404_naming_it_and_the_server_goes_on(client, served, offline):
    with pytest.raises(
            openai.NotFoundError, match=r"the model 'nope' does not exist; this server serves "
            r"\['tiny-vl', 'sql', 'poet'\]") as e:
        chat(client, "nope")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    # An adapter on a pooling route is named as one (a generating model answers those with a 400
    # anyway).
    r = httpx.post(served.url + "/v1/embeddings", json={"model": "sql", "input": "x"}, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "'sql' is a LoRA adapter" in r.json()["error"]["message"]
    assert chat(client, "sql") == offline.chat["sql"]


def test_runtime_updates_are_refused_unless_allowed(served):
    for route, body in (("load", {"lora_name": "x",
                                  "lora_path": "/tmp"}), ("unload", {"lora_name": "sql"})):
        r = httpx.post(f"{served.url}/v1/{route}_lora_adapter", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["message"] == (
            f"/v1/{route}_lora_adapter is off: loading and unloading LoRA "
            "adapters at runtime needs the server flag "
            "--allow-runtime-lora-updating")
    # the API key
    assert httpx.post(f"{served.url}/v1/load_lora_adapter", json={}, timeout=30).status_code == 401


def test_load_and_unload_at_runtime(served, adapters, offline):
    """A second app on the same engine loop, with runtime updates on and no adapter at the start."""
    config = ServeConfig(served_model_names=(BASE,), allow_runtime_lora_updating=True)
    with ServerThread(build_app(served.loop, config)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60,
                          max_retries=0) as client:
        def post(route: str, **body) -> httpx.Response:
            return httpx.post(f"{url}/v1/{route}_lora_adapter", json=body, timeout=60)

        assert [m.id for m in client.models.list().data] == [BASE]
        r = post("load", lora_name="sql", lora_path=adapters["sql"])
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
        assert [(m.id, m.parent) for m in client.models.list().data] == [(BASE, None),
                                                                         ("sql", BASE)]
        assert complete(client, "sql") == offline.completion["sql"]
        refusals = [
            (post("load", lora_name="sql",
                  lora_path=adapters["poet"]), "the LoRA adapter 'sql' has already been loaded"),
            (post("load", lora_name=BASE,
                  lora_path=adapters["poet"]), f"the LoRA adapter name '{BASE}' is a served "
             "model name"),
            (post("load", lora_name="gone", lora_path=adapters["sql"] + "-missing"),
             f"LoRA adapter '{adapters['sql']}-missing': no adapter_config.json there"),
            (post("load", lora_name="wide", lora_path=adapters["wide"]),
             "LoRA adapter 'wide': rank 16 is above max_lora_rank=8"),
            (post("load", lora_name="sql2"), "lora_path: Field required"),
            (post("load", lora_name="",
                  lora_path=adapters["sql"]), "lora_name: String should have at least 1"),
        ]
        for r, words in refusals:
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        # the refused ones are not served
        assert [m.id for m in client.models.list().data] == [BASE, "sql"]

        r = post("unload", lora_name="sql")
        assert r.status_code == 200 \
            and r.text == "Success: LoRA adapter 'sql' removed successfully."
        assert [m.id for m in client.models.list().data] == [BASE]
        with pytest.raises(openai.NotFoundError, match="'sql' does not exist"):
            complete(client, "sql")
        r = post("unload", lora_name="sql")
        assert r.status_code == 404 and r.json()["error"]["message"] == \
            "the LoRA adapter 'sql' cannot be found; loaded: []"
        # The name again, on another adapter: a new lora_int_id, so nothing of the old one (its host
        # copy, its prefix-cache blocks of the same prompt) answers for it.
        assert post("load", lora_name="sql", lora_path=adapters["poet"]).status_code == 200
        assert complete(client, "sql") == offline.completion["poet"]
        assert chat(client, "sql") == offline.chat["poet"]
        assert complete(client, BASE) == offline.completion[None]


def test_a_bad_adapter_at_startup_fails_naming_it(served, checkpoint, adapters, tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(
            ValueError,
            match=rf"LoRA module 'bad': LoRA adapter '{missing}': no adapter_config.json"):
        build_app(
            served.loop,
            ServeConfig(served_model_names=(BASE, ), lora_modules=(LoRAModule("bad", missing), )))
    with pytest.raises(
            ValueError,
            match=r"LoRA module 'sql': base_model_name 'other' is not a served model name "
            r"\(\['tiny-vl'\]\)"):
        build_app(
            served.loop,
            ServeConfig(served_model_names=(BASE, ),
                        lora_modules=(LoRAModule("sql", adapters["sql"], "other"), )))
    off = EngineLoop(
        LLMEngine(checkpoint, dtype="float32", max_model_len=256, kv_cache_bytes=8 << 20))
    try:
        with pytest.raises(ValueError,
                           match=r"needs an engine with enable_lora=True \(--enable-lora\)"):
            build_app(off, ServeConfig(served_model_names=(BASE, ),
                                       allow_runtime_lora_updating=True))
    finally:
        off.close()
    # `vlinfer serve`: the engine loads, then the adapters are read; the second is refused, by name,
    # in the CLI's flags, and nothing is served (exit code 2).
    argv = [
        "--model", checkpoint, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-size",
        "8M", "--max-lora-rank", "8", "--malloc-arena-max", "0", "--port", "1", "--lora-modules",
        f"sql={adapters['sql']}", f"wide={adapters['wide']}"
    ]
    capsys.readouterr()
    assert serve_main(argv) == 2
    assert "error: LoRA module 'wide': LoRA adapter 'wide': rank 16 is above --max-lora-rank=8" in \
        capsys.readouterr().err
    assert serve_main(["--allow-runtime-lora-updating", "--ray", "--malloc-arena-max", "0"]) == 2
    assert "--allow-runtime-lora-updating is not supported with --ray" in capsys.readouterr().err


def test_lora_modules_take_both_of_vllms_forms():
    assert lora_module("sql=/a/b") == LoRAModule("sql", "/a/b")
    assert lora_module("odd=/a=b") == LoRAModule("odd", "/a=b")
    assert lora_module('{"name": "sql", "path": "/a", "base_model_name": "m"}') == LoRAModule(
        "sql", "/a", "m")
    for bad, words in (("sql", "neither name=path nor JSON"), ("=/a", "neither name=path"),
                       ('{"name": "sql"', "not valid JSON"), ('{"name": "sql"}',
                                                              "an object of strings"),
                       ('{"name": "sql", "path": "/a", "rank": "8"}', "an object of strings")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            lora_module(bad)
    args = build_parser().parse_args(["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                                      "--lora-modules", "c=/z"])
    assert [m.name
            for m in args.lora_modules] == ["a", "b", "c"] and not args.allow_runtime_lora_updating
