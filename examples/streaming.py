"""Stream an answer as it is generated, and stop one early.

    python examples/streaming.py
"""
import sys

from vlinfer import Pipeline

pipe = Pipeline("smollm2", max_model_len=2048)

for delta in pipe.stream("Write one sentence about the sea.", max_tokens=32, temperature=0):
    sys.stdout.write(delta)
    sys.stdout.flush()
print()

# Leaving the loop closes the generator, which aborts the request and frees its KV blocks at once.
text = ""
for delta in pipe.stream("List the days of the week.", max_tokens=64, temperature=0):
    sys.stdout.write(delta)
    sys.stdout.flush()
    text += delta
    if "Wednesday" in text:
        break
print("\n... (stopped early: we had what we needed)")
print("requests still running:", pipe.engine.get_num_unfinished_requests())
