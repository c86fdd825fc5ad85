"""A multi-turn chat about two images, given as a file path and as a base64 data URI (what an
OpenAI-style client sends).

    python examples/chat_with_images.py

Without the real Qwen3-VL weights in the Hugging Face cache this runs the embedded toy model,
trained only on drawn scenes of coloured shapes (as these example images are): the conversation
mechanics are real, and so are its answers about such scenes; it knows nothing else.
"""
import base64
import os

from vlinfer import Pipeline

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "images")
with open(os.path.join(HERE, "cat_face.png"), "rb") as f:
    cat_uri = "data:image/png;base64," + base64.b64encode(f.read()).decode()

pipe = Pipeline("qwen3-vl", max_model_len=4096)
messages = [{"role": "user", "content": [
    {"type": "image", "image": os.path.join(HERE, "traffic_light.png")},
    {"type": "image_url", "image_url": {"url": cat_uri}},
    {"type": "text", "text": "What is in the first picture, and what is in the second?"}]}]
answer = pipe.chat(messages, max_tokens=24, temperature=0)
print(f"user: {messages[0]['content'][-1]['text']}\nassistant: {answer!r}")

messages += [{"role": "assistant", "content": answer},
             {"role": "user", "content": "Which of the two is an animal?"}]
answer = pipe.chat(messages, max_tokens=16, temperature=0)
print(f"user: {messages[-1]['content']}\nassistant: {answer!r}")

# The engine reports what each image became: its resized size and its number of tokens.
out = pipe.llm.chat(messages, pipe.sampling_params(max_tokens=1, temperature=0), use_tqdm=False,
                    mm_processor_kwargs={"max_pixels": 128 * 128})[0]
print("images as the model saw them (max_pixels=128*128):", out.images)
if pipe.embedded:
    print(f"\nnote: the answers above are by {pipe.engine.source.about}")
