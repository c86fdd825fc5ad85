"""What a tensor-parallel engine checks before it spawns a worker: that the model's heads split over
the ranks (from config.json), and that the main script has a `__main__` guard for the spawned
workers to import it again. No worker process starts in these tests."""
import os
import subprocess
import sys
import textwrap

import pytest

from dependencies import REPO

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM
from vlinfer.distributed import TPDriver


@pytest.fixture(scope="module")
def four_heads(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("four-heads"))
    build_checkpoint(path, tiny_text_config("qwen3", True, 2))
    return path


def test_heads_that_do_not_divide_fail_from_config_before_spawning(four_heads, monkeypatch):
    spawned = []
    monkeypatch.setattr(TPDriver, "_spawn", lambda self: spawned.append(self))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not fit this model: "
                       "num_attention_heads=4 is not divisible by it"):
        LLM(four_heads, tensor_parallel_size=3, dtype="float32")
    assert not spawned


def test_speculation_on_a_hybrid_model_across_ranks_is_refused_before_spawning(tmp_path,
                                                                               monkeypatch):
    """The state put back after a rejected proposal lives on rank 0's slots only."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from qwen3_5_text_cases import save, text_config
    with torch.random.fork_rng(devices=[]):
        save(Qwen3_5ForCausalLM(text_config()).eval(), str(tmp_path))
    spawned = []
    monkeypatch.setattr(TPDriver, "_spawn", lambda self: spawned.append(self))
    with pytest.raises(ValueError, match="speculative decoding on a hybrid model runs on one rank"):
        LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not spawned


SCRIPT = """\
import sys
from vlinfer.distributed.main_guard import unguarded_main_line
print("top:", unguarded_main_line())
if __name__ == "__main__":
    print("guarded:", unguarded_main_line())
from vlinfer import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32")
"""


def test_a_script_without_main_guard_is_told_in_one_line(four_heads, tmp_path):
    """multiprocessing's own error would come from each spawned worker ("bootstrapping phase"),
    after the start-up; here the parent says which line needs the guard, and spawns nothing."""
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run = subprocess.run([sys.executable, str(script), four_heads], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 1, run.stderr
    assert f"top: {script}:3\nguarded: None\n" in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: {script}:7: tensor_parallel_size > 1 spawns worker "), \
        run.stderr
    assert 'if __name__ == "__main__":' in last
    assert "bootstrapping" not in run.stderr and "tp-worker" not in run.stderr
