"""Structured outputs (SamplingParams.structured_outputs, backed by llguidance): on the real SmolLM2
GGUF and on the tiny random Qwen3-VL (images and text), every constrained output parses and
validates (jsonschema for schemas, re.fullmatch for regexes and grammars, membership for choices),
greedy and sampled, n > 1, while unconstrained requests in the same batch produce exactly the tokens
they produce without the constrained ones. The tiny engine runs with a KV pool for a few sequences
and a 32-token step budget, so its batches preempt and chunk their prefills: constrained greedy
outputs there equal those of the same requests run alone. Also: truncation says
finish_reason="length", streaming deltas rebuild the text, stop strings cut it, the bad-input
errors, and the caption CLI with --json-schema over examples/images.

For the random-weight model every schema here describes a finite language (bounded strings,
integers, arrays, no additional properties, no free whitespace), so a constrained output always ends
within max_tokens."""
import json
import os
import re

import jsonschema
import pytest
import torch

from dependencies import REPO

from engine_checks import assert_block_pool_empty
from vlinfer import LLM, SamplingParams, StructuredOutputsParams

IMAGES = os.path.join(REPO, "examples", "images")
TINY_PIXELS = {"max_pixels": 64 * 64, "min_pixels": 64 * 64}

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ORDER = {
    "type": "object", "additionalProperties": False, "required": ["order", "status"],
    "properties": {
        "order": {
            "type": "object", "additionalProperties": False, "required": ["id", "items"],
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "items": {
                    "type": "array", "minItems": 1, "maxItems": 2, "items": {
                        "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                        "properties": {
                            "sku": {"enum": ["apple", "pear", "plum"]},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9}
                        }
                    }
                }
            }
        }, "status": {"enum": ["open", "paid", "shipped"]}
    }
}
LABEL = {
    "type": "object", "additionalProperties": False, "required": ["label", "score", "tags"],
    "properties": {
        "label": {"enum": ["cat", "dog", "house", "sun"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 5}, "tags": {
            "type": "array", "maxItems": 2,
            "items": {"type": "string", "maxLength": 6, "pattern": "^[a-z]*$"}
        }
    }
}
SCHEMAS = [PERSON, ORDER, LABEL]
# SmolLM2 is a trained model: it also gets unbounded numbers (bounded in value) and free whitespace.
PRODUCT = {
    "type": "object", "additionalProperties": False, "required": ["name", "price", "in_stock"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "price": {"type": "number", "minimum": 0, "maximum": 1000}, "in_stock": {"type": "boolean"}
    }
}
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!?", r"[A-Z][a-z]{2,6} [0-9]{1,2}"]
CHOICES = ["red", "green", "blue"]
GRAMMARS = [('root ::= "The answer is " [0-9] [0-9]? "."', r"The answer is [0-9][0-9]?\."),  # GBNF
            ('start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/', r"x=[1-9][0-9]?;")]  # Lark


def check(constraint: StructuredOutputsParams, text: str) -> None:
    if constraint.kind == "json":
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.regex, text), (constraint.regex, text)
    elif constraint.kind == "choice":
        assert text in constraint.choice, text
    else:
        pattern = dict(GRAMMARS)[constraint.grammar]
        assert re.fullmatch(pattern, text), (pattern, text)


def constraints(trained: bool) -> list[StructuredOutputsParams]:
    out = [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in SCHEMAS]
    out += [StructuredOutputsParams(regex=r) for r in REGEXES]
    out += [StructuredOutputsParams(choice=CHOICES)
            ] + [StructuredOutputsParams(grammar=g) for g, _ in GRAMMARS]
    if trained:
        out += [StructuredOutputsParams(json=json.dumps(PRODUCT))]
    return out


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2", dtype="float32", kv_cache_bytes=256 * 2 ** 20, max_model_len=2048)


@pytest.fixture(scope="module")
def tiny_vl():
    """The embedded random Qwen3-VL with a tight KV pool (10 blocks of 16 tokens, ~3 of these
    sequences) and a 32-token step budget: the batches below preempt and chunk their prefills."""
    probe = LLM("qwen3-vl-tiny", max_model_len=160, kv_cache_bytes=2 ** 20)
    per_block = probe.engine.model_runner.cache_pool.bytes_per_block
    probe.close()
    return LLM("qwen3-vl-tiny", max_model_len=160, kv_cache_bytes=10 * per_block,
               max_num_batched_tokens=32)


