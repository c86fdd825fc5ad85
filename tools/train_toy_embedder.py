"""Trains the embedded toy embedder (`qwen3-vl-toy-embedding`): the embedded toy Qwen3-VL
(tools/train_embedded.py) with its language model retrained as a Qwen3-VL-Embedding on the drawn
scenes of vlinfer/toy/scenes.py, so that offline `Pipeline("qwen3-vl-embedding")` finds "a red
house" among pictures by the cosine of two vectors.

    python tools/train_toy_embedder.py                   # the shipped recipe: rewrites
    vlinfer/toy/data/*_embedder.*
    python tools/train_toy_embedder.py --steps 5 --out /tmp/x   # a short run
    python tools/train_toy_embedder.py --evaluate        # recall@5 of the shipped embedder under
    vlinfer

The vector is the Qwen embedder's (docs/retrieval.md): the final hidden state at the last token of
the prompt in the embedder's format (inputs/retrieval.py embedding_messages), L2-normalized. A batch
is B drawn scenes, each as a picture, and B queries, each one kind of object a scene holds ("a red
house", or "red house"); the loss is InfoNCE in both directions, every scene holding the query's
kind of object counting as a positive (a batch often has several), at a fixed temperature.

What trains: the language model's layers and final norm, and the embedding rows of the tokens the
embedder's prompts add to the toy's vocabulary ("Represent the user's input.", "system", the
queries' first word); the vision tower and the toy's own token rows stay as they are. The package
stores only those tensors (vlinfer/toy/embedded.py write_embedder), beside the toy they change.

Seeded: the same seed, thread count and library versions give the same weights."""
import argparse
import json
import math
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_embedded  # noqa: E402
from vlinfer.inputs.retrieval import embedding_messages  # noqa: E402
from vlinfer.toy import embedded  # noqa: E402
from vlinfer.toy import scenes  # noqa: E402

TRAIN_SEED = 2  # scenes seed of the shipped run (the toy's used 1; EVAL_SEED is never trained on)


def query_texts(colour: str, shape: str) -> tuple[str, ...]:
    """The query forms training uses for one kind of object: with its article and without."""
    return (f"{scenes._article(colour)} {colour} {shape}", f"{colour} {shape}")


def prompt_text(tokenizer, template, item) -> str:
    """An item's prompt in the embedder's format, as text: a picture stands as its placeholder,
    which the processor expands."""
    messages = embedding_messages(item)
    for part in messages[1]["content"]:
        part.pop("image", None)
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                         add_generation_prompt=True)


def embedder_vocabulary(tokenizer, template) -> list[int]:
    """The toy's vocabulary plus the tokens of the embedder's prompts (its instruction, the
    template's system turn, every query form)."""
    ids = set(train_embedded.world_vocabulary(tokenizer, template))
    items = [q for c in scenes.COLOURS for s in scenes.SHAPES
             for q in query_texts(c, s)] + [{"image": "picture"}]
    for item in items:
        ids.update(tokenizer(prompt_text(tokenizer, template, item))["input_ids"])
    return sorted(ids)


