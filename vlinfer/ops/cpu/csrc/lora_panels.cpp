// LoRA updates of a step's rows on the slots' A packed in 16-output panels and B in 32-output
// panels (panels.h's layout; packed by ops/cpu/lora.py pack and repack_slot): y[t] += (x[t] @
// A[s]^T) @ B[s]^T for each row t of slot s, in one call, each row against its own slot only (the
// gather form, no work for other slots).
//
// Why: at decode sizes (tens of rows, rank 16) the update is a few MFLOP a layer, and a library
// GEMM call costs more than the work: oneDNN's shrink, expand and add took 1.1-1.4x the time of the
// base projection they follow (docs/benchmarks.md, "LoRA updates"). Here the rows of one slot share
// that slot's panels, read from L1 / L2.
//
// Roundings: the shrink is rounded to x's dtype, as the reference rounds it; the expand is added to
// y in float32 and rounded once (the reference rounds the expand, then the sum).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "panels.h"

bool panel_linear_available(at::ScalarType dtype);  // cpu/csrc/panel_linear.cpp

namespace {

constexpr int kLoRAPanel =
  32;  // expand outputs per panel (as panels.h's kPanel, which non-AVX-512 builds lack)
constexpr int kLoRARankPanel =
  16;  // shrink outputs per panel: ranks come in 16s (a 32-wide one pads rank 16)
constexpr int64_t kLoRARowBlock =
  16;  // rows per work item: a decode step's slot groups split over the cores

struct Segment {
  int64_t slot, start,
    count;  // rows [start, start + count) of the step's adapter rows run slot `slot`
};

#if defined(__AVX512F__)
inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
#if defined(__AVX512BF16__)
inline __m512 load_row16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// R rows (each its own pointer: gathered rows need no copy) times one panel of W outputs (16 or 32)
// over k: out[r][0..W) = the products, or, with kAdd, out[r] + the products (one rounding). Panel
// layout as panels.h's, W outputs wide: float32 [k][W], bf16 [k / 2][W][2].
template <int R, int W, bool kAdd, typename T>
inline void rows_times_panel(const T* const* x, int64_t k, const T* w, T* const* out) {
  constexpr int C = W / 16;  // accumulators per row
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = kAdd ? load_row16(out[r] + 16 * c) : _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < k; ++i) {
      __m512 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + i * W + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r][i]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
  } else {
#if defined(__AVX512BF16__)
    const auto* w16 = reinterpret_cast<const uint16_t*>(w);
    for (int64_t kp = 0; kp < k / 2; ++kp) {
      __m512bh wv[C];
      for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w16 + kp * 2 * W + 32 * c);
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // x[r][2kp], x[r][2kp + 1] as one 32-bit lane
        std::memcpy(&pair, reinterpret_cast<const uint16_t*>(x[r]) + 2 * kp, sizeof(pair));
        const auto xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
      }
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(out[r] + 16 * c, acc[r][c]);
}

// For every segment, its rows (in_rows[i]: row i's input, k elements) times its slot's panels of W
// outputs, into out_rows[i] (+ p * W for panel p; added to what is there with kAdd). Work items:
// (segment, block of rows, panel). k_ranges: per panel, the [begin, end) of k that can be non-zero
// (a fused layer's sub-projection reads only its own rank columns), or null: all of k.
template <int W, bool kAdd, typename T>
void segments_times_panels(const std::vector<Segment>& segments,
                           const std::vector<const T*>& in_rows, int64_t k, const T* panels,
                           int64_t slot_stride, int64_t n_panels, const int32_t* k_ranges,
                           const std::vector<T*>& out_rows) {
  std::vector<int64_t> first_item{0};  // each segment's first work item
  for (const auto& s : segments)
    first_item.push_back(first_item.back() +
                         (s.count + kLoRARowBlock - 1) / kLoRARowBlock * n_panels);
  at::parallel_for(0, first_item.back(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const size_t i =
        std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const Segment& s = segments[i];
      const int64_t local = item - first_item[i], p = local % n_panels;
      const int64_t r_end =
        std::min(s.start + s.count, s.start + (local / n_panels + 1) * kLoRARowBlock);
      const int64_t k0 = k_ranges ? k_ranges[2 * p] : 0, k1 = k_ranges ? k_ranges[2 * p + 1] : k;
      const T* w = panels + s.slot * slot_stride + p * k * W + k0 * W;  // k0 even: whole bf16 pairs
      for (int64_t r0 = s.start + (local / n_panels) * kLoRARowBlock; r0 < r_end; r0 += 4) {
        const T* in[4];
        T* out[4];
        for (int64_t r = 0; r < std::min<int64_t>(4, r_end - r0); ++r) {
          in[r] = in_rows[r0 + r] + k0;
          out[r] = out_rows[r0 + r] + p * W;
        }
        with_rows(std::min<int64_t>(4, r_end - r0), [&](auto r) {
          rows_times_panel<decltype(r)::value, W, kAdd>(in, k1 - k0, w, out);
        });
      }
    }
  });
}

