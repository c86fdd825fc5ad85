"""README.md's defaults table against the code: each entry point's own defaults (argparse,
signatures, EngineConfig, SamplingParams, the server's request handling, the demo's sliders) are
read and written the way the table writes them, cell by cell, so a default changed in code or in the
README alone fails here."""
import dataclasses
import inspect
import re

from types import SimpleNamespace

import pytest

from vlinfer import LLM, Pipeline, SamplingParams
from vlinfer.cli import build_parser
from vlinfer.cli.shared import sampling_params as cli_sampling_params
from vlinfer.cli.options import ENGINE_DEFAULTS, FLAGS, engine_options
from vlinfer.config import (ACCELERATOR_DEFAULT_MEMORY_UTILIZATION, CPU_DEFAULT_MEMORY_UTILIZATION,
                            DEFAULT_MAX_BATCHED_TOKENS, MIN_BATCHED_TOKENS, MIN_FITTED_MODEL_LEN,
                            EngineConfig, default_batched_tokens)
from vlinfer.cli import serve as serve_cli
from vlinfer.serve.config import ServeConfig
from vlinfer.serve.server import Server
from vlinfer.serve.protocol import ChatCompletionRequest, CompletionRequest
from defaults_cases import ROOT, load_demo

COLUMNS = ("LLM", "Pipeline", "generate", "chat", "caption", "serve", "demo")
ROWS = ("max_model_len", "max_num_batched_tokens", "temperature", "top_p", "max_tokens",
        "max_num_seqs", "memory_utilization")


def readme_section() -> str:
    return (ROOT / "README.md").read_text().split("\n## Defaults\n", 1)[1].split("\n## ", 1)[0]


def readme_table() -> dict[str, dict[str, str]]:
    """setting (the first `name` in its row's first cell) -> entry point -> cell text without
    backticks."""
    text = readme_section()
    first = text[text.index("\n|") + 1:]  # the first table only; the media limits' follows it
    lines = [line for line in first.split("\n\n", 1)[0].splitlines() if line.startswith("|")]

    def cells(line):
        return [c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]

    assert tuple(cells(lines[0])[1:8]) == COLUMNS, cells(lines[0])
    table = {}
    for line in lines[2:]:
        name = re.search(r"`([a-z_]+)`", line.split("|")[1]).group(1)
        table[name] = dict(zip(COLUMNS, cells(line)[1:8]))
    return table


def entry_points() -> dict[str, tuple[dict, dict]]:
    """entry point -> (the engine options it passes to LLM, over EngineConfig's defaults; its
    default sampling, as {field: value} or, for the server, per endpoint)."""
    # LLM and Pipeline add no engine defaults of their own: every option goes through to
    # EngineConfig (Pipeline's own keywords, lora, an adapter for its requests, and task,
    # transformers' task name, are not engine options).
    for init in (LLM.__init__, Pipeline.__init__):
        params = [p for p in inspect.signature(init).parameters.values()
                  if p.name not in ("lora", "task")]
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD and len(
            params) == 3, inspect.signature(init)
    assert ENGINE_DEFAULTS == {f.name: f.default for f in dataclasses.fields(EngineConfig)
                               if f.default is not dataclasses.MISSING}
    points = {"LLM": (ENGINE_DEFAULTS, dataclasses.asdict(SamplingParams())),
              "Pipeline": (ENGINE_DEFAULTS, dataclasses.asdict(Pipeline.sampling_params()))}
    cli = build_parser()
    for command, argv in {"generate": ["generate", "hi"], "chat": ["chat"],
                          "caption": ["caption", "x.png", "--out", "c.jsonl"]}.items():
        args = cli.parse_args(argv)
        points[command] = ({**ENGINE_DEFAULTS,
                            **engine_options(args)}, dataclasses.asdict(cli_sampling_params(args)))
    # The server: what a request that sets nothing gets (Server.sampling_params on a stand-in
    # engine).
    context = 12345
    server = SimpleNamespace(engine=SimpleNamespace(max_model_len=context),
                             config=ServeConfig(served_model_names=("m", )))
    chat = Server.sampling_params(
        server, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), None)
    completion = Server.sampling_params(server, CompletionRequest(prompt="hi"), None)
    assert chat.max_tokens == context  # unset: the room left in the context
    serve = {"chat": dataclasses.asdict(chat), "completions": dataclasses.asdict(completion)}
    points["serve"] = (
        {**ENGINE_DEFAULTS, **engine_options(serve_cli.build_parser().parse_args([]))}, serve)
    demo = load_demo()
    demo_sampling = dataclasses.asdict(Pipeline.sampling_params(**demo.SAMPLING_DEFAULTS))
    points["demo"] = ({**ENGINE_DEFAULTS,
                       **demo.demo_engine_options(demo.parse_args([]))}, demo_sampling)
    return points


