"""The 32-output panel layout our CPU kernels run dense linears and MoE experts on (csrc/panels.h):
a panel holds 32 consecutive output rows of a [N, K] weight, k-major. float32: [N / 32, K, 32];
bf16: [N / 32, K / 2, 32, 2] (per pair of k, the 32 outputs' two weights side by side, as vdpbf16ps
reads them). Leading dims (experts) stay."""
import torch

PANEL = 32  # outputs per panel


def to_panels(w: torch.Tensor, width: int = PANEL) -> torch.Tensor:
    """[..., N, K] -> [..., N / 32, K, 32] (float32) or [..., N / 32, K / 2, 32, 2] (bf16); N a
    multiple of 32, K even for bf16. width: outputs per panel other than 32 (the LoRA shrink's 16,
    csrc/lora_panels.cpp)."""
    *lead, n, k = w.shape
    if w.dtype == torch.bfloat16:
        return w.reshape(*lead, n // width, width, k // 2, 2).transpose(-3, -2).contiguous()
    return w.reshape(*lead, n // width, width, k).transpose(-2, -1).contiguous()


def plain_shape(panels: torch.Tensor) -> torch.Size:
    """The [..., N, K] shape to_panels packed."""
    if panels.dtype == torch.bfloat16:
        *lead, n_panels, pairs, panel, two = panels.shape
        return torch.Size((*lead, n_panels * panel, pairs * two))
    *lead, n_panels, k, panel = panels.shape
    return torch.Size((*lead, n_panels * panel, k))
