"""Dense linears on the CPU: `pack_linear_weight` lays a projection's weight out once, as our
32-output panels (panels.py, csrc/panel_linear.cpp) or oneDNN's blocked layout, and `linear` runs
whichever the layer holds. Why both beat F.linear, and where each leads, bench/linear_rates.py
re-derives (docs/benchmarks.md "Kernel decisions")."""
import torch
import torch.nn.functional as F

from vlinfer.ops.cpu import panels

# dtypes whose prepacked linear oneDNN runs (bf16 needs AVX512-BF16 or AMX, checked at packing time)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Largest panel (32 x K weights) a dense linear takes panels for: the 8-row tiles re-read it from L2
# (1 MB here); past it oneDNN led at prefill sizes (csrc/panel_linear.cpp).
PANEL_BYTES = 256 * 1024


LARGE_ROWS_STEP = 512  # above this many rows, a prepacked linear's buckets are its multiples


def linear_rows_bucket(rows: int) -> int:
    """The row count a prepacked linear runs at: 1-8 exact (single streams and small batches pay
    nothing), then powers of two to 64, multiples of 64 to 512, multiples of 512 above (chunked
    prefill sizes)."""
    if rows <= 8:
        return rows
    if rows <= 64:
        return 1 << (rows - 1).bit_length()
    step = 64 if rows <= LARGE_ROWS_STEP else LARGE_ROWS_STEP
    return -(-rows // step) * step


def linear_row_blocks(rows: int) -> list[int]:
    """The row blocks a prepacked linear runs `rows` rows in, each padded to its bucket: one block;
    or, above LARGE_ROWS_STEP rows, whole blocks of LARGE_ROWS_STEP rows and then the rest in its
    own smaller bucket where that pads fewer rows: the same kernels, at most 63 padding rows instead
    of up to 511 (3152 vision rows ran as 3584)."""
    head = rows // LARGE_ROWS_STEP * LARGE_ROWS_STEP
    if rows > LARGE_ROWS_STEP and linear_rows_bucket(rows - head) - (
            rows - head) < linear_rows_bucket(rows) - rows:
        return [head, rows - head]
    return [rows]


def linear(ext, x, weight, bias=None):
    """x @ weight.T + bias on the weight as pack_linear_weight left it: our panels, oneDNN's blocked
    layout (rows padded to a few buckets), or the plain weight (F.linear)."""
    if not weight.is_mkldnn and weight.dim() > 2:  # 32-output panels (pack_linear_weight)
        y = ext.panel_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], y.shape[-1])
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    rows = x.shape[0] if x.dim() == 2 else 0
    blocks = linear_row_blocks(rows)
    if len(blocks) > 1:
        return torch.cat([linear(ext, block, weight, bias) for block in x.split(blocks)])
    padded = linear_rows_bucket(rows)
    if padded == rows or rows == 0:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    # oneDNN JITs (and keeps) one kernel per distinct row count of a prepacked linear, about half a
    # MiB each: under continuous batching every new batch size grew the process. Rows padded to a
    # few buckets bound that; rows are independent in a matmul, so the padding changes no real row's
    # result. Only the padding rows are zeroed: a whole zeroed buffer cost 8% of a video prefill in
    # fills (profiled, [13824, 4096] vision MLP inputs).
    x_padded = x.new_empty(padded, x.shape[1])
    x_padded[:rows] = x
    x_padded[rows:].zero_()
    return torch.ops.mkldnn._linear_pointwise(x_padded, weight, bias, "none", [], "")[:rows]


def pack_linear_weight(weight: torch.Tensor, large_rows: bool, panel_dtypes: tuple,
                       bf16_linear: bool) -> torch.Tensor | None:
    """Our 32-output panels of a [out, in] weight where the kernels run them (panel_dtypes: CpuOps
    decides) and the shape fits (whole panels, pairs of k, a panel of at most PANEL_BYTES); else
    oneDNN's blocked layout; None where this CPU / torch build has neither for its dtype, and for
    float32 weights of layers that only run large row counts (the layer then keeps F.linear;
    pack_weights logs which)."""
    if weight.is_mkldnn or weight.dim() != 2:
        return None
    if large_rows and weight.dtype == torch.float32:
        # Both packed layouts pay off at decode's few rows; from a few hundred rows up, MKL's sgemm
        # behind F.linear on the plain weight is the faster float32 kernel (docs/benchmarks.md).
        return None
    n, k = weight.shape
    if weight.dtype in panel_dtypes and n % panels.PANEL == 0 and k % 2 == 0 and \
            panels.PANEL * k * weight.element_size() <= PANEL_BYTES:
        return panels.to_panels(weight.detach())
    if weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not bf16_linear:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
