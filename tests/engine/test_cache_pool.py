"""The cache pool (engine/cache_pool.py) without a model: what it allocates, binds and costs per
block and slot."""
import pytest
import torch

from vlinfer.engine.cache_pool import CachePool, PagedKVSpec, StateSlotSpec, kv_bytes_per_token
from vlinfer.layers import Attention, ModelContext
from vlinfer.layers.quantization.kv_cache import StaticKVScales
from vlinfer.ops.reference import ReferenceOps

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 3, 2, 8, 4


def pool(dtype, quantized, dummy=0, states=()):
    ctx = ModelContext(ReferenceOps(), dtype=torch.float32, kv_cache_dtype=dtype)
    layers = tuple(Attention(ctx, 4, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS) for _ in range(LAYERS))
    spec = PagedKVSpec(layers, dtype, quantized)
    return CachePool([spec, *states], BLOCK, torch.device("cpu"), ctx.ops, num_dummy_blocks=dummy)


@pytest.mark.parametrize("dtype,quantized,row_bytes", [(torch.float32, False, HEAD_DIM * 4),
                                                       (torch.bfloat16, False, HEAD_DIM * 2),
                                                       (torch.int8, True, HEAD_DIM + 4),
                                                       (torch.float8_e4m3fn, True, HEAD_DIM)])
def test_allocation_and_bytes_per_block(dtype, quantized, row_bytes):
    p = pool(dtype, quantized, dummy=1)
    # K and V rows of every layer and KV head, for each of a block's tokens (int8: plus a float32
    # scale per row)
    assert p.bytes_per_block == 2 * LAYERS * KV_HEADS * BLOCK * row_bytes
    assert p.bytes_per_block == BLOCK * kv_bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, dtype)
    assert p.bytes_per_slot == 0
    p.allocate(5)
    assert p.kv_cache.shape == (2, LAYERS, 5 + 1, BLOCK, KV_HEADS, HEAD_DIM)
    assert p.kv_cache.dtype == dtype
    assert p.dummy_block == 5
    for i, layer in enumerate(p.layers):
        assert layer.k_cache.data_ptr() == p.kv_cache[0, i].data_ptr()
        assert layer.v_cache.data_ptr() == p.kv_cache[1, i].data_ptr()
    if dtype == torch.int8:  # one scale per token and KV head, 1.0
        assert p.kv_scales.shape == (2, LAYERS, 6, BLOCK, KV_HEADS)
        assert bool((p.kv_scales == 1).all())
        assert p.layers[1].k_scale.data_ptr() == p.kv_scales[0, 1].data_ptr()
    elif quantized:  # fp8: one per layer for K and for V
        assert p.kv_scales.shape == (2, LAYERS) and bool((p.kv_scales == 1).all())
    else:
        assert p.kv_scales is None and all(layer.k_scale is None for layer in p.layers)
    # what it holds per block is what sizing counts per block (fp8: plus its per-layer pair, not per
    # block)
    per_layer = 2 * LAYERS * 4 if quantized and dtype != torch.int8 else 0
    assert p.nbytes == 6 * p.bytes_per_block + per_layer
    p.release()
    assert p.kv_cache is None and p.nbytes == 0
    assert all(layer.k_cache.numel() == 0 for layer in p.layers)


def test_fp8_static_scales_fill_the_layers_pair():
    p = pool(torch.float8_e4m3fn, True)
    scales = StaticKVScales(k_scale=torch.tensor(0.5), v_scale=torch.tensor(0.25))
    p.layers[2].static_kv_scales = scales
    p.allocate(2)
    assert p.kv_scales[:, 2].tolist() == [0.5, 0.25] and p.kv_scales[:, 0].tolist() == [1.0, 1.0]


def test_capacity_line():
    p = pool(torch.bfloat16, False)
    mib = 4096 * p.bytes_per_block / 2 ** 20
    assert p.capacity(4096, " per rank") == (f"4096 blocks of {BLOCK} tokens in bfloat16 "
                                             f"({mib:.1f} MiB per rank, {4096 * BLOCK} tokens)")


def test_state_slots_are_sized_allocated_and_bound():
    """A state spec costs bytes per sequence slot, counted beside the blocks; allocated, each
    layer gets its views [slots, *shape] of one zeroed tensor per shape."""
    state = StateSlotSpec(num_layers=2, shapes=((6, 3), (2, 4, 5)))
    assert state.bytes_per_slot == 2 * (6 * 3 + 2 * 4 * 5) * 4
    p = pool(torch.float32, False, states=[state])
    assert p.bytes_per_slot == state.bytes_per_slot
    with pytest.raises(ValueError, match="state slot"):
        p.allocate(1)

    class StateLayer:
        state_shapes = ((6, 3), (2, 4, 5))
        state_dtypes = (torch.float32, torch.float32)
        states = ()

    layers = [StateLayer(), StateLayer()]
    p = pool(torch.float32, False, states=[StateSlotSpec.of_layers(layers)])
    p.allocate(2, num_slots=3)
    assert p.num_slots == 3 and p.bytes_per_slot == state.bytes_per_slot
    conv, recurrent = p.state_tensors[0]
    assert conv.shape == (2, 3, 6, 3) and recurrent.shape == (2, 3, 2, 4, 5)
    assert conv.dtype == torch.float32 and not conv.any()
    for i, layer in enumerate(layers):
        assert layer.states[0].data_ptr() == conv[i].data_ptr()
        assert layer.states[1].data_ptr() == recurrent[i].data_ptr()
    assert p.nbytes == 2 * p.bytes_per_block + 3 * p.bytes_per_slot
    assert "3 state slots in float32/float32" in p.slot_capacity(3)
    p.release()
    assert all(layer.states == () for layer in layers) and p.nbytes == 0


