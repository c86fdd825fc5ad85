// Dense linear layers on weights packed once at load into 32-output panels (cpu/csrc/panels.h;
// ops/cpu/backend.py pack_linear_weight): y = x @ w^T (+ bias), float32 on AVX-512 builds, bf16 on
// AVX512-BF16 builds.
//
// Why ours and not oneDNN's prepacked linear: at the row counts of decode steps oneDNN's blocked
// GEMV/GEMM streams the weights at about half of the memory's rate (SmolLM2-135M's 121 linears at
// one row: ~30 against ~55 GB/s for a plain sum on the same machine). Panels read each weight once,
// front to back, every loaded vector feeding all of a tile's rows. Measured on the 2-vCPU EPYC
// (AVX512-BF16, no AMX), SmolLM2's linears, panels against oneDNN: float32 1 row 1.2-1.5x, 16
// rows 1.3-1.8x, 64 rows 1.3x, 512 rows equal; bf16 1 row 1.9x, 16 rows 1.35x, 64 rows 1.2x, 512
// rows 1.1x. On Qwen3-VL-2B's [12288 x 2048] and [2048 x 6144] at 512 rows oneDNN led by 12-13% (a
// panel past L2): ops/cpu/backend.py packs panels only up to 256 KB each.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "panels.h"

namespace {

constexpr int64_t kRowBlock =
  64;  // rows per work item: large row counts split over the cores by rows too

#if defined(__AVX512F__)
template <typename T>
void panel_linear_impl(const at::Tensor& x, const at::Tensor& panels, const float* bias,
                       at::Tensor& out) {
  const int64_t rows = x.size(0), n_panels = panels.size(0), n = n_panels * kPanel;
  const int64_t k = std::is_same_v<T, float> ? panels.size(1) : panels.size(1) * 2;
  const int64_t panel_stride = k * kPanel;
  const T* xp = x.data_ptr<T>();
  const T* wp = panels.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Work items: (block of kRowBlock rows, `group` adjacent panels). Up to 4 rows, two panels: 64
  // outputs, two contiguous streams, every loaded x value feeding both. Past 4 rows the tiles take
  // one panel at a time anyway (panel_rows), so items hold one panel: the cores then share a
  // projection with few panels evenly (SmolLM2's 576 outputs are 9 pairs, 5 + 4 on two cores: 64
  // rows ran at 68% of the 2-core rate, against 96% for 3072 outputs).
  const int64_t group = rows <= 4 ? 2 : 1;
  const int64_t groups = (n_panels + group - 1) / group,
                blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = (item % groups) * group, r0 = (item / groups) * kRowBlock;
      const int64_t r = std::min(kRowBlock, rows - r0);
      const T* w = wp + p * panel_stride;
      const float* b = bias ? bias + p * kPanel : nullptr;
      T* o = op + r0 * n + p * kPanel;
      if (group == 2 && p + 1 < n_panels)
        panel_rows<2>(xp + r0 * k, r, k, w, panel_stride, b, o, n);
      else panel_rows<1>(xp + r0 * k, r, k, w, panel_stride, b, o, n);
    }
  });
}
#endif

}  // namespace

bool panel_linear_available(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

// x [M, K]; panels float32 [N / 32, K, 32] or bf16 [N / 32, K / 2, 32, 2] (ops/cpu/backend.py
// pack_linear_weight); bias [N] or none. Returns [M, N] in x's dtype.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias) {
  const auto dtype = panels.scalar_type();
  TORCH_CHECK(panel_linear_available(dtype), "panel_linear: this build of the CPU kernels has no ",
              dtype, " panels (float32 needs AVX-512, bf16 AVX512-BF16)");
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == (bf16 ? 4 : 3) && panels.size(2) == 32 &&
                (!bf16 || panels.size(3) == 2),
              "panel_linear: panels must be contiguous float32 [N / 32, K, 32] or bf16 [N / 32, K "
              "/ 2, 32, 2], got ",
              dtype, " ", panels.sizes());
  const int64_t k = bf16 ? panels.size(1) * 2 : panels.size(1), n = panels.size(0) * 32;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == dtype,
              "panel_linear: x must be ", dtype, " [M, ", k, "], got ", x.scalar_type(), " ",
              x.sizes());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "panel_linear: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto xc = x.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
#if defined(__AVX512F__)
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (bf16) {
#if defined(__AVX512BF16__)
    panel_linear_impl<c10::BFloat16>(xc, panels, bp, out);
#endif
  } else {
    panel_linear_impl<float>(xc, panels, bp, out);
  }
#endif
  return out;
}
