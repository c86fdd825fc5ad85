// The experts' matmuls of a MoE layer on few rows per expert (decode steps, small batches): out[p]
// = x[p] @ w[e]^T for the rows p that ops/cpu/moe.py sorted into expert e's group, weights in the
// checkpoint's [E, N, K] layout.
//
// Why ours: a decode step of a 128-expert layer gives each active expert one to a few rows, so the
// layer is a read of every active expert's weights, bound by memory bandwidth. torch._grouped_mm
// ran those reads at ~12 GB/s here (half of this machine's bandwidth); this kernel streams each
// active expert's weight rows once, both cores on disjoint row blocks, and reuses every loaded
// weight vector for all the rows of its group (up to kRows at a time; more rows re-read the block
// from cache). Past a few dozen rows per expert the work is matmul-shaped and ops/cpu/moe.py hands
// it to oneDNN instead.
//
// expert_panel_matmul is the same product on weights repacked once at load into 32-output panels
// (ops/cpu/moe.py pack_moe_weights, bf16 on AVX512-BF16 builds of CPUs without AMX; the tiles in
// panels.h): each panel holds, per pair of k, the 32 outputs' two weights side by side, so one
// 64-byte load feeds vdpbf16ps for 16 outputs against a broadcast pair of x: no horizontal sums,
// and each work item streams one contiguous panel. It runs every group size, decode and prefill
// alike. Measured on the 2-vCPU EPYC (AVX512-BF16, no AMX), 128 experts, H 2048, I 768, 32 tokens x
// top-8 (110 active experts): gate/up 20.6 -> 12.7-16.5 ms, down 12.4 -> 7.0-9.0 ms against
// expert_matmul; 512 tokens: 65-71 -> 44-48 ms and 35-43 -> 22-25 ms against torch._grouped_mm
// (~580 against ~380 GFLOP/s).
//
// float32 accumulation. AVX512-BF16 builds run bf16 through vdpbf16ps (bf16 pair products into
// float32 lanes); every other build and dtype runs a plain loop the compiler vectorizes for its
// level (-ffast-math allows the reassociated sums), bf16 widened to float32 exactly. Semantics:
// ops/moe_reference.fused_moe's two projections.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "panels.h"
#include "tile_sizes.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define VLINFER_BF16_EXPERTS 1
#endif

namespace {

constexpr int64_t kRows = 4;      // rows of one group sharing each weight load
constexpr int64_t kCols = 4;  // weight rows per microkernel (kRows x kCols float32 accumulators)
constexpr int64_t kBlockN =
  64;  // weight rows per work item (64 x K bf16: 256 KB at K = 2048, kept in L2)
// Elements ahead each weight row is prefetched. The hardware prefetcher ramps up late on the down
// projection's short rows (768 bf16, 24 lines each, four rows read side by side): 10 -> 12.5-16
// GB/s with it, the gate/up rows (2048) unchanged (2-vCPU Xeon, three alternating runs).
constexpr int64_t kPrefetch = 384;

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

// rows x cols outputs: out[r * ldo + c] = dot(x[r], w[c]) over k, any dtype, vectorized by the
// compiler.
template <typename T>
void tile_generic(const T* x, int64_t rows, const T* w, int64_t cols, int64_t k, T* out,
                  int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * k;
    for (int64_t c = 0; c < cols; ++c) {
      const T* wc = w + c * k;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < k; ++i) acc += widen(xr[i]) * widen(wc[i]);
      out[r * ldo + c] = static_cast<T>(acc);
    }
  }
}

#ifdef VLINFER_BF16_EXPERTS
// kRows x kCols dot products of length k on vdpbf16ps: each 32-element weight vector is loaded once
// for all rows. The tail (k % 32) is a masked load; zeros add nothing.
template <int R, int C>
inline void tile_bf16(const uint16_t* x, const uint16_t* w, int64_t k, c10::BFloat16* out,
                      int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * k + i);
    for (int c = 0; c < C; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(w + c * k + i + kPrefetch), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  if (i < k) {
    const __mmask32 tail = (__mmask32)((1ull << (k - i)) - 1);
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + c * k + i);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      out[r * ldo + c] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r][c]));
}

// Rows x cols of any size up to kRows x kCols, on the fixed-size tile.
void tile(const c10::BFloat16* x, int64_t rows, const c10::BFloat16* w, int64_t cols, int64_t k,
          c10::BFloat16* out, int64_t ldo) {
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  const auto* ws = reinterpret_cast<const uint16_t*>(w);
  with_tile_size(rows, cols, [&](auto r, auto c) {
    tile_bf16<decltype(r)::value, decltype(c)::value>(xs, ws, k, out, ldo);
  });
}
#endif

template <typename T>
void tile(const T* x, int64_t rows, const T* w, int64_t cols, int64_t k, T* out, int64_t ldo) {
  tile_generic(x, rows, w, cols, k, out, ldo);
}

