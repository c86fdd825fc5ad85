"""Generated damaged checkpoint files (hypothesis) opened through LLM: a tiny random Qwen3 whose
model.safetensors, and a tiny Llama GGUF (Q8_0 blocks) whose header, are cut short or lie (the
safetensors header length, a tensor's dtype, data offsets or shape, the header's JSON; a GGUF
field's or tensor record's counts, lengths, types, dims or offsets, random bytes of the header).

The property: LLM(...) raises a ValueError naming the file or its folder (loading.CheckpointError:
the parsers' own errors named; a tensor that does not fit its parameter; a dtype the checkpoint
cannot hold), or it opens and answers a request (a GGUF field it reads differently, e.g. a tensor
offset pointing at other data, changes the model in a way no reader can tell). Never another
exception, a crash or a hang. After each batch, the undamaged files still open and give their usual
answer.

The counts of cases per format are printed (pytest -s) and asserted to be at least CASES each."""
import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from text_checkpoints import build_checkpoint, tiny_text_config
from gguf_checkpoints import write_tiny_llama_gguf
from vlinfer import LLM, SamplingParams

CASES = 40
OPTIONS = dict(dtype="float32", kv_cache_bytes=4 * 2 ** 20, max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = [5, 17, 42, 99]

junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=6),
                 st.lists(st.integers(-3, 2**40), max_size=4),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """(safetensors folder, GGUF file, their greedy answers)."""
    folder = tmp_path_factory.mktemp("safetensors")
    build_checkpoint(str(folder), tiny_text_config("qwen3", True))
    gguf_file = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_llama_gguf(gguf_file, "Q8_0")
    return str(folder), gguf_file, {path: answer(path) for path in (str(folder), gguf_file)}


def answer(path: str) -> list[int]:
    llm = LLM(path, **OPTIONS)
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == GREEDY.max_tokens and all(0 <= t < llm.engine.text_config.vocab_size
                                                 for t in out)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return out