def test_state_tensors_take_their_own_dtypes():
    """A 16-bit recurrent state (mamba_ssm_cache_dtype) beside a float32 conv state: each tensor
    in its dtype, the bytes counted per tensor, both dtypes in the capacity line."""
    state = StateSlotSpec(num_layers=2, shapes=((6, 3), (2, 4, 5)),
                          dtypes=(torch.float32, torch.bfloat16))
    assert state.bytes_per_slot == 2 * (6 * 3 * 4 + 2 * 4 * 5 * 2)
    p = pool(torch.float32, False, states=[state])
    p.allocate(2, num_slots=3)
    conv, recurrent = p.state_tensors[0]
    assert conv.dtype == torch.float32 and recurrent.dtype == torch.bfloat16
    assert p.nbytes == 2 * p.bytes_per_block + 3 * state.bytes_per_slot
    assert "3 state slots in float32/bfloat16" in p.slot_capacity(3)
    with pytest.raises(ValueError, match="differ in length"):
        StateSlotSpec(num_layers=2, shapes=((6, 3), (2, 4, 5)), dtypes=(torch.float32,))


def test_a_state_dtype_without_kernels_is_said_once(caplog):
    """A table whose linear-attention kernels take a float32 state only (the CPU's) runs the
    reference for a bf16 one: one warning at load; a float32 state, none."""
    import logging
    ops = ReferenceOps()
    ops.state_cache_kernels, ops.name = (torch.float32,), "cpu-compiled"
    ctx = ModelContext(ops, dtype=torch.float32)
    kv = PagedKVSpec((Attention(ctx, 2, 8, 1.0, 1),), torch.float32)
    for dtype, said in ((torch.float32, 0), (torch.bfloat16, 1)):
        caplog.clear()
        state = StateSlotSpec(num_layers=1, shapes=((6, 3), (2, 4, 5)),
                              dtypes=(torch.float32, dtype))
        with caplog.at_level(logging.INFO, logger="vlinfer"):
            CachePool([kv, state], BLOCK, torch.device("cpu"), ops)
        assert caplog.text.count("recurrent state in bfloat16; cpu-compiled's linear-attention "
                                 "decode kernels take float32 only") == said


def test_one_paged_group():
    with pytest.raises(ValueError, match="one paged KV spec"):
        CachePool([], BLOCK, torch.device("cpu"), ReferenceOps())


def test_sizing_takes_the_slots_first_and_caps_max_num_seqs(caplog):
    """engine/sizing.py with a hybrid pool: slots out of the budget first, max_num_seqs capped to
    those the budget holds beside one sequence's blocks, prefix caching off, both capacities
    logged; a budget without room for one slot fails, naming the state."""
    import logging
    from types import SimpleNamespace

    from vlinfer.config import EngineConfig
    from vlinfer.engine import sizing
    state = StateSlotSpec(num_layers=2, shapes=((6, 3), (2, 4, 5)))
    p = pool(torch.float32, False, states=[state])
    runner = SimpleNamespace(cache_pool=p, device=torch.device("cpu"))
    per_seq = 16 // BLOCK * p.bytes_per_block  # max_model_len 16
    config = EngineConfig(model="x", max_model_len=16, max_num_seqs=8,
                          kv_cache_bytes=per_seq + 3 * p.bytes_per_slot)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        resolved = sizing.resolve(config, torch.float32, 16, 16, BLOCK, runner)
    assert resolved.num_state_slots == resolved.max_num_seqs == 3
    assert resolved.num_blocks == 16 // BLOCK and not resolved.enable_prefix_caching
    assert "max_num_seqs=8 capped to 3" in caplog.text and "3 state slots" in caplog.text
    assert "prefix caching: off" in caplog.text
    small = EngineConfig(model="x", max_model_len=16, kv_cache_bytes=per_seq)
    with pytest.raises(ValueError, match="one sequence's state"):
        sizing.resolve(small, torch.float32, 16, 16, BLOCK, runner)
    plain = SimpleNamespace(cache_pool=pool(torch.float32, False), device=torch.device("cpu"))
    resolved = sizing.resolve(EngineConfig(model="x", max_model_len=16, max_num_seqs=8,
                                           kv_cache_bytes=per_seq), torch.float32, 16, 16, BLOCK,
                              plain)
    assert resolved.num_state_slots == 0 and resolved.max_num_seqs == 8
    assert resolved.enable_prefix_caching