template <typename T>
void expert_matmul_impl(const at::Tensor& x, const at::Tensor& w,
                        const std::vector<int64_t>& bounds, at::Tensor& out) {
  const int64_t experts = w.size(0), n = w.size(1), k = w.size(2);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Work items: (expert with rows, block of kBlockN weight rows). Each reads its weight block once
  // from memory.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t e = 0; e < experts; ++e) {
    if (bounds[e + 1] > bounds[e]) {
      for (int64_t n0 = 0; n0 < n; n0 += kBlockN) items.emplace_back(e, n0);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [e, n0] = items[item];
      const int64_t n1 = std::min(n, n0 + kBlockN);
      const T* we = wp + e * n * k;
      for (int64_t r0 = bounds[e]; r0 < bounds[e + 1]; r0 += kRows) {
        const int64_t rows = std::min(kRows, bounds[e + 1] - r0);
        for (int64_t c0 = n0; c0 < n1; c0 += kCols) {
          tile(xp + r0 * k, rows, we + c0 * k, std::min(kCols, n1 - c0), k, op + r0 * n + c0, n);
        }
      }
    }
  });
}

// The groups' row bounds from ends [E] int32 (the cumulative row count at each expert's end),
// checked against the row count, and the [rows, n] output with the rows past the last group (no
// expert's) zeroed.
std::vector<int64_t> group_bounds(const at::Tensor& ends, int64_t experts, int64_t rows,
                                  const char* name) {
  TORCH_CHECK(ends.dim() == 1 && ends.size(0) == experts && ends.scalar_type() == at::kInt, name,
              ": ends must be int32 [E]");
  auto ends_c = ends.contiguous();
  const int32_t* ep = ends_c.data_ptr<int32_t>();
  std::vector<int64_t> bounds(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    bounds[e + 1] = ep[e];
    TORCH_CHECK(bounds[e + 1] >= bounds[e] && bounds[e + 1] <= rows, name,
                ": ends must be non-decreasing and at "
                "most the row count");
  }
  return bounds;
}

at::Tensor group_output(const at::Tensor& x, int64_t n, const std::vector<int64_t>& bounds) {
  auto out = at::empty({x.size(0), n}, x.options());
  out.narrow(0, bounds.back(), x.size(0) - bounds.back()).zero_();
  return out;
}

}  // namespace

// x [P, K] rows sorted by expert; w [E, N, K]; ends [E] int32, the cumulative row count at each
// expert's end (what torch._grouped_mm calls offs). Returns [P, N]: row p times its expert's w^T.
at::Tensor expert_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2),
              "expert_matmul: x must be [P, K] and w [E, N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "expert_matmul: x and w must share a dtype");
  const auto bounds = group_bounds(ends, w.size(0), x.size(0), "expert_matmul");
  TORCH_CHECK(w.is_contiguous(), "expert_matmul: w must be contiguous");
  auto xc = x.contiguous();
  auto out = group_output(x, w.size(1), bounds);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "expert_matmul", [&] {
    expert_matmul_impl<scalar_t>(xc, w, bounds, out);
  });
  return out;
}

// x [P, K] bf16 rows sorted by expert; panels [E, N / 32, K / 2, 32, 2] bf16 (ops/cpu/moe.py
// pack_moe_weights); ends as for expert_matmul. Returns [P, N]. AVX512-BF16 builds only.
at::Tensor expert_panel_matmul(const at::Tensor& x, const at::Tensor& panels,
                               const at::Tensor& ends) {
#ifdef VLINFER_BF16_EXPERTS
  TORCH_CHECK(panels.dim() == 5 && panels.size(3) == kPanel && panels.size(4) == 2 &&
                panels.is_contiguous() && panels.scalar_type() == at::kBFloat16,
              "expert_panel_matmul: panels must be contiguous bf16 [E, N / 32, K / 2, 32, 2], got ",
              panels.scalar_type(), " ", panels.sizes());
  const int64_t experts = panels.size(0), n_panels = panels.size(1), k = panels.size(2) * 2,
                n = n_panels * kPanel;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "expert_panel_matmul: x must be bf16 [P, ", k, "], got ", x.scalar_type(), " ",
              x.sizes());
  const auto bounds = group_bounds(ends, experts, x.size(0), "expert_panel_matmul");
  auto xc = x.contiguous();
  auto out = group_output(x, n, bounds);
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  const auto* wp = panels.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t panel_stride = k * kPanel;
  // Work items: (expert with rows, two adjacent panels): 64 outputs, two contiguous streams.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t e = 0; e < experts; ++e)
    if (bounds[e + 1] > bounds[e])
      for (int64_t p = 0; p < n_panels; p += 2) items.emplace_back(e, p);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [e, p] = items[item];
      const c10::BFloat16* w = wp + (e * n_panels + p) * panel_stride;
      const c10::BFloat16* xe = xp + bounds[e] * k;
      c10::BFloat16* oe = op + bounds[e] * n + p * kPanel;
      const int64_t rows = bounds[e + 1] - bounds[e];
      if (p + 1 < n_panels) panel_rows<2>(xe, rows, k, w, panel_stride, nullptr, oe, n);
      else panel_rows<1>(xe, rows, k, w, panel_stride, nullptr, oe, n);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "expert_panel_matmul needs an AVX512-BF16 build of the CPU kernels");
  return x;
#endif
}

bool expert_panels_available() {
#ifdef VLINFER_BF16_EXPERTS
  return true;
#else
  return false;
#endif
}
