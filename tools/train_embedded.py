"""Trains vlinfer's embedded Qwen3-VL on the drawn scenes of vlinfer/toy/scenes.py, with
transformers' own Qwen3VLForConditionalGeneration (autograd lives here; vlinfer stays
inference-only), the real Qwen3 tokenizer and the Qwen3-VL chat template vlinfer ships. Run once by
the maintainers, not at install:

    python tools/train_embedded.py                          # the shipped recipe: rewrites
    vlinfer/toy/data/
    python tools/train_embedded.py --steps 20 --out /tmp/x  # one short run (what the
    reproducibility test does)
    python tools/train_embedded.py --init /tmp/x --out /tmp/y   # one second-stage run from /tmp/x's
    weights
    python tools/train_embedded.py --evaluate               # score the shipped model under vlinfer

The shipped recipe has three stages (vlinfer/toy/embedded.py STAGES): TRAINING from a seeded
draw, with a curriculum from lone objects up to full scenes; FINE_TUNING from its weights on full
scenes weighted towards three objects, at a lower learning rate (the captions it still got wrong
after the first stage were almost all three-object scenes); AUGMENTING from those, half its scenes
with objects of any size anywhere the world allows, drawn varied (draw_varied), so pictures drawn
by another hand (tools/hand_drawn.py) are answered too.

Small on disk: the model keeps Qwen3's 151,936-token vocabulary, but only the tokens the world's
prompts and answers use (a few hundred) have learned rows. Training computes the loss over the full
vocabulary exactly: every other row is zero, so its logit is exactly 0, and the softmax over 151,936
tokens equals a softmax over the world's tokens plus one logit of log(151936 - n) for the rest. The
package stores those n rows and the rest of the weights (vlinfer/embedded/); vlinfer.embedded
rebuilds the full Hugging Face checkpoint from them.

The vision tower also learns from an auxiliary loss: a linear head on its merged features predicts
what each region of the picture shows (background, or the shape and colour there; location_targets).
The head is dropped, so the shipped model is a plain Qwen3-VL. Without it the tiny model never
learned to look at the picture.

Seeded: the same seed, thread count and library versions give the same weights
(tests/toy/test_embedded_model.py trains a short run twice and compares the hashes)."""
import argparse
import functools
import json
import math
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vlinfer.toy import embedded  # noqa: E402
from vlinfer.toy import scenes  # noqa: E402
from vlinfer.toy.tiny_checkpoints import (QWEN3_VL_SPECIAL, qwen_tokenizer_files,  # noqa: E402
                                          tiny_qwen3_vl_config)

# scenes seed of the shipped run; EVAL_SEED (never trained on) is in vlinfer.embedded
TRAIN_SEED = 1
# scenes whose texts define the world's vocabulary (with every prompt and answer form)
VOCAB_SEED = 7
IM_START, IM_END, NEWLINE = 151644, 151645, 198
ASSISTANT = 77091  # "assistant"


def load_tokenizer_and_template():
    from importlib import resources

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_files())
    template = resources.files("vlinfer.multimodal").joinpath(
        "templates/qwen3_vl.jinja").read_text()
    return tokenizer, template


@functools.lru_cache(maxsize=1)
def world_texts() -> tuple[str, ...]:
    """Every kind of text the world produces: prompts, captions, questions, answers."""
    texts = list(scenes.CAPTION_PROMPTS)
    rng = random.Random(VOCAB_SEED)
    for _ in range(4000):
        scene = scenes.random_scene(rng)
        texts.append(scenes.caption(scene))
        for q, a in scenes.questions(scene, rng):
            texts += [q, a]
    return tuple(texts)


def world_vocabulary(tokenizer, template) -> list[int]:
    """Sorted token ids of the world: its texts inside the chat template, and the template's own
    tokens."""
    ids = {tokenizer.pad_token_id, *QWEN3_VL_SPECIAL.values()}
    for text in sorted(set(world_texts())):
        ids.update(tokenizer(text)["input_ids"])
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]},
                    {"role": "assistant", "content": "x"}]
    ids.update(
        tokenizer(
            tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=template,
                                          add_generation_prompt=True))["input_ids"])
    return sorted(ids)