class Blob(bytes):
    """A damaged file's bytes, shown by their length when hypothesis reports a failing case."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes>"


@st.composite
def damaged_safetensors(draw, data: bytes, kind: str) -> tuple[str, bytes]:
    n = int.from_bytes(data[:8], "little")
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    if kind == "truncate":
        return kind, Blob(data[:draw(st.integers(0, len(data) - 1))])
    if kind == "length":
        value = draw(st.sampled_from([0, 1, 7, n - 1, n + 1, len(data), 2 ** 63, 2 ** 64 - 1]) |
                     st.integers(0, 2 ** 64 - 1))
        return kind, Blob(value.to_bytes(8, "little") + data[8:])
    if kind == "bytes":
        damaged = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            damaged[draw(st.integers(0, 8 + n - 1))] = draw(st.integers(0, 255))
        return kind, Blob(damaged)
    names = sorted(k for k in header if k != "__metadata__")
    entry = header[draw(st.sampled_from(names))]
    if kind == "dtype":
        entry["dtype"] = draw(
            st.sampled_from([
                "F16", "BF16", "F64", "I32", "I64", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "Q4",
                "", "f32"
            ]) | junk)
    elif kind == "offsets":
        start, end = entry["data_offsets"]
        entry["data_offsets"] = draw(
            st.sampled_from([[end, start], [start, end + 4], [start + 4, end +
                                                              4], [start, len(body) +
                                                                   64], [0, 0]]) |
            st.lists(st.integers(-5, 2 * len(body)), max_size=3) | junk)
    elif kind == "shape":
        entry["shape"] = draw(st.lists(st.integers(-3, 2 ** 40), max_size=4) | junk)
    else:
        header = draw(st.sampled_from([[], "x", None, {}]) | junk) if draw(st.booleans()) else \
            {k: v for k, v in header.items() if k != draw(st.sampled_from(names))}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return kind, Blob(len(text).to_bytes(8, "little") + text + body)


@st.composite
def damaged_gguf(draw, path: str, out: str) -> str:
    """Writes a damaged copy of the GGUF at `path` to `out`; returns what was damaged."""
    import gguf
    shutil.copyfile(path, out)
    kind = draw(st.sampled_from(["truncate", "field", "tensor", "bytes"]))
    size = len(open(path, "rb").read())
    if kind == "truncate":
        with open(out, "r+b") as f:
            f.truncate(draw(st.integers(0, size - 1)))
        return kind
    if kind == "bytes":
        reader = gguf.GGUFReader(path)
        end = int(reader.data_offset)  # the header: everything before the tensor data
        with open(out, "r+b") as f:
            for _ in range(draw(st.integers(1, 8))):
                f.seek(draw(st.integers(0, end - 1)))
                f.write(bytes([draw(st.integers(0, 255))]))
        return kind
    reader = gguf.GGUFReader(out, "r+")
    fields = list(reader.fields.values()) if kind == "field" else [t.field for t in reader.tensors]
    field = fields[draw(st.integers(0, len(fields) - 1))]
    part = field.parts[draw(st.integers(0, len(field.parts) - 1))]
    if np.issubdtype(part.dtype, np.integer):
        info = np.iinfo(part.dtype)
        value = draw(st.sampled_from([0, 1, 2, int(info.max), int(info.max) // 2, 2 ** 31 - 1]) |
                     st.integers(int(info.min), int(info.max)))
        part[draw(st.integers(0, len(part) - 1))] = min(value, int(info.max))
    else:
        part[draw(st.integers(0, len(part) - 1))] = draw(st.floats(allow_nan=True, width=32))
    reader.data.flush()
    del reader
    return f"{kind} {field.name}"


def opens_or_names_the_file(path: str, shown: str, outcomes: dict, kind: str) -> None:
    """`shown`: what the error must name (the damaged file, or the checkpoint folder for a tensor's
    dtype)."""
    try:
        llm = LLM(path, **OPTIONS)
    except (ValueError, FileNotFoundError) as e:
        assert shown in str(e), f"{kind}: the error does not name the file: {e}"
        outcomes["refused"] += 1
        return
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == GREEDY.max_tokens and all(0 <= t < llm.engine.text_config.vocab_size
                                                 for t in out)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    outcomes["opened"] += 1


SAFETENSORS_DAMAGE = ("truncate", "length", "dtype", "offsets", "shape", "json", "bytes")


def run_safetensors(originals, tmp_path, cases: int):
    folder, _, answers = originals
    data = open(f"{folder}/model.safetensors", "rb").read()
    outcomes, kinds = {"refused": 0, "opened": 0}, set()
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)  # (makes tmp_path too)

    # every kind of damage its share of the cases, whatever the draws favour
    per_kind = -(-cases // len(SAFETENSORS_DAMAGE))
    for damage in SAFETENSORS_DAMAGE:

        @settings(max_examples=per_kind, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=damaged_safetensors(data, damage))
        def one(case):
            kind, blob = case
            (damaged / "model.safetensors").write_bytes(blob)
            kinds.add(kind)
            opens_or_names_the_file(str(damaged), str(damaged), outcomes, kind)

        one()
    print(
        f"safetensors: {sum(outcomes.values())} generated cases, {outcomes}, kinds {sorted(kinds)}")
    assert sum(outcomes.values()) >= cases and outcomes["refused"] > 0 and len(kinds) == 7
    assert answer(folder) == answers[folder]


def run_gguf(originals, tmp_path, cases: int):
    _, gguf_file, answers = originals
    outcomes, kinds = {"refused": 0, "opened": 0}, set()
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = str(tmp_path / "damaged.gguf")

    @settings(max_examples=cases, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
        kind = data.draw(damaged_gguf(gguf_file, out))
        kinds.add(kind.split()[0])
        opens_or_names_the_file(out, "damaged.gguf", outcomes, kind)

    one()
    print(f"gguf: {sum(outcomes.values())} generated cases, {outcomes}, kinds {sorted(kinds)}")
    assert sum(outcomes.values()) >= cases and outcomes["refused"] > 0 and len(kinds) == 4
    assert answer(gguf_file) == answers[gguf_file]


@pytest.mark.generated
def test_damaged_safetensors(originals, tmp_path):
    run_safetensors(originals, tmp_path, CASES)


@pytest.mark.generated
def test_damaged_gguf(originals, tmp_path):
    run_gguf(originals, tmp_path, CASES)


# Regressions of cases the generated GGUF headers found: sizes that lie made the loader build (and
# the machine's memory run out on) a model of terabytes, or billions of layers; a tensor that claims
# an integer dtype loaded as garbage. Each is refused, naming the file, before anything is
# allocated.
@pytest.mark.parametrize("key, value, match", [
    ("llama.feed_forward_length", 2 ** 31 - 1, "config describes a model of"),
    ("llama.vocab_size", 2 ** 32 - 1, "config describes a model of"),
    ("llama.context_length", 2 ** 31 - 1, "config describes a model of"),
    ("llama.block_count", 2 ** 32 - 1, "declares 4294967295 blocks"),
])
def test_a_gguf_header_that_lies_about_sizes_is_refused(originals, tmp_path, key, value, match):
    import gguf
    out = str(tmp_path / "lying.gguf")
    shutil.copyfile(originals[1], out)
    reader = gguf.GGUFReader(out, "r+")
    reader.fields[key].parts[-1][0] = value
    reader.data.flush()
    del reader
    with pytest.raises(ValueError, match=match) as e:
        LLM(out, **OPTIONS)
    assert "lying.gguf" in str(e.value)


def test_an_integer_tensor_in_a_float_checkpoint_is_refused(originals, tmp_path):
    folder = tmp_path / "int"
    shutil.copytree(originals[0], folder)
    data = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"]["dtype"] = "I32"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (folder /
     "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    with pytest.raises(ValueError, match="'model.norm.weight' is stored as I32"):
        LLM(str(folder), **OPTIONS)