class EmbedderBatcher:
    """Items in the embedder's format through transformers' Qwen3VLProcessor, pictures sized as the
    Qwen embedder sizes them (inputs/retrieval.py IMAGE_OPTIONS), token ids mapped to the compact
    vocabulary `vocab` (Qwen3's own ids when None: the built checkpoint's)."""

    def __init__(self, tokenizer, template, vocab: list[int] | None):
        from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        from vlinfer.inputs.retrieval import IMAGE_OPTIONS
        tokenizer.padding_side = "right"
        sizes = dict(
            embedded.PREPROCESSOR_KWARGS, size={
                "shortest_edge": IMAGE_OPTIONS["min_pixels"],
                "longest_edge": IMAGE_OPTIONS["max_pixels"]
            })
        self.processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes),
                                          tokenizer=tokenizer,
                                          video_processor=Qwen3VLVideoProcessor(),
                                          chat_template=template)
        self.template = template
        self.compact = torch.arange(embedded.VOCAB_SIZE)
        if vocab is not None:
            self.compact = torch.full((embedded.VOCAB_SIZE,), -1, dtype=torch.long)
            self.compact[torch.tensor(vocab)] = torch.arange(len(vocab))

    def __call__(self, texts: list[str] | None = None, images: list | None = None) -> dict:
        items = [{"image": "picture"} for _ in images] if images else list(texts)
        prompts = [prompt_text(self.processor.tokenizer, self.template, item) for item in items]
        out = self.processor(text=prompts, images=images or None, return_tensors="pt", padding=True)
        ids = self.compact[out["input_ids"]]
        if (ids < 0).any():
            unknown = sorted(set(out["input_ids"][ids < 0].tolist()))[:5]
            raise ValueError(f"tokens {unknown} are outside the embedder's vocabulary")
        return dict(out, input_ids=ids)


def pooled(model, batch: dict) -> torch.Tensor:
    """The Qwen embedder's vector from a transformers Qwen3VLModel: the last real token's final
    hidden state, L2-normalized."""
    hidden = model(**batch).last_hidden_state
    last = batch["attention_mask"].sum(1) - 1
    return torch.nn.functional.normalize(hidden[torch.arange(hidden.shape[0]), last], dim=-1)


def contrastive_loss(queries: torch.Tensor, pictures: torch.Tensor, positive: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """InfoNCE with several positives, both ways: each query against every picture (those holding
    its kind of object are positives), each picture against every query (the queries it answers are
    positives)."""
    logits = queries @ pictures.T / temperature
    masked = logits.masked_fill(~positive, float("-inf"))
    by_query = torch.logsumexp(logits, 1) - torch.logsumexp(masked, 1)
    by_picture = torch.logsumexp(logits, 0) - torch.logsumexp(masked, 0)
    return (by_query.mean() + by_picture.mean()) / 2


def sample_batch(rng: random.Random, size: int) -> tuple[list, list, torch.Tensor]:
    """`size` scenes and one query per scene (a kind of object it holds, in a random query form);
    positive[i, j]: scene j holds query i's kind."""
    drawn = [scenes.random_scene(rng) for _ in range(size)]
    images = [scenes.draw(scene, rng.randrange(2 ** 31)) for scene in drawn]
    kinds = [rng.choice([(o.colour, o.shape) for o in scene.objects]) for scene in drawn]
    texts = [rng.choice(query_texts(*kind)) for kind in kinds]
    positive = torch.tensor(
        [[any((o.colour, o.shape) == kind for o in scene.objects) for scene in drawn]
         for kind in kinds])
    return images, texts, positive


def load_toy(model, vocab: list[int]) -> list[int]:
    """The shipped toy's weights into `model` (whose vocabulary holds the toy's and more); returns
    the rows of the tokens the toy does not have (zero, as they are in the toy)."""
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(embedded.PACKAGE_DIR, embedded.WEIGHTS))
    toy_vocab = tensors.pop("vocab_ids").tolist()
    index = {token: i for i, token in enumerate(vocab)}
    rows = torch.tensor([index[token] for token in toy_vocab])
    for name in embedded.VOCAB_ROWS:
        full = torch.zeros(len(vocab), tensors[name].shape[1])
        full[rows] = tensors[name]
        tensors[name] = full
    model.load_state_dict(tensors, strict=True)
    return sorted(set(range(len(vocab))) - set(rows.tolist()))


