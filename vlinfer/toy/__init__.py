"""The embedded toy world that runs offline: drawn scenes (scenes.py), the small Qwen3-VL trained on
them and shipped compact in the package (embedded.py, data/), and tiny random Qwen3-VL checkpoints
(tiny_checkpoints.py)."""
