"""vlinfer/loading/checkpoint.py: a parser's error names the file; a missing package is named as
such, not blamed on the file."""
import pytest

from vlinfer.loading import checkpoint


def test_a_damaged_file_is_named_as_damaged():
    with pytest.raises(checkpoint.CheckpointError, match="x.safetensors: not a readable"):
        with checkpoint.reading("x.safetensors"):
            raise OSError("header too large")


def test_a_missing_package_is_named_with_its_extra_not_blamed_on_the_file():
    """transformers' GGUF reader without gguf installed (a wheel installed without [gguf])."""
    message = "Please install torch and gguf>=0.10.0 to load a GGUF checkpoint in PyTorch."
    with pytest.raises(ImportError) as raised:
        with checkpoint.reading("/m/SmolLM2.Q4_1.gguf"):
            raise ImportError(message)
    text = str(raised.value)
    assert text.startswith("/m/SmolLM2.Q4_1.gguf: reading it needs a package that is not installed")
    assert message in text and "pip install 'vlinfer[gguf]'" in text
    assert "damaged" not in text and not isinstance(raised.value, checkpoint.CheckpointError)