// The shrink of every adapter row into `shrink` [N, rank] (rounded to T), then its expand added
// into y's rows.
template <typename T>
void lora_rows(const std::vector<Segment>& segments, const at::Tensor& x, at::Tensor& y,
               const int64_t* rows, int64_t n_rows, const at::Tensor& a_panels,
               const at::Tensor& b_panels, const int32_t* k_ranges, int64_t rank) {
  const int64_t in = x.size(1), out = y.size(1);
  auto shrink = at::empty({n_rows, rank}, x.options());
  std::vector<const T*> x_rows(n_rows), shrink_in(n_rows);
  std::vector<T*> shrink_out(n_rows), y_rows(n_rows);
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t row = rows ? rows[i] : i;
    x_rows[i] = x.data_ptr<T>() + row * in;
    y_rows[i] = y.data_ptr<T>() + row * out;
    shrink_out[i] = shrink.data_ptr<T>() + i * rank;
    shrink_in[i] = shrink_out[i];
  }
  segments_times_panels<kLoRARankPanel, false, T>(segments, x_rows, in, a_panels.data_ptr<T>(),
                                                  a_panels[0].numel(), rank / kLoRARankPanel,
                                                  nullptr, shrink_out);
  segments_times_panels<kLoRAPanel, true, T>(segments, shrink_in, rank, b_panels.data_ptr<T>(),
                                             b_panels[0].numel(), out / kLoRAPanel, k_ranges,
                                             y_rows);
}
#endif

}  // namespace