def smollm2_prompts(constraint):
    what = {"json": "Describe it as JSON.", "json_object": "Describe a product as a JSON object.",
            "regex": "Answer briefly.", "choice": "Pick a colour.", "grammar": "What is 6 times 7?"}
    return [{"role": "user", "content": what[constraint.kind]}]


def tiny_prompts(i: int):
    if i % 3 == 0:  # every third with an image: constraints are blind to the prompt's modality
        image = os.path.join(IMAGES,
                             sorted(f for f in os.listdir(IMAGES) if f.endswith(".png"))[i % 5])
        return [{
            "role": "user", "content": [{"type": "image", "image": image},
                                        {"type": "text", "text": "JSON?"}]
        }]
    return [{"role": "user", "content": f"Request {i}: answer as asked."}]


UNCONSTRAINED = [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=1.0, seed=7, max_tokens=10)
]


# slow: real model
@pytest.mark.parametrize("model", [pytest.param("smollm2", marks=pytest.mark.slow), "tiny_vl"])
def test_every_constrained_output_validates_and_neighbours_are_unchanged(model, request):
    llm = request.getfixturevalue(model)
    trained = model == "smollm2"
    mm_kwargs = None if trained else TINY_PIXELS
    max_tokens = 200 if trained else 110
    plain_chats = [[{"role": "user", "content": "Tell me about the sea."}],
                   [{"role": "user", "content": "Hello!"}]]
    alone = llm.chat(plain_chats, UNCONSTRAINED, use_tqdm=False, mm_processor_kwargs=mm_kwargs)
    chats, params = [], []
    for c in constraints(trained):
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=len(params))):
            chats.append(smollm2_prompts(c) if trained else tiny_prompts(len(chats)))
            params.append(SamplingParams(max_tokens=max_tokens, structured_outputs=c, **sampling))
    # n > 1: each completion walks the grammar with its own matcher.
    params[-1] = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=max_tokens,
                                structured_outputs=params[-1].structured_outputs)
    # The unconstrained ones in the middle of the batch, scheduled beside the constrained ones.
    chats[2:2], params[2:2] = plain_chats, UNCONSTRAINED
    outs = llm.chat(chats, params, use_tqdm=False, mm_processor_kwargs=mm_kwargs)
    assert [o.outputs[0].token_ids for o in outs[2:4]] == [o.outputs[0].token_ids for o in alone]
    checked = 0
    for out, p in zip(outs, params):
        if p.structured_outputs is None:
            continue
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (completion.text, p.structured_outputs)
            check(p.structured_outputs, completion.text)
            checked += 1
    assert checked == 2 * len(constraints(trained)) + 1
    if not trained:
        # the tight pool preempted constrained sequences
        assert llm.engine.scheduler.num_preemptions > 0
    assert_block_pool_empty(llm)


def test_preemption_and_chunked_prefill_keep_constrained_outputs_exact(tiny_vl):
    """The same greedy constrained requests, all at once (preempted, chunked) and one at a time
    (neither)."""
    schemas = constraints(False)[:len(SCHEMAS)]  # the longest outputs: enough to run the pool dry
    chats = [tiny_prompts(i) for i in range(8)]
    params = [
        SamplingParams(temperature=0, max_tokens=110, structured_outputs=schemas[i % len(schemas)])
        for i in range(8)
    ]
    before = tiny_vl.engine.scheduler.num_preemptions
    together = tiny_vl.chat(chats, params, use_tqdm=False, mm_processor_kwargs=TINY_PIXELS)
    assert tiny_vl.engine.scheduler.num_preemptions > before, [
        len(o.prompt_token_ids + o.outputs[0].token_ids) for o in together
    ]
    for chat, p, out in zip(chats, params, together):
        alone = tiny_vl.chat([chat], p, use_tqdm=False, mm_processor_kwargs=TINY_PIXELS)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        check(p.structured_outputs, out.outputs[0].text)
    # The prefix cache served the repeated prompts; the outputs above are unchanged by it.
    assert_block_pool_empty(tiny_vl)


