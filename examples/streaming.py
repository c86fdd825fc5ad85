"""Stream an answer as it is generated, and stop one early.

    python examples/streaming.py
"""
import sys

from vlinfer import Pipeline

pipe = Pipeline("smollm2", max_model_len=2048)

for delta in pipe.stream("Write two sentences about the sea.", max_tokens=48, temperature=0):
    sys.stdout.write(delta)
    sys.stdout.flush()
print()

# Leaving the loop closes the generator, which aborts the request and frees its KV blocks at once.
words = 0
for delta in pipe.stream("Count from one to twenty in words.", max_tokens=64, temperature=0):
    sys.stdout.write(delta)
    words += delta.count(" ")
    if words >= 5:
        break
print(" ... (stopped early)")
print("requests still running:", pipe.engine.get_num_unfinished_requests())