def train(out: str, steps: int, batch_size: int, seed: int, threads: int, lr: float,
          temperature: float, log_every: int = 25) -> dict:
    """Train and write the embedder's tensors to `out`; returns its manifest. The caller's thread
    count and deterministic-algorithms setting are restored afterwards."""
    saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(out, steps, batch_size, seed, threads, lr, temperature, log_every)
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def _train(out, steps, batch_size, seed, threads, lr, temperature, log_every) -> dict:
    tokenizer, template = train_embedded.load_tokenizer_and_template()
    vocab = embedder_vocabulary(tokenizer, template)
    batcher = EmbedderBatcher(tokenizer, template, vocab)
    model = train_embedded.compact_model(dict(embedded.SHAPE), vocab, seed)
    new_rows = load_toy(model, vocab)
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    layers = [
        p for name, p in model.model.language_model.named_parameters()
        if not name.startswith("embed_tokens")
    ]
    table = model.model.language_model.embed_tokens.weight
    keep = torch.ones(len(vocab), 1)
    keep[new_rows] = 0
    for p in layers + [table]:
        p.requires_grad_(True)
    table.register_hook(lambda grad: grad * (1 - keep))  # only the rows the toy does not have learn
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in layers if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in layers if p.dim() < 2] + [table], "weight_decay": 0}], lr=lr,
        betas=(0.9, 0.98))
    warmup = max(1, min(50, steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1, s / steps)))))
    rng = random.Random(seed * 1_000_003 + TRAIN_SEED)
    start, history = time.time(), []
    for step in range(1, steps + 1):
        images, texts, positive = sample_batch(rng, batch_size)
        loss = contrastive_loss(pooled(model.model, batcher(texts=texts)),
                                pooled(model.model, batcher(images=images)), positive, temperature)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(layers + [table], 1.0)
        optimizer.step()
        schedule.step()
        history.append(loss.item())
        if step % log_every == 0 or step == steps:
            print(
                f"step {step}/{steps} loss "
                f"{sum(history[-log_every:]) / len(history[-log_every:]):.4f} "
                f"{time.time() - start:.0f}s", flush=True)
    state = model.state_dict()
    tensors = {name: state[name] for name in state if name.startswith("model.language_model.")
               and not name.startswith("model.language_model.embed_tokens")}
    extra = [vocab[i] for i in new_rows]
    info = dict(steps=steps, batch_size=batch_size, seed=seed, threads=threads, lr=lr,
                temperature=temperature, train_seconds=round(time.time() - start),
                final_loss=round(sum(history[-25:]) / len(history[-25:]),
                                 5), torch=torch.__version__, machine=train_embedded.cpu_name())
    return embedded.write_embedder(out, tensors, extra, table.detach()[new_rows], info)


def evaluate(folder: str = embedded.PACKAGE_DIR, count: int = 200,
             seed: int = embedded.EVAL_SEED) -> dict:
    """Recall@5 and precision@5 of the embedder in `folder` at text-to-image retrieval under vlinfer
    (train_embedded.evaluate_retrieval: every kind of object as a query, ranking `count` held-out
    scenes)."""
    from vlinfer import Pipeline
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = embedded.build_embedder_checkpoint(embedded.PACKAGE_DIR, folder, tmp)
        return train_embedded.evaluate_retrieval(Pipeline(checkpoint, dtype="float32"), seed, count)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=embedded.PACKAGE_DIR,
                   help="folder for the embedder's tensors (default: the "
                   "package's)")
    for flag, kind in (("steps", int), ("batch-size", int), ("seed", int), ("threads", int),
                       ("lr", float), ("temperature", float)):
        p.add_argument(f"--{flag}", type=kind, help="default: embedded.EMBEDDER_TRAINING's")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--evaluate", action="store_true",
                   help="only score the embedder in --out under vlinfer")
    p.add_argument("--eval-scenes", type=int, default=200)
    args = p.parse_args(argv)
    recipe = {k: getattr(args, k) if getattr(args, k) is not None else v
              for k, v in embedded.EMBEDDER_TRAINING.items()}
    if not args.evaluate:
        print(json.dumps(train(args.out, log_every=args.log_every, **recipe), indent=1))
    torch.set_num_threads(recipe["threads"])
    scores = evaluate(args.out, args.eval_scenes)
    print(json.dumps(scores, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