def test_truncation_streaming_and_stop_strings(tiny_vl):
    engine = tiny_vl.engine
    order = StructuredOutputsParams(json=ORDER, disable_any_whitespace=True)
    cut = tiny_vl.generate("Order:",
                           SamplingParams(temperature=0, max_tokens=6, structured_outputs=order),
                           use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    request_id = engine.add_request(
        "Order:", SamplingParams(temperature=0, max_tokens=110, structured_outputs=order))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            pieces.append(out.outputs[0].delta_text)
            final = out
    assert final.outputs[0].finish_reason == "stop" and "".join(pieces) == final.outputs[0].text
    jsonschema.validate(json.loads(final.outputs[0].text), ORDER)
    stopped = tiny_vl.generate(
        "Order:",
        SamplingParams(temperature=0, max_tokens=110, structured_outputs=order, stop=['"items"']),
        use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"items"'
    assert final.outputs[0].text.startswith(stopped.text) and '"items"' not in stopped.text
    assert_block_pool_empty(tiny_vl)


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of json, regex, choice, grammar, json_object; got none"),
    (dict(regex="a+", choice=["a"]), "got regex and choice"),
    (dict(json={"type": "object"}, json_object=True), "got json and json_object"),
    (dict(json="{not json"), "StructuredOutputsParams.json is not valid JSON"),
    (dict(json={"type": "objekt"}), "not a valid JSON schema at type"),
    (dict(json={"type": "object", "required": "name"}), "not a valid JSON schema at required"),
    (dict(json={"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
    (dict(json={"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
     "Unimplemented keys"),
    (dict(regex="(ab"), "StructuredOutputsParams.regex is invalid or not supported"),
    (dict(regex="(?=a)b"), "look-around"),
    (dict(grammar='root ::= "a" (('),
     "StructuredOutputsParams.grammar is invalid or not supported"),
    (dict(choice=[]), "choice must be a non-empty list of strings"),
    (dict(choice=["a", 3]), "choice must hold non-empty strings only"),
    (dict(json=True), "must be a JSON schema object"),
])
def test_bad_constraints_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kwargs)
    assert message in str(e.value)
    with pytest.raises(ValueError) as e:  # the dict form (vLLM's server field) says the same
        SamplingParams(structured_outputs=kwargs)
    assert message in str(e.value)


def test_bad_constraint_fields_and_types():
    with pytest.raises(ValueError, match=r"has no field\(s\) \['choise'\]"):
        SamplingParams(structured_outputs={"choise": ["a"]})
    with pytest.raises(ValueError, match="must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    p = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert p.structured_outputs.kind == "json" and p.structured_outputs.json == {"type": "object"}


def test_compiled_once_per_distinct_constraint(tiny_vl):
    grammars = tiny_vl.engine.grammar_matchers
    c = StructuredOutputsParams(regex=r"[a-c]{2}")
    tiny_vl.generate(["a", "b", "c"],
                     SamplingParams(temperature=0, max_tokens=8, structured_outputs=c, n=2),
                     use_tqdm=False)
    compiled = grammars.compile(c)
    # an equal constraint: cached
    assert grammars.compile(StructuredOutputsParams(regex=r"[a-c]{2}")) is compiled
    assert c.key in grammars.compile_seconds


def test_mask_thread_gives_the_masks_of_the_loop_thread(tiny_vl):
    """start_bitmask (the mask thread an accelerator's step overlaps with its forward) fills what
    fill_bitmask fills, for matchers at different points of their grammars."""
    grammars = tiny_vl.engine.grammar_matchers
    matchers = [grammars.new_matcher(StructuredOutputsParams(choice=["yes", "no"])),
                grammars.new_matcher(StructuredOutputsParams(regex=r"[a-c]{2}"))]
    token = tiny_vl.engine.tokenizer.encode("a", add_special_tokens=False)[0]
    assert matchers[1].consume_token(token)
    expected = grammars.fill_bitmask(matchers)
    assert torch.equal(grammars.start_bitmask(matchers).result(), expected)
    assert not torch.equal(expected[0], expected[1])


def test_caption_cli_with_a_json_schema(tmp_path):
    from vlinfer.cli import main
    schema_file = tmp_path / "schema.json"
    # llguidance's own schema key: no free whitespace (the random-weight model would pad with it).
    schema_file.write_text(json.dumps({**LABEL, "x-guidance": {"whitespace_flexible": False}}))
    out = tmp_path / "captions.jsonl"
    rc = main([
        "caption", IMAGES, "--json-schema",
        str(schema_file), "--out",
        str(out), "--model", "qwen3-vl-tiny", "--max-pixels",
        str(64 * 64), "--max-tokens", "120", "--max-model-len", "512", "--no-progress"
    ])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len([f for f in os.listdir(IMAGES) if f.endswith(".png")])
    for record in records:
        assert record["error"] is None, record
        jsonschema.validate(record["caption"], LABEL)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "array", "uniqueItems": true}')
    assert main(["caption", IMAGES, "--json-schema",
                 str(bad), "--out",
                 str(tmp_path / "x.jsonl")]) == 2


def test_token_bitmask_unpacks_and_masks_only_its_rows():
    """The bit layout (bit t % 32 of word t // 32, bit 31 the sign bit) against a per-token loop;
    logits wider than the mask's vocabulary get -inf past it; unconstrained rows are untouched."""
    import torch
    from vlinfer.ops.reference.bitmask import apply_token_bitmask, unpack_bitmask
    vocab = 100
    allowed = torch.rand(3, vocab, generator=torch.Generator().manual_seed(0)) < 0.3
    allowed[:, 31] = allowed[:, 63] = True  # the sign bit of two words
    words = [[
        sum(1 << b for b in range(32) if w * 32 + b < vocab and allowed[r, w * 32 + b])
        for w in range(4)
    ] for r in range(3)]
    bitmask = torch.tensor([[w - 2**32 if w >= 2**31 else w for w in row] for row in words],
                           dtype=torch.int32)
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)
    wider = unpack_bitmask(bitmask, 130)
    assert torch.equal(wider[:, :vocab], allowed) and not wider[:, vocab:].any()
    logits = torch.zeros(4, vocab)
    apply_token_bitmask(logits, [0, 2, 3], bitmask)
    assert torch.equal(torch.isinf(logits[[0, 2, 3]]),
                       ~allowed) and not torch.isinf(logits[1]).any()
    every_row = torch.zeros(3, vocab)
    apply_token_bitmask(every_row, [0, 1, 2], bitmask)
    assert torch.equal(torch.isinf(every_row), ~allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_bitmask_kernel_equals_the_reference(dtype):
    """The CPU op table's kernel (vlinfer/ops/cpu/csrc/paged_ops.cpp) against
    ops/reference/bitmask.py: random masks with all-ones and all-zeros words, a vocabulary that is
    not a multiple of 32, logits wider than the mask, only some rows constrained and out of
    order."""
    from vlinfer.ops.cpu import CpuOps
    from vlinfer.ops.reference.bitmask import apply_token_bitmask
    ops = CpuOps()
    g = torch.Generator().manual_seed(0)
    # the last: 130 logits, a 128-token mask
    for vocab, words in ((100, 4), (49157, 1537), (130, 4)):
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, words), dtype=torch.int32, generator=g)
        bitmask[0, 1] = -1  # every token of a word allowed
        bitmask[1, 2] = 0  # none
        # none, in the last word (short of 32 tokens when the vocabulary is not a multiple)
        bitmask[2, -1] = 0
        logits = torch.randn(5, vocab, generator=g).to(dtype)
        ours, ref = logits.clone(), logits.clone()
        ops.apply_token_bitmask(ours, [4, 0, 2], bitmask)
        apply_token_bitmask(ref, [4, 0, 2], bitmask)
        assert torch.equal(ours, ref), vocab
        assert torch.isinf(ours[[0, 2, 4]]).any() and not torch.isinf(ours[[1, 3]]).any()


def test_strict_closes_every_open_object_schema():
    """OpenAI's strict: additionalProperties false on each object schema that leaves it open, nested
    ones too; one that sets it keeps its own; the caller's schema is not changed."""
    from vlinfer.structured.strict_schema import strict_schema
    schema = {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string"}}},
        "tags": {"type": "array", "items": {"properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
        "either": {"anyOf": [{"type": "object"}, {"type": "string"}]}},
        "$defs": {"d": {"type": ["object", "null"]}}}
    strict = strict_schema(schema)
    assert "additionalProperties" not in schema  # a copy
    assert strict["additionalProperties"] is False
    props = strict["properties"]
    assert props["person"]["additionalProperties"] is False and props["tags"]["items"][
        "additionalProperties"] is False
    assert props["extra"]["additionalProperties"] == {"type": "integer"}
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and \
        "additionalProperties" not in props["either"]["anyOf"][1]
    assert strict["$defs"]["d"]["additionalProperties"] is False


def test_open_integers_are_bounded_and_json_has_no_free_whitespace():
    """A schema's `maximum` alone left every negative integer open, so a model could write digits
    until max_tokens (the newcomer's 8,139-digit population); open sides are now bounded to
    +-(2**53 - 1), and JSON has no free whitespace by default on every surface (both fail today)."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer
    from dependencies import qwen_tokenizer_dir
    from vlinfer.structured.json_bounds import JSON_SAFE_INTEGER
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    schema = {"type": "object", "required": ["population", "area"],
              "properties": {"population": {"type": "integer", "maximum": 100000000},
                             "area": {"type": ["integer", "null"]}}}
    params = StructuredOutputsParams(json=schema)
    assert params.disable_any_whitespace and params.json == schema  # the user's schema kept

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, params.grammar_text)
        return matcher.consume_tokens(tokenizer(text, add_special_tokens=False).input_ids) and \
            not matcher.is_error()

    assert accepts('{"population":-' + str(JSON_SAFE_INTEGER) + ',"area":' +
                   str(JSON_SAFE_INTEGER) + '}')
    assert not accepts('{"population":-' + "9" * 17)
    assert not accepts('{"population":100000001')  # the schema's own bound still binds
    assert not accepts('{"population":1,"area":-' + "9" * 17)
    assert accepts('{"population":1,"area":null}')
    assert not accepts('{ "population"')  # no free whitespace


def test_caption_json_schema_has_the_servers_whitespace_flag_and_default(monkeypatch):
    """caption --json-schema: no free whitespace by default (a small model pads JSON with tabs until
    max_tokens otherwise), and the server's flag, one definition, turns it back on; the value
    reaches the StructuredOutputsParams every caption runs under."""
    from types import SimpleNamespace

    from vlinfer.captioning import captioner
    from vlinfer.cli import build_parser
    from vlinfer.cli.serve import build_parser as serve_parser
    flag = "--structured-outputs-disable-any-whitespace"
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["caption"]
    ours, theirs = (next(a for a in p._actions if flag in a.option_strings)
                    for p in (sub, serve_parser()))
    assert (ours.default, ours.help, ours.option_strings) == \
        (theirs.default, theirs.help, theirs.option_strings)
    assert ours.default is True is StructuredOutputsParams.disable_any_whitespace
    base = ["caption", IMAGES, "--out", "x.jsonl", "--json-schema", "s.json"]
    assert build_parser().parse_args(base).structured_outputs_disable_any_whitespace is True
    off = build_parser().parse_args(base + ["--no-" + flag[2:]])
    assert off.structured_outputs_disable_any_whitespace is False

    class Made(Exception):
        pass

    def spy(**kwargs):
        raise Made(kwargs)

    monkeypatch.setattr(captioner, "StructuredOutputsParams", spy)
    fake = SimpleNamespace(engine=SimpleNamespace(is_multimodal=True))
    for given, expected in (({}, True), ({"disable_any_whitespace": False}, False)):
        with pytest.raises(Made) as made:
            captioner.caption_files(fake, [], "x.jsonl", json_schema=LABEL, **given)
        assert made.value.args[0]["disable_any_whitespace"] is expected
