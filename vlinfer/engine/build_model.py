"""Builds an engine's model on its op table and dtype (ModelContext), loads its checkpoint shard,
and gives its weights the layout its ops prefer."""
import logging
from dataclasses import replace
from typing import NamedTuple

import torch

from vlinfer import loading
from vlinfer.layers import ModelContext, ParallelLMHead, VocabParallelEmbedding
from vlinfer.layers.fused_moe import FusedMoE
from vlinfer.layers.linear import LinearBase
from vlinfer.layers.quantization import assign_methods, detect_quantization, kv_cache
from vlinfer.layers.quantization.gguf import GgufQuantization, assign_gguf_embeddings
from vlinfer.models import get_model_class
from vlinfer.models.interfaces import (Heads, OwnsWeightLoading, PagedAttentionBlock, PrefillOnly,
                                       SupportsFusedDecode, SupportsMultiModal, SupportsPooling)

logger = logging.getLogger("vlinfer")


class LoadedModel(NamedTuple):
    model: torch.nn.Module
    checkpoint_bytes_read: int  # this load's own count: two engines loading at once count apart


def load_model(source, hf_config, device: torch.device, ctx: ModelContext,
               quantization: str | None = None, pooling=None, tensors: dict | None = None,
               language_model_only: bool = False, mtp: bool = False) -> LoadedModel:
    """Build the model on ctx's op table for ctx.tp's rank (its shard of every split layer) and load
    that shard: split weights are read lazily, only the rank's rows or columns of each
    (loading.CheckpointSlice). Each linear layer's quantization method is chosen from the checkpoint
    (or `quantization`, "int8" / "int4" on load) before any weight is read, so a checkpoint vlinfer
    cannot run fails here, before the KV pool.

    A pooling model (engine/pooling.py PoolingSpec: task "embed" / "classify") is built with its
    LM head only where the checkpoint has one (generation requests may then share its engine);
    "classify" builds it with the head rows of its label_token_ids (layers/pooler.py), read from
    the LM head's table as it streams by. `tensors`: the checkpoint's
    loading.checkpoint_tensor_index where the caller has it (built here otherwise).
    language_model_only: a vision-language model is built without its vision tower (Heads).
    mtp: with the checkpoint's MTP head (speculative_config method "mtp", Heads.mtp)."""
    pooling_task = pooling.task if pooling is not None else None
    model_cls = get_model_class(hf_config)
    tensors = tensors if tensors is not None else loading.checkpoint_tensor_index(source, hf_config)
    # A config that lies about its sizes is refused before anything is allocated: its layer counts
    # against the checkpoint's tensors, then the bytes of a model built on the meta device (shapes
    # only) against its files.
    loading.check_layer_counts(hf_config, tensors, source)
    towers = _towers(model_cls, language_model_only)
    with torch.device("meta"):
        skeleton = model_cls(hf_config, ctx, towers)
    loading.check_model_size(
        sum(t.numel() * t.element_size() for t in (*skeleton.parameters(), *skeleton.buffers())),
        source)
    del skeleton
    head_table = loading.lm_head_table(tensors, hf_config)
    heads = replace(_heads(model_cls, pooling, head_table), vision_tower=towers.vision_tower,
                    mtp=mtp)
    # torch.device is thread-local: another engine building in another thread keeps its own device
    with torch.device(device):
        net = model_cls(hf_config, ctx, heads).eval()  # parameters in ctx.dtype
    quant = detect_quantization(hf_config, source.folder, tensors, quantization)
    with loading.fitting(source.path):
        if quant is not None:
            assign_methods(net, quant, tensors)
        elif not source.gguf_file:
            loading.check_float_tensors(tensors, source)
    # else GGUF files are dequantized on load, as before
    keep_gguf_blocks = isinstance(quant, GgufQuantization)
    if keep_gguf_blocks:
        with loading.fitting(source.path):
            assign_gguf_embeddings(net, tensors)
    counter = loading.ReadCounter()  # this load's own: two engines loading at once count apart
    weights = loading.iterate_weights(source, hf_config, lazy=True,
                                      keep_gguf_blocks=keep_gguf_blocks, counter=counter)
    if pooling_task is not None:
        weights = _pooling_weights(net, weights, head_table, keep_gguf_blocks)
    kv_scheme = kv_cache.detect_kv_cache_scheme(hf_config, source.folder)
    kv_scales = {}
    if kv_scheme is not None:  # its scale tensors go to the attention layers, not to load_weights
        weights = kv_cache.collect(weights, kv_scales)
    with loading.fitting(source.path):  # a tensor that does not fit its parameter
        if isinstance(net, OwnsWeightLoading):  # two towers, or MoE experts: routes its tensors
            net.load_weights(weights)
        else:
            loading.load_weights(net, weights)
    if kv_scheme is not None:
        kv_cache.attach(kv_scheme, kv_scales, decoder_attention(net),
                        use=ctx.kv_cache_dtype == kv_scheme.cache_dtype)
    return LoadedModel(net, counter.bytes)