def conversation(scene, qa, rng: random.Random, max_turns: int):
    """1..max_turns question turns about one picture (the picture comes with the first), in random
    order: the caption is one of them half the time. Every turn is sometimes first, as at inference.
    """
    turns = [(rng.choice(scenes.CAPTION_PROMPTS), scenes.caption(scene))] + list(qa)
    rng.shuffle(turns)
    turns = turns[:rng.randint(1, max_turns)]
    messages = []
    for i, (q, a) in enumerate(turns):
        content = ([{"type": "image"}] if i == 0 else []) + [{"type": "text", "text": q}]
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": a}]
    return messages


def answer_mask(ids: torch.Tensor) -> torch.Tensor:
    """True at the tokens the model must produce: each assistant answer and its <|im_end|>."""
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for b in range(ids.shape[0]):
        row, inside = ids[b].tolist(), False
        for t in range(len(row)):
            if inside:
                mask[b, t] = True
                inside = row[t] != IM_END
            elif t >= 2 and row[t - 2:t + 1] == [IM_START, ASSISTANT, NEWLINE]:
                inside = True
    return mask


class Batcher:
    """Turns scenes into model inputs with transformers' Qwen3VLProcessor (which expands
    <|image_pad|>) and maps Qwen3's token ids to the compact ids of the world's vocabulary."""

    def __init__(self, tokenizer, template, vocab: list[int]):
        from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
        tokenizer.padding_side = "right"
        image_processor = Qwen2VLImageProcessor(**embedded.PREPROCESSOR_KWARGS)
        self.processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                          video_processor=Qwen3VLVideoProcessor(),
                                          chat_template=template)
        self.template = template
        self.compact = torch.full((embedded.VOCAB_SIZE,), -1, dtype=torch.long)
        self.compact[torch.tensor(vocab)] = torch.arange(len(vocab))

    def __call__(self, conversations: list, images: list) -> dict:
        texts = [
            self.processor.tokenizer.apply_chat_template(c, tokenize=False,
                                                         chat_template=self.template)
            for c in conversations
        ]
        out = self.processor(text=texts, images=images, return_tensors="pt", padding=True)
        ids = out["input_ids"]
        compact = self.compact[ids]
        if (compact < 0).any():
            unknown = sorted(set(ids[compact < 0].tolist()))[:5]
            raise ValueError(f"tokens {unknown} are outside the world's vocabulary")
        targets = answer_mask(ids) & out["attention_mask"].bool()
        return dict(input_ids=compact, attention_mask=out["attention_mask"],
                    pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                    mm_token_type_ids=out["mm_token_type_ids"], targets=targets)


def compact_model(shape: dict, vocab: list[int], seed: int):
    """The Qwen3-VL shape with only the world's vocabulary rows, special token ids renumbered to
    match."""
    from transformers import Qwen3VLForConditionalGeneration
    config = tiny_qwen3_vl_config(**shape)
    config.text_config.vocab_size = len(vocab)
    index = {token: i for i, token in enumerate(vocab)}
    for name, token in QWEN3_VL_SPECIAL.items():
        setattr(config, name, index[token])
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config)


def losses(model, batch: dict, rest: int):
    """Per target token: the cross entropy over the full vocabulary, and whether greedy decoding
    picks the target (the zero rows count as one more candidate, logit 0). Target t is predicted at
    position t - 1."""
    hidden = model.model(**{k: v
                            for k, v in batch.items()
                            if k not in ("targets", "scenes")}).last_hidden_state
    targets = batch["targets"][:, 1:]
    h = hidden[:, :-1][targets]
    labels = batch["input_ids"][:, 1:][targets]
    logits = model.lm_head(h)
    # the zero rows' shared logit
    full = torch.cat([logits, torch.zeros_like(logits[:, :1])], dim=1)
    log_z = torch.logsumexp(
        torch.cat([logits, torch.full_like(logits[:, :1], math.log(rest))], dim=1), dim=1)
    nll = log_z - logits.gather(1, labels[:, None])[:, 0]
    return nll, full.argmax(1) == labels, targets


def _shade(rgb, factor: float):
    return tuple(max(0, min(255, int(c * factor))) for c in rgb)


