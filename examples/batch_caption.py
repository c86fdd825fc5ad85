"""Caption a folder of images into a JSONL file, the same as the CLI:

    python -m vlinfer caption examples/images --out captions.jsonl --max-pixels 200704 --resume

    python examples/batch_caption.py [OUT.jsonl]      # default: a file in the system temp folder

Each batch is one engine run (continuous batching); finished lines are fsync'ed, so rerunning with
resume=True after an interruption skips what is already recorded. An unreadable image is recorded
with its error.
"""
import json
import os
import sys
import tempfile

from vlinfer import Pipeline
from vlinfer.captioning import caption_files, collect_images

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "images")
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(),
                                                         "vlinfer_example_captions.jsonl")

pipe = Pipeline("qwen3-vl")
paths = collect_images([HERE])  # a folder, a glob, paths, or a .txt list of paths
summary = caption_files(pipe, paths, out, prompt="Describe this image in one sentence.",
                        batch_size=4,
                        sampling_params=pipe.sampling_params(max_tokens=16, temperature=0),
                        max_pixels=256 * 256, overwrite=True)
print(summary.line())
with open(out) as f:
    for line in f:
        record = json.loads(line)
        print(
            f"{os.path.basename(record['path']):18} {record['size']} "
            f"{record['num_image_tokens']:3} image tokens "
            f"-> {record['caption'] or record['error']!r}")

# For a handful of images in memory, pipe.caption returns the captions in order.
captions = pipe.caption(paths[:2], max_tokens=8, temperature=0)
print("pipe.caption:", captions)
if pipe.embedded:
    print(f"\nnote: these captions are by {pipe.engine.source.about}")