// x [T, in], y [T, out] (updated in place); a_panels [S_max, R / 16, in, 16] float32 or [S_max, R /
// 16, in / 2, 16, 2] bf16 (A [R, in] per slot in 16-output panels, R a multiple of 16: unused rows
// zero); b_panels [S_max, out / 32, R, 32] or [S_max, out / 32, R / 2, 32, 2] (B [out, R] per slot,
// its scaling folded in); k_ranges int32 [out / 32, 2]: the columns [begin, end) of B that panel
// p's outputs can have non-zero (begin even), the same for every slot. rows int64 [N]: the rows of
// x that run an adapter, slot by slot (ops/reference/ LoRAGroups), or none: every row, in order;
// offsets int64 [S + 1]: slot s's rows are rows[offsets[s]:offsets[s + 1]].
void lora_panels_add(const at::Tensor& x, at::Tensor& y, const at::Tensor& a_panels,
                     const at::Tensor& b_panels, const at::Tensor& k_ranges,
                     const c10::optional<at::Tensor>& rows, const at::Tensor& offsets) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(panel_linear_available(dtype),
              "lora_panels_add: this build of the CPU kernels has no ", dtype, " panels");
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t dims = bf16 ? 5 : 4;
  TORCH_CHECK(a_panels.dim() == dims && b_panels.dim() == dims &&
                a_panels.size(3) == kLoRARankPanel && b_panels.size(3) == kLoRAPanel &&
                a_panels.scalar_type() == dtype && b_panels.scalar_type() == dtype &&
                a_panels.is_contiguous() && b_panels.is_contiguous(),
              "lora_panels_add: A / B panels must be contiguous ", dtype, " [slots, panels, K",
              bf16 ? " / 2" : "", ", 16 / 32", bf16 ? ", 2" : "", "], got ", a_panels.sizes(),
              " / ", b_panels.sizes());
  const int64_t in = bf16 ? a_panels.size(2) * 2 : a_panels.size(2),
                rank = a_panels.size(1) * kLoRARankPanel;
  const int64_t out = b_panels.size(1) * kLoRAPanel;
  TORCH_CHECK((bf16 ? b_panels.size(2) * 2 : b_panels.size(2)) == rank &&
                b_panels.size(0) == a_panels.size(0),
              "lora_panels_add: B panels ", b_panels.sizes(), " do not match A panels ",
              a_panels.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in && y.dim() == 2 && y.size(0) == x.size(0) &&
                y.size(1) == out && y.scalar_type() == dtype && y.is_contiguous(),
              "lora_panels_add: x [T, ", in, "] and contiguous y [T, ", out,
              "] of the panels' dtype, got ", x.sizes(), " / ", y.sizes());
  TORCH_CHECK(k_ranges.dim() == 2 && k_ranges.size(0) == out / kLoRAPanel &&
                k_ranges.size(1) == 2 && k_ranges.scalar_type() == at::kInt &&
                k_ranges.is_contiguous(),
              "lora_panels_add: k_ranges must be "
              "contiguous int32 [",
              out / kLoRAPanel, ", 2], got ", k_ranges.sizes());
  const int32_t* ranges = k_ranges.data_ptr<int32_t>();
  for (int64_t p = 0; p < out / kLoRAPanel; ++p)
    TORCH_CHECK(0 <= ranges[2 * p] && ranges[2 * p] <= ranges[2 * p + 1] &&
                  ranges[2 * p + 1] <= rank && ranges[2 * p] % 2 == 0,
                "lora_panels_add: panel ", p, "'s k range [", ranges[2 * p], ", ",
                ranges[2 * p + 1], ") is not an even-started range within the rank ", rank);
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.size(0) >= 2 &&
                offsets.size(0) - 1 <= a_panels.size(0),
              "lora_panels_add: offsets must be int64 [S + 1], S <= ", a_panels.size(0), " slots");
  const auto bounds = offsets.contiguous();
  const int64_t* off = bounds.data_ptr<int64_t>();
  std::vector<Segment> segments;
  for (int64_t s = 0; s + 1 < bounds.size(0); ++s)
    if (off[s + 1] > off[s]) segments.push_back({s, off[s], off[s + 1] - off[s]});
  const int64_t n_rows = off[bounds.size(0) - 1];
  const bool gathered = rows.has_value() && rows->defined();
  TORCH_CHECK(gathered ? rows->numel() == n_rows : n_rows == x.size(0), "lora_panels_add: ", n_rows,
              " rows in the offsets for ", gathered ? rows->numel() : x.size(0),
              gathered ? " gathered rows" : " rows");
  if (n_rows == 0) return;
  const auto xc = x.contiguous();
  TORCH_CHECK(!gathered || rows->scalar_type() == at::kLong, "lora_panels_add: rows must be int64");
  const auto row_ids = gathered ? rows->contiguous() : at::Tensor();
  const int64_t* row_ptr = gathered ? row_ids.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; gathered && i < n_rows; ++i)
    TORCH_CHECK(row_ptr[i] >= 0 && row_ptr[i] < x.size(0), "lora_panels_add: row ", row_ptr[i],
                " out of range");
#if defined(__AVX512F__)
  if (bf16) {
#if defined(__AVX512BF16__)
    lora_rows<c10::BFloat16>(segments, xc, y, row_ptr, n_rows, a_panels, b_panels, ranges, rank);
#endif
  } else {
    lora_rows<float>(segments, xc, y, row_ptr, n_rows, a_panels, b_panels, ranges, rank);
  }
#endif
}
