"""A multi-turn chat about pictures given as a file path and as a base64 data URI (what an
OpenAI-style client sends).

    python examples/chat_with_images.py

Without the real Qwen3-VL weights in the Hugging Face cache this runs the embedded toy model,
trained only on drawn scenes of coloured shapes (as these example images are), one picture per
conversation: so each conversation here has one picture, and asks what the toy's world can answer
(colours, shapes, counts, the background). Its answers about such scenes are real; it knows nothing
else.
"""
import base64
import os

from vlinfer import Pipeline

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "images")
with open(os.path.join(HERE, "sunset.png"), "rb") as f:
    sunset_uri = "data:image/png;base64," + base64.b64encode(f.read()).decode()

pipe = Pipeline("qwen3-vl", max_model_len=4096)


def turn(messages: list, question: str) -> None:
    """Ask, print, and keep the answer in the conversation."""
    if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
        messages[-1]["content"].append({"type": "text", "text": question})
    else:
        messages.append({"role": "user", "content": question})
    answer = pipe.chat(messages, temperature=0)
    messages.append({"role": "assistant", "content": answer})
    print(f"user: {question}\nassistant: {answer!r}")


# A picture by path, then follow-up questions about it in the same conversation.
house = [{"role": "user", "content": [{"type": "image",
                                       "image": os.path.join(HERE, "red_house.png")}]}]
for question in ("What colour is the house?", "How many circles are there?",
                 "What colour is the background?"):
    turn(house, question)

# A picture as a data URI, as an OpenAI client sends it.
sunset = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": sunset_uri}}]}]
for question in ("Describe this image.", "How many triangles are there?"):
    turn(sunset, question)

# The engine reports what each image became: its resized size and its number of tokens.
out = pipe.llm.chat(house, pipe.sampling_params(max_tokens=1, temperature=0), use_tqdm=False,
                    mm_processor_kwargs={"max_pixels": 128 * 128})[0]
print("the picture as the model saw it (max_pixels=128*128):", out.images)
if pipe.embedded:
    print(f"\nnote: the answers above are by {pipe.engine.source.about}")