def written(setting: str, engine: dict, sampling: dict) -> str:
    """One cell, as the README writes it."""
    if setting == "max_model_len":
        if engine["max_model_len"] is not None:
            return str(engine["max_model_len"])
        cap = engine["max_model_len_cap"]
        return "model's" if cap is None else f"model's, at most {cap}"
    if setting == "max_num_batched_tokens":
        given = engine["max_num_batched_tokens"]
        return str(given) if given is not None else f"min(context, {DEFAULT_MAX_BATCHED_TOKENS})"
    if setting == "max_num_seqs":
        return str(engine["max_num_seqs"])
    if setting == "memory_utilization":
        assert engine["kv_cache_bytes"] is None
        share = engine["memory_utilization"]
        return str(share) if share is not None else \
            f"{CPU_DEFAULT_MEMORY_UTILIZATION} / {ACCELERATOR_DEFAULT_MEMORY_UTILIZATION}"
    if "chat" in sampling:  # the server, per endpoint
        if setting == "max_tokens":
            return f"rest of context (chat), {sampling['completions']['max_tokens']} (completions)"
        assert sampling["chat"][setting] == sampling["completions"][setting]
        sampling = sampling["chat"]
    value = sampling[setting]
    return str(float(value)) if setting in ("temperature", "top_p") else str(value)


def test_the_readme_table_is_every_entry_points_defaults():
    table, points = readme_table(), entry_points()
    assert tuple(table) == ROWS
    expected = {row: {column: written(row, *points[column]) for column in COLUMNS} for row in ROWS}
    assert table == expected


def test_the_rules_under_the_table_are_the_codes():
    text = " ".join(readme_section().split())
    assert (
        f"min(context length, {DEFAULT_MAX_BATCHED_TOKENS}), at least {MIN_BATCHED_TOKENS}") in text
    assert f"down to {MIN_FITTED_MODEL_LEN}" in text
    assert (f"{CPU_DEFAULT_MEMORY_UTILIZATION} of the RAM free after loading (CPU) / "
            f"{ACCELERATOR_DEFAULT_MEMORY_UTILIZATION} of device memory") in text
    assert [default_batched_tokens(n) for n in (262144, 16384, 8192, 3072, 2048, 512)] == \
        [8192, 8192, 8192, 3072, 2048, 2048]


def test_every_app_has_the_flags_the_table_names():
    """The KV budget and memory share the errors mention, and the other engine settings, are flags
    in every app (the demo's max_num_seqs is --concurrency), and the README names each."""
    engine_flags = [flag for name, flag in FLAGS.items() if flag.startswith("--") and
                    name not in ("temperature", "top_p", "max_tokens", "seed")]
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    parsers = {name: sub[name] for name in ("generate", "chat", "caption")}
    parsers.update(serve=serve_cli.build_parser(), demo=load_demo().build_parser())
    for name, parser in parsers.items():
        have = {s for action in parser._actions for s in action.option_strings}
        wanted = [("--concurrency" if name == "demo" and f == "--max-num-seqs" else f)
                  for f in engine_flags]
        assert [f for f in wanted if f not in have] == [], name
        if name == "demo":
            assert "--max-num-seqs" not in have  # one knob, not two
    text = readme_section()
    assert [f for f in engine_flags + ["--concurrency"] if f"`{f}`" not in text] == []


# A value other than the default for each engine option, as a flag's argv and the keyword it must
# become.
FLAG_VALUES = {
    "device": (["cpu"], "cpu"),
    "dtype": (["float32"], "float32"),
    "max_model_len": (["4096"], 4096),
    "max_num_seqs": (["3"], 3),
    "max_num_batched_tokens": (["3000"], 3000),
    "kvcache_block_size": (["32"], 32),
    "memory_utilization": (["0.3"], 0.3),
    "kv_cache_bytes": (["2M"], 2 << 20),
    "enable_prefix_caching": ([], False),
    "ops": (["reference"], "reference"),
    "enforce_eager": ([], True),
    "tensor_parallel_size": (["2"], 2),
    "enable_expert_parallel": ([], True),
    "distributed_init_method": (["tcp://127.0.0.1:29500"], "tcp://127.0.0.1:29500"),
    "distributed_timeout_s": (["5"], 5.0),
    "distributed_startup_timeout_s": (["50"], 50.0),
    "seed": (["7"], 7),
    "quantization": (["int8"], "int8"),
    "allow_image_urls": ([], True),
    "logprobs_mode": (["raw_logprobs"], "raw_logprobs"),
    "kv_cache_dtype": (["int8"], "int8"),
    "mamba_ssm_cache_dtype": (["bfloat16"], "bfloat16"),
    "language_model_only": ([], True),
    "enable_lora": ([], True),
    "max_loras": (["3"], 3),
    "max_lora_rank": (["64"], 64),
    "max_cpu_loras": (["4"], 4),
    "runner": (["pooling"], "pooling"),
    "hf_overrides": (['{"classifier_from_token": ["no", "yes"]}'],
                     {"classifier_from_token": ["no", "yes"]}),
    "speculative_config": (['{"method": "ngram", "num_speculative_tokens": 3}'],
                           {"method": "ngram", "num_speculative_tokens": 3}),
    "reasoning_parser": (["qwen3"], "qwen3"),
}