def _towers(model_cls, language_model_only: bool) -> Heads:
    """Heads() with the vision tower left out under language_model_only (a text model has none to
    leave out: said in the log)."""
    if not language_model_only:
        return Heads()
    if not issubclass(model_cls, SupportsMultiModal):
        logger.info("language_model_only: %s has no vision tower; nothing to leave out",
                    model_cls.__name__)
        return Heads()
    logger.info("language_model_only: %s without its vision tower (its tensors skipped unread); "
                "requests with images or videos are refused", model_cls.__name__)
    return Heads(vision_tower=False)


def _heads(model_cls, pooling, head_table: str | None) -> Heads:
    """The heads the model is built with: without an LM head where a pooling model's checkpoint
    has none (an embedder saved without one: nothing to generate with); with a classifier's rows
    for "classify"."""
    if pooling is None:
        return Heads()
    if not issubclass(model_cls, SupportsPooling):
        raise ValueError(f"{model_cls.__name__} has no pooling heads: run it with "
                         "runner='generate'")
    if pooling.task != "classify":
        return Heads(lm_head=head_table is not None)
    if head_table is None:
        raise ValueError("a classification model needs its LM head's rows, and the checkpoint "
                         "has no lm_head.weight (nor a tied embedding)")
    return Heads(lm_head=True, classifier_token_ids=tuple(pooling.label_token_ids))


def _pooling_weights(net, weights, head_table: str | None, keep_gguf_blocks: bool):
    """A pooling model's checkpoint stream: the classifier's rows taken from the LM head's table on
    the way past (that tensor still goes on to its parameter); lm_head.weight dropped where the
    model keeps no LM head."""
    for name, tensor in weights:
        if net.classifier is not None and name == head_table:
            if keep_gguf_blocks:
                raise ValueError(
                    "a classification model from a GGUF file with its LM head kept in blocks is "
                    "not "
                    "supported")
            net.classifier.load_rows(tensor)
        if name == "lm_head.weight" and net.lm_head is None:
            continue
        yield name, tensor


def decoder_attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers' self-attention modules (their qkv_proj and paged Attention), in layer
    order."""
    return [m for m in model.modules() if isinstance(m, PagedAttentionBlock)]


def pack_weights(model: torch.nn.Module) -> None:
    """Give every linear layer and LM head the weight layout its op table prefers, once after
    loading; logged either way, so a model left on plain weights says so."""
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    embeddings = [m.weight for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    # Parts that never run a decode step (vision towers: whole images' patches) see only
    # prefill-sized row counts.
    prefill_only = {id(m) for part in model.modules() if isinstance(part, PrefillOnly)
                    for m in part.modules()}
    large_rows = [id(layer) in prefill_only for layer in linears]
    was_packed = [layer.pack_weight(large) for layer, large in zip(linears, large_rows)]
    packed = sum(was_packed)
    for head in (m for m in model.modules() if isinstance(m, ParallelLMHead)):
        tied = any(head.weight is w for w in embeddings)
        if head.pack_weight(tied) and tied:
            logger.info(
                "LM head tied to the embedding: a packed copy for the logits matmul (+%.0f MiB)",
                head.weight.numel() * head.weight.element_size() / 2**20)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if experts:
        packed_experts = sum(layer.pack_weight() for layer in experts)
        logger.info("%d of %d MoE expert layers packed for %s", packed_experts, len(experts),
                    experts[0].ops.name)
    for decoder in (m for m in model.modules() if isinstance(m, SupportsFusedDecode)):
        if decoder.fuse_decode():
            logger.info("decode steps run all %d decoder layers in one op call (%s)",
                        len(decoder.layers), decoder.ctx.ops.name)
        else:
            reason = f"{decoder.ctx.ops.name} has no fused form for them" + (
                f" over a KV cache stored in {decoder.ctx.kv_cache_dtype}"
                if decoder.ctx.kv_cache_quantized else "")
            logger.info("decode steps run the %d decoder layers module by module (%s)",
                        len(decoder.layers), reason)
    if linears:
        dtype = linears[0].params_dtype
        if packed:
            logger.info(
                "%d of %d linear weights packed for %s (%s); %d of the %d in parts that run "
                "prefill only "
                "kept plain", packed, len(linears), linears[0].ops.name, dtype,
                sum(large and not p for large, p in zip(large_rows, was_packed)), sum(large_rows))
        else:
            logger.info(
                "linear layers keep plain %s weights (%s has no packed layout for them here)",
                dtype, linears[0].ops.name)