def draw_varied(scene, rng: random.Random):
    """The scene drawn with the freedom a hand has (the training's style augmentation): colours
    further off their swatch, an outline of a darker shade sometimes, and each shape's proportions
    varied (a star's points, a triangle's apex, a house's roof and door), on the footprint
    scenes.object_index_map gives (the location loss's targets)."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (scene.width, scene.height),
                    scenes._jitter(scenes.BACKGROUNDS[scene.background], rng, 14))
    d = ImageDraw.Draw(img)
    for o in scene.objects:
        fill = scenes._jitter(scenes.COLOURS[o.colour], rng, 28)
        width = rng.choice((0, 0, 1, 2, 3, 4))
        line = dict(outline=_shade(fill, rng.uniform(0.45, 0.8)), width=width) if width else {}
        x0, y0, x1, y1 = o.cx - o.half, o.cy - o.half, o.cx + o.half, o.cy + o.half
        sx, sy = o.half * rng.uniform(-0.08, 0.08), o.half * rng.uniform(-0.08, 0.08)
        if o.shape == "circle":
            d.ellipse([x0 + sx, y0 + sy, x1 - sx, y1 - sy], fill=fill, **line)
        elif o.shape == "square":
            d.rectangle([x0 + sx, y0 + sy, x1 - sx, y1 - sy], fill=fill, **line)
        elif o.shape == "triangle":
            apex = o.cx + o.half * rng.uniform(-0.2, 0.2)
            d.polygon([(apex, y0), (x1, y1), (x0, y1)], fill=fill, **line)
        elif o.shape == "star":
            inner, turn = rng.uniform(0.34, 0.52), rng.uniform(-0.25, 0.25)
            d.polygon([(o.cx + o.half * (1 if k % 2 == 0 else inner) *
                        math.cos(-math.pi / 2 + turn + k * math.pi / 5),
                        o.cy + o.half * (1 if k % 2 == 0 else inner) *
                        math.sin(-math.pi / 2 + turn + k * math.pi / 5)) for k in range(10)],
                      fill=fill, **line)
        else:  # house: walls, a roof of a darker (or the same) shade, a door or none
            inset, top = o.half * rng.uniform(0.05, 0.25), o.cy + o.half * rng.uniform(-0.35, 0.1)
            d.rectangle([x0 + inset, top, x1 - inset, y1], fill=fill, **line)
            d.polygon([(x0, top + 1), (o.cx, y0), (x1, top + 1)],
                      fill=_shade(fill, rng.uniform(0.45, 1.0)), **line)
            if rng.random() < 0.8:
                door = o.half * rng.uniform(0.12, 0.25)
                d.rectangle([o.cx - door, o.cy + o.half * rng.uniform(0.3, 0.55), o.cx + door, y1],
                            fill=scenes._jitter((60, 40, 25), rng, 20))
    return img


def sample_batch(rng: random.Random, size: int, max_turns: int, batcher: Batcher, max_objects: int,
                 objects_power: float = 0.0, augment: float = 0.0) -> dict:
    """Model inputs for `size` conversations, one picture each; batch["scenes"] holds their scenes.
    A scene has n objects (1..max_objects) with weight n ** objects_power: 0 draws every count
    equally often (the world's own mix, as the held-out scenes have it); 1 shows three-object scenes
    three times as often as lone objects. A share `augment` of the scenes has its objects anywhere
    the world allows (scenes.random_scene anywhere=True) and is drawn by draw_varied."""
    convs, images, drawn = [], [], []
    counts = range(1, max_objects + 1)
    for _ in range(size):
        # (0 keeps the draws of both options: runs from before them replay unchanged)
        varied = bool(augment) and rng.random() < augment
        if objects_power:
            scene = scenes.random_scene(rng, max_objects,
                                        rng.choices(counts, [n**objects_power for n in counts])[0],
                                        anywhere=varied)
        else:
            scene = scenes.random_scene(rng, max_objects, anywhere=varied)
        drawn.append(scene)
        images.append(draw_varied(scene, rng) if varied else
                      scenes.draw(scene, rng.randrange(2 ** 31)))
        convs.append(conversation(scene, scenes.questions(scene, rng), rng, max_turns))
    return dict(batcher(convs, images), scenes=drawn)


# Per-location targets for the vision tower (an auxiliary loss during training only; the shipped
# model has no extra parameters): what each merged vision token covers, class 0 the background, then
# one class per (shape, colour). Without them the tiny model never learns to look: the language
# model answers from its prior and the background colour, and the vision features collapse to one
# vector (their differences between pictures fell to 1-5% of their size in every run without this
# loss).
LOCATION_CLASSES = 1 + len(scenes.SHAPES) * len(scenes.COLOURS)
LOCATION_LOSS_WEIGHT = 1.0
# an object covering less of a token's area than this leaves it background
LOCATION_MIN_COVER = 0.15


def location_targets(drawn: list, grid_thw: torch.Tensor, patch: int, merge: int) -> torch.Tensor:
    """The class of every merged vision token of the batch's pictures, in the vision tower's output
    order (picture by picture, raster over its merged grid): the object covering most of the token's
    area, if it covers at least LOCATION_MIN_COVER of it."""
    import numpy as np
    colours = list(scenes.COLOURS)
    labels = []
    for scene, (t, h, w) in zip(drawn, grid_thw.tolist()):
        index = np.asarray(scenes.object_index_map(scene))
        classes = [0] + [1 + scenes.SHAPES.index(o.shape) * len(colours) + colours.index(o.colour)
                         for o in scene.objects]
        gh, gw = h // merge, w // merge
        ys = np.linspace(0, scene.height, gh + 1).round().astype(int)
        xs = np.linspace(0, scene.width, gw + 1).round().astype(int)
        for _ in range(t):
            for i in range(gh):
                for j in range(gw):
                    region = index[ys[i]:ys[i + 1], xs[j]:xs[j + 1]]
                    counts = np.bincount(region.ravel(), minlength=len(classes))
                    counts[0] = 0
                    best = int(counts.argmax())
                    labels.append(classes[best] if counts[best] >= LOCATION_MIN_COVER *
                                  region.size else 0)
    return torch.tensor(labels)


def teacher_forced_accuracy(model, batcher: Batcher, rest: int, seed: int, count: int) -> dict:
    """Single-turn exact-match rates on held-out scenes: a turn whose every token is the argmax is
    exactly what greedy decoding answers. Caption exact match is stricter than the caption bar
    (colours and shapes named)."""
    rng = random.Random(seed)
    hits = {"caption": [], "question": []}
    model.eval()
    with torch.no_grad():
        for start in range(0, count, 16):
            convs, images = [], []
            for _ in range(min(16, count - start)):
                scene = scenes.random_scene(rng)
                image = scenes.draw(scene, rng.randrange(2 ** 31))
                qa = scenes.questions(scene, rng)
                for q, a in [(rng.choice(scenes.CAPTION_PROMPTS), scenes.caption(scene)),
                             rng.choice(qa)]:
                    images.append(image)
                    convs.append([{
                        "role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]
                    }, {"role": "assistant", "content": a}])
            batch = batcher(convs, images)
            _, correct, targets = losses(model, batch, rest)
            per_row = torch.zeros(targets.shape[0], dtype=torch.long).index_add_(
                0, targets.nonzero()[:, 0], (~correct).long())
            for i, wrong in enumerate(per_row.tolist()):
                hits["caption" if i % 2 == 0 else "question"].append(wrong == 0)
    model.train()
    return {k: sum(v) / len(v) for k, v in hits.items()}


def train(out: str, steps: int, batch_size: int, seed: int, threads: int, lr: float, max_turns: int,
          shape: dict, log_every: int = 50, eval_every: int = 0, eval_count: int = 64,
          stop_after: int | None = None, snapshot_every: int = 0,
          weight_decay: float = embedded.TRAINING["weight_decay"],
          objects_power: float = embedded.TRAINING["objects_power"],
          init: str | None = None, augment: float = 0.0) -> dict:
    """Train and write the compact model to `out`; returns its manifest. `steps` sets the schedule;
    stop_after ends the run early (the weights equal that step's snapshot of the full run);
    snapshot_every writes the model so far to out/step-N as it goes; init starts from a compact
    model's weights (a second stage) instead of a seeded draw. The caller's thread count and
    deterministic-algorithms setting are restored afterwards."""
    if stop_after is not None and not 0 < stop_after <= steps:
        raise ValueError(f"stop_after={stop_after} must be in 1..steps={steps}")
    saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)  # float sums depend on how work is split: part of the recipe
    torch.use_deterministic_algorithms(True)
    try:
        return _train(out, steps, batch_size, seed, threads, lr, max_turns, shape, log_every,
                      eval_every, eval_count, stop_after or steps, snapshot_every, weight_decay,
                      objects_power, init, augment)
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def _train(out, steps, batch_size, seed, threads, lr, max_turns, shape, log_every, eval_every,
           eval_count, stop_after, snapshot_every, weight_decay, objects_power, init,
           augment) -> dict:
    tokenizer, template = load_tokenizer_and_template()
    vocab = world_vocabulary(tokenizer, template)
    rest = embedded.VOCAB_SIZE - len(vocab)
    batcher = Batcher(tokenizer, template, vocab)
    model = compact_model(shape, vocab, seed).train()
    start_from = load_compact(model, init, vocab) if init else None
    # Every matrix decays, embeddings and the vision tower's included. Most of them feed a norm
    # (RMSNorm in the language model, LayerNorm in the vision merger), so the loss does not depend
    # on their scale and Adam's steps, orthogonal to them, only grow it; without decay the vision
    # features grew ~750x in 2000 steps (0.07 -> 52 per element, the images' differences a 5% ripple
    # on a common vector), which shrank their effective learning rate until the model stopped
    # learning from the pictures (it answered the prior and the background colour only).
    # see location_targets
    location_head = torch.nn.Linear(model.config.text_config.hidden_size, LOCATION_CLASSES)
    trained = list(model.parameters()) + list(location_head.parameters())
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0}],
        lr=lr, betas=(0.9, 0.98))
    warmup = max(1, min(100, steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1, s / steps)))))
    rng = random.Random(seed * 1_000_003 + TRAIN_SEED)
    # The auxiliary location head reads the vision tower's merged features (captured by a hook, so
    # the model's own forward computes them once); it trains with the model and is dropped.
    vision_features = []
    model.model.visual.register_forward_hook(
        lambda module, args, out: vision_features.append(out.pooler_output))
    vision = model.config.vision_config
    start, history, location_history = time.time(), [], []
    for step in range(1, stop_after + 1):
        batch = sample_batch(rng, batch_size, max_turns, batcher,
                             objects_cap(step, steps, bool(init)), objects_power, augment)
        vision_features.clear()
        nll, correct, _ = losses(model, batch, rest)
        where = location_targets(batch["scenes"], batch["image_grid_thw"], vision.patch_size,
                                 vision.spatial_merge_size)
        location = torch.nn.functional.cross_entropy(location_head(vision_features[0]), where)
        loss = nll.mean() + LOCATION_LOSS_WEIGHT * location
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        schedule.step()
        history.append(nll.mean().item())
        location_history.append(location.item())
        if step % log_every == 0 or step == steps:
            print(
                f"step {step}/{steps} loss "
                f"{sum(history[-log_every:]) / len(history[-log_every:]):.4f} "
                "location loss "
                f"{sum(location_history[-log_every:]) / len(location_history[-log_every:]):.4f} "
                f"token acc {correct.float().mean().item():.3f} {time.time() - start:.0f}s",
                flush=True)
        if eval_every and (step % eval_every == 0 or step == stop_after):
            accuracy = teacher_forced_accuracy(model, batcher, rest, embedded.EVAL_SEED + 1,
                                               eval_count)
            print(f"  held-out teacher-forced exact match: {accuracy}", flush=True)
        if snapshot_every and step % snapshot_every == 0 and step < stop_after:
            info = dict(steps=steps, stop_after=step, batch_size=batch_size, seed=seed,
                        threads=threads, lr=lr, max_turns=max_turns, weight_decay=weight_decay,
                        objects_power=objects_power, shape=shape, init=start_from,
                        **({"augment": augment} if augment else {}),
                        train_seconds=round(time.time() - start), torch=torch.__version__,
                        machine=cpu_name())
            embedded.write_compact(os.path.join(out, f"step-{step}"), model.state_dict(), vocab,
                                   shape, info)
    info = dict(steps=steps, stop_after=stop_after, batch_size=batch_size, seed=seed,
                threads=threads, lr=lr, max_turns=max_turns, weight_decay=weight_decay,
                objects_power=objects_power, shape=shape, init=start_from,
                **({"augment": augment} if augment else {}),
                train_seconds=round(time.time() - start),
                final_loss=round(sum(history[-50:]) / len(history[-50:]),
                                 5), torch=torch.__version__, machine=cpu_name())
    return embedded.write_compact(out, model.state_dict(), vocab, shape, info)


def load_compact(model, folder: str, vocab: list[int]) -> dict:
    """Load a compact model's weights (a first stage's output) into `model`; returns that stage's
    manifest."""
    from safetensors.torch import load_file
    manifest = embedded.read_manifest(folder)
    tensors = load_file(embedded.checked_weights(folder, embedded.WEIGHTS, manifest))
    if tensors.pop("vocab_ids").tolist() != vocab:
        raise ValueError(f"{folder} was trained on another vocabulary than this world's")
    model.load_state_dict(tensors, strict=True)
    return manifest


def objects_cap(step: int, steps: int, second_stage: bool = False) -> int:
    """A curriculum: scenes of one object first, up to scenes.MAX_OBJECTS by a quarter of the run. A
    lone object ties each colour and shape word to what it looks like before the model must tell
    objects apart. A second stage starts from a model that has been through it."""
    if second_stage:
        return scenes.MAX_OBJECTS
    return min(scenes.MAX_OBJECTS, 1 + step * scenes.MAX_OBJECTS // max(1, steps // 4))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def evaluate(model, seed: int = embedded.EVAL_SEED, count: int = 200, **llm_kwargs) -> dict:
    """Score a model (an LLM, or anything LLM() takes) on `count` scenes of `seed`, greedy, through
    vlinfer: the caption must state exactly the scene (each kind of object, its colour and its
    number, and the background: scenes.caption_is_right); each question's answer must equal the
    truth."""
    return evaluate_items(model, scenes.generate(seed, count), **llm_kwargs)


def evaluate_items(model, drawn: list, **llm_kwargs) -> dict:
    """evaluate's scoring of any pictures with their truths ((scene, picture, questions with
    answers), as scenes.generate gives them): "accuracy" is the share of captions and answers right
    together."""
    from vlinfer import LLM, SamplingParams
    llm = model if isinstance(model, LLM) else LLM(model, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=scenes.MAX_ANSWER_TOKENS)
    items, count = [], len(drawn)
    for i, (scene, image, qa) in enumerate(drawn):
        prompt = scenes.CAPTION_PROMPTS[i % len(scenes.CAPTION_PROMPTS)]
        items.append((scene, image, prompt, None))
        items += [(scene, image, q, a) for q, a in qa]
    conversations = [[{
        "role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": q}]
    }] for _, image, q, _ in items]
    outs = llm.chat(conversations, params, use_tqdm=False)
    captions_right, answers_right, answers, failures = 0, 0, 0, []
    exact = 0
    for (scene, _, q, truth), out in zip(items, outs):
        text = out.outputs[0].text.strip()
        if truth is None:
            ok = scenes.caption_is_right(text, scene)
            captions_right += ok
            exact += text == scenes.caption(scene)
            truth = scenes.caption(scene)
        else:
            ok = text == truth
            answers += 1
            answers_right += ok
        if not ok:
            failures.append(dict(question=q, answer=text, truth=truth))
    return dict(scenes=count, accuracy=(captions_right + answers_right) / (count + answers),
                caption_accuracy=captions_right / count, caption_exact=exact / count,
                questions=answers, answer_accuracy=answers_right / max(1, answers),
                failures=failures)


def evaluate_retrieval(pipe, seed: int = embedded.EVAL_SEED, count: int = 200, kinds=None) -> dict:
    """Text-to-image retrieval on `count` scenes of `seed` with a reranker Pipeline (the embedded
    "qwen3-vl-toy-reranker"): for each kind of object (a colour and a shape, every one by default)
    that some scene holds, the query "a red house" ranks every scene; recall@5 is the share of
    queries whose top 5 hold a scene with one; precision@5 the share of the top 5 that do, out of as
    many as can (fewer when fewer scenes hold one)."""
    drawn = scenes.generate(seed, count)
    kinds = kinds or [(c, s) for c in sorted(scenes.COLOURS) for s in scenes.SHAPES]
    found, precise, queries, misses = 0, 0, 0, []
    for colour, shape in kinds:
        holds = [
            any((o.colour, o.shape) == (colour, shape) for o in scene.objects)
            for scene, _, _ in drawn
        ]
        if not any(holds):
            continue
        query = f"{scenes._article(colour)} {colour} {shape}"
        top = [
            r["index"]
            for r in pipe.rerank(query, [{"image": image} for _, image, _ in drawn], top_k=5)
        ]
        queries += 1
        found += any(holds[i] for i in top)
        precise += sum(holds[i] for i in top) / min(len(top), sum(holds))
        if sum(holds[i] for i in top) < min(len(top), sum(holds)):
            misses.append(dict(query=query, top=top, holds=[holds[i] for i in top]))
    return dict(scenes=count, queries=queries, recall_at_5=found / queries,
                precision_at_5=precise / queries, misses=misses)


RUN_FLAGS = ("steps", "batch_size", "seed", "threads", "lr", "max_turns", "weight_decay",
             "objects_power", "augment")


def train_shipped(out: str, log_every: int = 50) -> dict:
    """The shipped recipe: embedded.STAGES in turn, the first from a seeded draw, each next one from
    the weights of the one before."""
    with tempfile.TemporaryDirectory() as work:
        init = None
        for i, stage in enumerate(embedded.STAGES):
            folder = out if i == len(embedded.STAGES) - 1 else os.path.join(work, f"stage-{i}")
            info = train(folder, shape=dict(embedded.SHAPE), log_every=log_every, init=init,
                         stop_after=stage["stop_after"],
                         **{k: stage[k] for k in RUN_FLAGS if k in stage})
            init = folder
        return info


def print_scores(scores: dict) -> None:
    """An evaluation's figures, then its first ten wrong items."""
    print(json.dumps({k: v for k, v in scores.items() if k != "failures"}, indent=1))
    for failure in scores["failures"][:10]:
        print("  wrong:", failure)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=embedded.PACKAGE_DIR,
                   help="folder for the compact weights (default: the package's)")
    run = p.add_argument_group(
        "one run instead of the shipped recipe's stages (defaults: embedded.TRAINING, or "
        "embedded.AUGMENTING with --init)")
    run.add_argument("--steps", type=int)
    run.add_argument("--batch-size", type=int)
    run.add_argument("--seed", type=int)
    run.add_argument("--threads", type=int)
    run.add_argument("--lr", type=float)
    run.add_argument("--max-turns", type=int)
    run.add_argument("--weight-decay", type=float)
    run.add_argument("--objects-power", type=float,
                     help="a training scene has n objects with weight n ** this "
                     "(0: uniform)")
    run.add_argument("--augment", type=float,
                     help="share of scenes with objects anywhere in the world, drawn varied")
    run.add_argument("--init", default=None, help="start from this compact model (a second stage)")
    run.add_argument("--stop-after", type=int, default=None,
                     help="end after N steps of the --steps schedule")
    run.add_argument("--snapshot-every", type=int, default=0,
                     help="write the model so far to OUT/step-N every N steps")
    run.add_argument("--eval-every", type=int, default=0,
                     help="teacher-forced held-out check every N steps")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--evaluate", action="store_true",
                   help="only score the model in --out under vlinfer")
    p.add_argument("--eval-scenes", type=int, default=200)
    p.add_argument("--eval-seed", type=int, default=embedded.EVAL_SEED,
                   help="scenes to score on (default: the "
                   "held-out seed)")
    p.add_argument(
        "--evaluate-retrieval", action="store_true", help=
        "only score the embedded toy reranker (qwen3-vl-toy-reranker) at text-to-image retrieval")
    args = p.parse_args(argv)
    single = args.init is not None or any(getattr(args, k) is not None for k in RUN_FLAGS) or \
        args.stop_after or args.snapshot_every or args.eval_every
    recipe = embedded.AUGMENTING if args.init is not None else embedded.TRAINING
    # (a recipe without augment has none)
    flags = {k: recipe.get(k, 0.0) if getattr(args, k) is None else getattr(args, k)
             for k in RUN_FLAGS}
    if args.evaluate_retrieval:
        from vlinfer import Pipeline
        scores = evaluate_retrieval(Pipeline("qwen3-vl-toy-reranker", dtype="float32"),
                                    args.eval_seed, args.eval_scenes)
        print(json.dumps(scores, indent=1))
        return 0
    if args.evaluate:
        pass
    elif single:
        info = train(args.out, shape=dict(embedded.SHAPE), log_every=args.log_every,
                     eval_every=args.eval_every, stop_after=args.stop_after,
                     snapshot_every=args.snapshot_every, init=args.init, **flags)
        print(json.dumps(info, indent=1))
    else:
        print(json.dumps(train_shipped(args.out, args.log_every), indent=1))
    torch.set_num_threads(flags["threads"])
    with tempfile.TemporaryDirectory() as tmp:
        folder = embedded.build_checkpoint(args.out, tmp)
        scores = evaluate(folder, seed=args.eval_seed, count=args.eval_scenes, dtype="float32",
                          max_model_len=512, kv_cache_bytes=256 << 20)
    print_scores(scores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
