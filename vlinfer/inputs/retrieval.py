"""The Qwen3-VL-Embedding and Qwen3-VL-Reranker input formats, as their code
(QwenLM/Qwen3-VL-Embedding, src/models/qwen3_vl_embedding.py and qwen3_vl_reranker.py) builds them:
conversations the model's chat template renders with the generation prompt. docs/retrieval.md lists
the facts and their sources.

An item (a query or a document) is a string (text) or a dict with any of "text", "image", "video"
(each one value or a list): a mixture is one item. Its parts go in the Qwen code's order: videos,
then images, then texts."""

EMBED_INSTRUCTION = "Represent the user's input."
RERANK_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
RERANK_SYSTEM = (
    'Judge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. '
    'Note that the answer can only be "yes" or "no".')
ITEM_KEYS = ("text", "image", "video")
# The Qwen code's media settings (its MIN_PIXELS / MAX_PIXELS: 4 to 1800 tokens an image; FPS,
# MAX_FRAMES), as mm_processor_kwargs: Pipeline.embed / rerank and LLM.score pass them, so media are
# sized as the models saw them.
IMAGE_OPTIONS = {"min_pixels": 4 * 32 * 32, "max_pixels": 1800 * 32 * 32}
VIDEO_OPTIONS = {"fps": 1.0, "max_frames": 64}


def _listed(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def item_parts(item) -> list[dict]:
    """An item's content parts (videos, images, texts); "NULL" for an empty item, as the Qwen code
    does."""
    if isinstance(item, str):
        item = {"text": item}
    if not isinstance(item, dict):
        raise ValueError(
            f"a retrieval item is a string or a dict with 'text', 'image', 'video', got "
            f"{type(item).__name__}")
    unknown = set(item) - set(ITEM_KEYS)
    if unknown:
        raise ValueError(
            f"unknown retrieval item keys {sorted(unknown)}; expected {list(ITEM_KEYS)}")
    parts = [{"type": "video", "video": v} for v in _listed(item.get("video"))]
    parts += [{"type": "image", "image": v} for v in _listed(item.get("image"))]
    for text in _listed(item.get("text")):
        if not isinstance(text, str):
            raise ValueError(f"an item's text must be a string, got {type(text).__name__}")
        parts.append({"type": "text", "text": text})
    return parts or [{"type": "text", "text": "NULL"}]


def _instruction(instruction: str | None, default: str) -> str:
    """The embedder ends its instruction with punctuation (adds '.' when the last character is not
    one)."""
    import unicodedata
    text = (instruction or "").strip() or default
    return text if unicodedata.category(text[-1]).startswith("P") else text + "."


def embedding_instruction(instruction: str | None = None) -> str:
    """The system turn the embedder's conversation carries for `instruction` (None: the default)."""
    return _instruction(instruction, EMBED_INSTRUCTION)


def embedding_messages(item, instruction: str | None = None) -> list[dict]:
    """The embedder's conversation: the instruction as the system turn, the item as the user turn.
    """
    return [{
        "role": "system", "content": [{"type": "text", "text": embedding_instruction(instruction)}]
    }, {"role": "user", "content": item_parts(item)}]


def rerank_messages(query, document, instruction: str | None = None) -> list[dict]:
    """The reranker's conversation: its fixed system turn; then "<Instruct>: ", "<Query>:" and the
    query's parts, "\\n<Document>:" and the document's parts, in one user turn."""
    content = [{"type": "text", "text": "<Instruct>: " + (instruction or RERANK_INSTRUCTION)},
               {"type": "text", "text": "<Query>:"}, *item_parts(query),
               {"type": "text", "text": "\n<Document>:"}, *item_parts(document)]
    return [{"role": "system", "content": [{"type": "text", "text": RERANK_SYSTEM}]},
            {"role": "user", "content": content}]


def mm_processor_kwargs(messages: list[dict]) -> dict:
    """The Qwen code's media settings for the media a conversation holds (the engine refuses options
    for media a request does not have)."""
    kinds = {
        part.get("type")
        for turn in messages
        for part in turn["content"] if isinstance(part, dict)
    }
    return {
        **(IMAGE_OPTIONS if "image" in kinds else {}), **(VIDEO_OPTIONS if "video" in kinds else {})
    }


def question_messages(query, document, instruction: str | None = None) -> list[dict]:
    """The embedded toy's reranker format: the toy answers "Is there a red house?" about a picture
    with "Yes." or "No." (vlinfer/toy/scenes.py questions), so its "No" / "Yes" logits score a
    document (its picture first, as the toy was trained) against a query such as "a red house"."""
    if instruction is not None:
        raise ValueError("the toy reranker takes no instruction: it answers 'Is there <query>?'")
    if not isinstance(query, str) or not query.strip():
        raise ValueError("the toy reranker's query is a non-empty text such as 'a red house'")
    return [{
        "role": "user",
        "content": [*item_parts(document), {"type": "text", "text": f"Is there {query.strip()}?"}]
    }]


# How a reranker reads a (query, document) pair, by the name its model source gives
# (loading/sources.py).
RERANK_FORMATS = {"qwen3-vl-reranker": rerank_messages, "toy-question": question_messages}