def test_every_engine_option_is_one_flag_on_every_surface():
    """Each EngineConfig field (but the model, a positional or --model, and the apps' own context
    cap) is one flag of vLLM's spelling, the same in the CLI's generate, chat and caption, the
    server and the demo, and reaches LLM(...) as that keyword with the value given."""
    fields = [
        f.name for f in dataclasses.fields(EngineConfig)
        if f.name not in ("model", "max_model_len_cap")
    ]
    assert sorted(FLAG_VALUES) == sorted(fields)
    assert [name for name in fields if name not in FLAGS] == []
    demo = load_demo()
    surfaces = {
        "generate": (
            lambda argv: engine_options(build_parser().parse_args(["generate", "hi", *argv]))),
        "chat": (lambda argv: engine_options(build_parser().parse_args(["chat", *argv]))),
        "caption": (lambda argv: engine_options(build_parser().parse_args(
            ["caption", "x", "--out", "o", *argv]))),
        "serve": (lambda argv: engine_options(serve_cli.build_parser().parse_args(argv))),
        "demo": (lambda argv: demo.demo_engine_options(demo.parse_args(argv)))
    }
    for surface, options_of in surfaces.items():
        for name, (values, expected) in FLAG_VALUES.items():
            flag = FLAGS[name]
            if name == "enable_prefix_caching":
                flag = "--no-enable-prefix-caching"
            if surface == "demo" and name == "max_num_seqs":
                flag = "--concurrency"
            options = options_of([flag, *values])
            assert options[name] == expected, (surface, flag, options[name])


def test_a_given_long_context_still_prefills_in_bounded_steps(tiny_vl_with_context):
    """max_model_len given (not fitted) on a 262144-position model: the step budget is min(context,
    8192), not the whole context."""
    bytes_per_token = 2 * 2 * 32 * 2 * 4  # the tiny Qwen3-VL's float32 KV
    llm = LLM(tiny_vl_with_context(262144), dtype="float32", device="cpu", max_model_len=16384,
              kv_cache_bytes=16384 * bytes_per_token)
    assert llm.engine.max_model_len == 16384
    assert llm.engine.scheduler.max_num_batched_tokens == DEFAULT_MAX_BATCHED_TOKENS


@pytest.mark.parametrize("command", ["generate", "chat", "caption"])
def test_verbose_before_or_after_the_subcommand(command):
    rest = {"generate": ["hi"], "chat": [], "caption": ["x.png", "--out", "c.jsonl"]}[command]
    parser = build_parser()
    assert parser.parse_args(["-v", command, *rest]).verbose is True
    assert parser.parse_args([command, *rest, "-v"]).verbose is True
    assert parser.parse_args([command, *rest]).verbose is False


def test_readme_media_limits_are_the_code_table():
    """README.md's media-limits rows, cell by cell, against vlinfer/inputs/limits.py's TABLE, and
    the values the table writes against the limits themselves."""
    from vlinfer.inputs import limits
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in readme_section().splitlines() if line.startswith("| `") and
            line.split("|")[1].strip().strip("`") in {n
                                                      for n, _, _ in limits.TABLE}]
    assert [(name.strip("`"), value, what) for name, value, what in rows] == list(limits.TABLE)
    values = {name: value for name, value, _ in limits.TABLE}
    assert int(values["max_images"]) == limits.MAX_IMAGES
    assert 2 ** int(values["max_image_pixels"].removeprefix("2^")) == limits.MAX_IMAGE_PIXELS
    assert values["mm_processor_kwargs"].split(", ") == list(limits.MM_PROCESSOR_KWARGS)
    assert serve_cli.build_parser().parse_args([]).max_images_per_request == limits.MAX_IMAGES
    assert serve_cli.build_parser().parse_args([]).max_image_pixels == limits.MAX_IMAGE_PIXELS
