// Prefill chunks of the hybrid models' linear attention (ops/reference/linear_attention.py defines
// them; ops/cpu/linear_attention.py says when these run): the gated delta rule in its chunked form
// and the causal conv1d over packed sequences of any lengths (a mixed call's one-token sequences
// too), each sequence starting from its slot (zeros where has_state is False) and leaving its
// final state there.
//
// The delta rule per (sequence, value head), by blocks of `chunk` tokens, with S the float32
// [Dk, Dv] state worked on in its slot and G the block's cumulative log-decays: the reference's
// chunked form,
//   KS = K S, QS = Q S, KK = K K^T, QK = Q K^T                                 (block matmuls)
//   (I + L) U = beta V - (beta e^G) KS, L_ij = beta_i e^(G_i - G_j) KK_ij, j < i  (forward subst.)
//   O = e^G QS + (M * QK) U, M_ij = e^(G_i - G_j) for j <= i, 0 above
//   S = e^(G_n) S + K^T (e^(G_n - G) U)
// The arithmetic is float32 at every level, bf16 inputs widened as read: a bf16 block matmul would
// round U and the state's update to 8 bits, and only the AVX512-BF16 level has a bf16 dot product.
// The matmuls are register tiles of 4 rows by 2 vectors (AVX-512: 32 columns, AVX2: 16), scalar
// columns past the last whole vector. OpenMP over (sequence, value head), dynamically scheduled
// (sequences of different lengths are items of different costs).
//
// `plant` plants a bug for the tests' negative controls, never set by the op table: 1 makes each
// block one token longer than the loop's step (the token after a block enters the state twice),
// 2 applies each token's decay one token late (G the exclusive cumulative sum).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "linear_attention.h"

namespace {

constexpr int kPlantOverlap = 1, kPlantLateDecay = 2;
constexpr int kRowTile = 4;
constexpr int kColVectors = Lanes::W == 1 ? 8 : 2;

// Rows [0, MR) and columns [0, NV * V::W) of C = (C +) A B over kd: A(i, p) at a[i * sa0 + p * sa1]
template <class V, int MR, int NV>
inline void gemm_tile(int64_t kd, const float* a, int64_t sa0, int64_t sa1, const float* b,
                      int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  using R = typename V::reg;
  R acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int u = 0; u < NV; ++u)
      acc[i][u] = accumulate ? V::load(c + i * ldc + u * V::W) : V::set1(0.f);
  for (int64_t p = 0; p < kd; ++p) {
    R bp[NV];
    for (int u = 0; u < NV; ++u) bp[u] = V::load(b + p * ldb + u * V::W);
    for (int i = 0; i < MR; ++i) {
      const R ai = V::set1(a[i * sa0 + p * sa1]);
      for (int u = 0; u < NV; ++u) acc[i][u] = V::fma(ai, bp[u], acc[i][u]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int u = 0; u < NV; ++u) V::store(c + i * ldc + u * V::W, acc[i][u]);
}

template <class V, int NV>
inline void gemm_columns(int64_t m, int64_t kd, const float* a, int64_t sa0, int64_t sa1,
                         const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + kRowTile <= m; i += kRowTile)
    gemm_tile<V, kRowTile, NV>(kd, a + i * sa0, sa0, sa1, b, ldb, c + i * ldc, ldc, accumulate);
  for (; i < m; ++i)
    gemm_tile<V, 1, NV>(kd, a + i * sa0, sa0, sa1, b, ldb, c + i * ldc, ldc, accumulate);
}

// C [m, nc] (row stride ldc) = A [m, kd] B [kd, nc], or C += A B: A(i, p) at a[i * sa0 + p * sa1]
// (a transposed A is strides (1, rows)), B row-major with row stride ldb
inline void gemm(int64_t m, int64_t nc, int64_t kd, const float* a, int64_t sa0, int64_t sa1,
                 const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int64_t wide = kColVectors * Lanes::W;
  int64_t j = 0;
  for (; j + wide <= nc; j += wide)
    gemm_columns<Lanes, kColVectors>(m, kd, a, sa0, sa1, b + j, ldb, c + j, ldc, accumulate);
  for (; j + Lanes::W <= nc; j += Lanes::W)
    gemm_columns<Lanes, 1>(m, kd, a, sa0, sa1, b + j, ldb, c + j, ldc, accumulate);
  for (; j < nc; ++j)
    gemm_columns<ScalarLanes, 1>(m, kd, a, sa0, sa1, b + j, ldb, c + j, ldc, accumulate);
}

// One thread's scratch for a block of up to `rows` tokens of one (sequence, value head)
struct BlockScratch {
  std::vector<float> buf;
  float *q, *k, *kt, *v, *ks, *qs, *u, *kk, *qk, *g, *beta, *cum;
  BlockScratch(int64_t rows, int64_t dk, int64_t dv)
      : buf(rows * (3 * dk + 4 * dv + 2 * rows + 3)) {
    float* p = buf.data();
    for (float** part : {&q, &k, &kt}) { *part = p; p += rows * dk; }
    for (float** part : {&v, &ks, &qs, &u}) { *part = p; p += rows * dv; }
    for (float** part : {&kk, &qk}) { *part = p; p += rows * rows; }
    for (float** part : {&g, &beta, &cum}) { *part = p; p += rows; }
  }
};

// The sequence's tensors as the blocks read them
template <typename scalar_t>
struct DeltaRuleCall {
  const scalar_t *q, *k, *v;
  const float *g, *beta;  // [T, Hv] contiguous
  int64_t qs0, qs1, ks0, ks1, vs0, vs1, hv, dk, dv;
  float scale;
  scalar_t* out;  // [T, Hv, Dv] contiguous
};

// One block of n tokens from row t0, value head h of key head kh, on the state s [dk, dv] in place
template <typename scalar_t>
void delta_rule_block(const DeltaRuleCall<scalar_t>& c, int64_t t0, int64_t n, int64_t h,
                      int64_t kh, int64_t rows, int plant, float* s, BlockScratch& w) {
  const int64_t dk = c.dk, dv = c.dv;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    l2_normalized(c.q + t * c.qs0 + kh * c.qs1, dk, c.scale, w.q + i * dk);
    l2_normalized(c.k + t * c.ks0 + kh * c.ks1, dk, 1.f, w.k + i * dk);
    const scalar_t* vrow = c.v + t * c.vs0 + h * c.vs1;
    for (int64_t j = 0; j < dv; ++j) w.v[i * dv + j] = static_cast<float>(vrow[j]);
    w.g[i] = c.g[t * c.hv + h];
    w.beta[i] = c.beta[t * c.hv + h];
    w.cum[i] = (i ? w.cum[i - 1] : 0.f) + w.g[i];
  }
  if (plant == kPlantLateDecay)
    for (int64_t i = 0; i < n; ++i) w.cum[i] -= w.g[i];
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < dk; ++r) w.kt[r * rows + i] = w.k[i * dk + r];
  gemm(n, dv, dk, w.k, dk, 1, s, dv, w.ks, dv, false);
  gemm(n, dv, dk, w.q, dk, 1, s, dv, w.qs, dv, false);
  gemm(n, n, dk, w.k, dk, 1, w.kt, rows, w.kk, rows, false);
  gemm(n, n, dk, w.q, dk, 1, w.kt, rows, w.qk, rows, false);
  for (int64_t i = 0; i < n; ++i) {
    const float decay = std::exp(w.cum[i]), bt = w.beta[i];
    float* ui = w.u + i * dv;
    const float *vi = w.v + i * dv, *ksi = w.ks + i * dv;
    for (int64_t j = 0; j < dv; ++j) ui[j] = bt * (vi[j] - decay * ksi[j]);
    // forward substitution: row i of (I + L) U = rhs, the rows above it solved
    for (int64_t j = 0; j < i; ++j) {
      const float l = bt * std::exp(w.cum[i] - w.cum[j]) * w.kk[i * rows + j];
      const float* uj = w.u + j * dv;
      for (int64_t x = 0; x < dv; ++x) ui[x] -= l * uj[x];
    }
    float* qki = w.qk + i * rows;
    for (int64_t j = 0; j <= i; ++j) qki[j] *= std::exp(w.cum[i] - w.cum[j]);
    for (int64_t j = i + 1; j < n; ++j) qki[j] = 0.f;
    float* qsi = w.qs + i * dv;
    for (int64_t j = 0; j < dv; ++j) qsi[j] *= decay;
  }
  gemm(n, dv, n, w.qk, rows, 1, w.u, dv, w.qs, dv, true);  // O = e^G QS + (M * QK) U
  for (int64_t i = 0; i < n; ++i) {
    scalar_t* orow = c.out + ((t0 + i) * c.hv + h) * dv;
    for (int64_t j = 0; j < dv; ++j) orow[j] = static_cast<scalar_t>(w.qs[i * dv + j]);
  }
  const float last = w.cum[n - 1];
  for (int64_t i = 0; i < n; ++i) {
    const float f = std::exp(last - w.cum[i]);
    for (int64_t j = 0; j < dv; ++j) w.u[i * dv + j] *= f;
  }
  const float decay = std::exp(last);
  for (int64_t x = 0; x < dk * dv; ++x) s[x] *= decay;
  gemm(dk, dv, n, w.kt, rows, 1, w.u, dv, s, dv, true);  // S += K^T (e^(G_n - G) U)
}

template <typename scalar_t>
void gated_delta_rule_prefill_impl(const DeltaRuleCall<scalar_t>& call, int64_t hk,
                                   float* states, const std::vector<int64_t>& bounds,
                                   const std::vector<int64_t>& slots,
                                   const std::vector<char>& has_state, int64_t chunk, int plant) {
  const int64_t hv = call.hv, group = hv / hk, head_state = call.dk * call.dv;
  const int64_t items = static_cast<int64_t>(slots.size()) * hv;
  const int64_t rows = chunk + 1;  // one row more: room for the planted overlapping block
#pragma omp parallel num_threads(at::get_num_threads())
  {
    BlockScratch scratch(rows, call.dk, call.dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / hv, h = item % hv;
      float* s = states + (slots[b] * hv + h) * head_state;
      if (!has_state[b]) std::fill_n(s, head_state, 0.f);  // a first chunk starts from zeros
      const int64_t len = bounds[b + 1] - bounds[b];
      for (int64_t c = 0; c < len; c += chunk) {
        const int64_t n = std::min(plant == kPlantOverlap ? chunk + 1 : chunk, len - c);
        delta_rule_block(call, bounds[b] + c, n, h, h / group, rows, plant, s, scratch);
      }
    }
  }
}

// Packed sequences' boundaries, checked: cu_seqlens [B + 1] from 0 to the token count, never
// decreasing (an empty sequence is allowed: its state is kept, or zeroed without has_state)
std::vector<int64_t> prefill_bounds(const at::Tensor& cu_seqlens, int64_t batch, int64_t tokens) {
  const std::vector<int64_t> bounds = host_ints(cu_seqlens, batch + 1, "cu_seqlens");
  TORCH_CHECK(bounds[0] == 0 && bounds[batch] == tokens, "cu_seqlens must run from 0 to the ",
              tokens, " tokens of the call, got ", bounds[0], "..", bounds[batch]);
  for (int64_t i = 0; i < batch; ++i)
    TORCH_CHECK(bounds[i] <= bounds[i + 1], "cu_seqlens decreases at sequence ", i);
  return bounds;
}

// The conv by blocks of kConvChannels channels and kConvTokens tokens: a window of the K - 1 rows
// before the tile (the slot's inputs, zeros, or the previous tile's) and the tile's rows, rounded
// where the reference rounds (x into the state's dtype, the window and the sum into the weight's);
// the dot over K vectorised across the block's channels, SiLU per channel.
constexpr int64_t kConvChannels = 64, kConvTokens = 64;

template <typename x_t, typename w_t, typename s_t>
void causal_conv1d_prefill_impl(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, at::Tensor& conv_state,
                                const std::vector<int64_t>& bounds,
                                const std::vector<int64_t>& slots,
                                const std::vector<char>& has_state, at::Tensor& out) {
  const int64_t channels = x.size(1), width = weight.size(1), keep = width - 1;
  const int64_t blocks = (channels + kConvChannels - 1) / kConvChannels;
  const int64_t padded = blocks * kConvChannels, x_stride = x.stride(0);
  // weights [K][padded channels] and the bias, zero past the last channel
  std::vector<float> wt(width * padded, 0.f), bs(padded, 0.f);
  const w_t* wp = weight.data_ptr<w_t>();
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t j = 0; j < width; ++j) wt[j * padded + c] = static_cast<float>(wp[c * width + j]);
    if (bias.defined()) bs[c] = bias.data_ptr<float>()[c];
  }
  const x_t* xp = x.data_ptr<x_t>();
  s_t* sp = conv_state.data_ptr<s_t>();
  x_t* op = out.data_ptr<x_t>();
  const int64_t items = static_cast<int64_t>(slots.size()) * blocks;
  const int64_t window = (keep + kConvTokens) * kConvChannels;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    // win: the window rounded to the state's dtype; use: the same in the weight's
    std::vector<float> win(window, 0.f), rounded(window, 0.f), acc(kConvChannels);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / blocks, c0 = (item % blocks) * kConvChannels;
      const int64_t cw = std::min(kConvChannels, channels - c0);
      s_t* st = sp + slots[b] * channels * keep;
      std::fill(win.begin(), win.end(), 0.f);
      if (has_state[b])
        for (int64_t cc = 0; cc < cw; ++cc)
          for (int64_t j = 0; j < keep; ++j)
            win[j * kConvChannels + cc] = static_cast<float>(st[(c0 + cc) * keep + j]);
      const int64_t len = bounds[b + 1] - bounds[b];
      for (int64_t t = 0; t < len; t += kConvTokens) {
        const int64_t tt = std::min(kConvTokens, len - t), first = bounds[b] + t;
        for (int64_t i = 0; i < tt; ++i) {
          const x_t* row = xp + (first + i) * x_stride + c0;
          float* w_row = win.data() + (keep + i) * kConvChannels;
          for (int64_t cc = 0; cc < cw; ++cc)
            w_row[cc] = static_cast<float>(static_cast<s_t>(static_cast<float>(row[cc])));
        }
        const float* use = win.data();
        if (!std::is_same<w_t, float>::value) {
          for (int64_t e = 0; e < (keep + tt) * kConvChannels; ++e)
            rounded[e] = static_cast<float>(static_cast<w_t>(win[e]));
          use = rounded.data();
        }
        for (int64_t i = 0; i < tt; ++i) {
          for (int64_t cc = 0; cc < kConvChannels; cc += Lanes::W) {
            typename Lanes::reg sum = Lanes::load(bs.data() + c0 + cc);
            for (int64_t j = 0; j < width; ++j)
              sum = Lanes::fma(Lanes::load(wt.data() + j * padded + c0 + cc),
                               Lanes::load(use + (i + j) * kConvChannels + cc), sum);
            Lanes::store(acc.data() + cc, sum);
          }
          x_t* orow = op + (first + i) * channels + c0;
          for (int64_t cc = 0; cc < cw; ++cc) {
            const float y = static_cast<float>(static_cast<w_t>(acc[cc]));
            // exp clamped: an inf would meet -ffast-math's reciprocal refinement (inf * 0 = NaN)
            orow[cc] = static_cast<x_t>(y / (1.f + std::exp(std::min(-y, 80.f))));
          }
        }
        // the last K - 1 rows of the window lead the next tile's
        std::copy(win.begin() + tt * kConvChannels, win.begin() + (tt + keep) * kConvChannels,
                  win.begin());
      }
      for (int64_t cc = 0; cc < cw; ++cc)
        for (int64_t j = 0; j < keep; ++j)
          st[(c0 + cc) * keep + j] = static_cast<s_t>(win[j * kConvChannels + cc]);
    }
  }
}

}  // namespace

at::Tensor gated_delta_rule_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                                    const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                    const at::Tensor& has_state, double scale, int64_t chunk,
                                    int64_t plant) {
  check_delta_rule_call(q, k, v, state);
  const int64_t tokens = v.size(0), hv = v.size(1);
  TORCH_CHECK(g.dim() == 2 && beta.dim() == 2 && g.size(0) == tokens && beta.size(0) == tokens &&
                g.size(1) == hv && beta.size(1) == hv,
              "g and beta must be [T, Hv]");
  TORCH_CHECK(chunk >= 1, "chunk must be at least one token");
  const int64_t batch = slots.dim() == 1 ? slots.size(0) : -1;
  TORCH_CHECK(batch >= 0, "slots must be [B]");
  const std::vector<int64_t> bounds = prefill_bounds(cu_seqlens, batch, tokens);
  const std::vector<int64_t> rows = checked_slots(slots, batch, state.size(0));
  const std::vector<char> carried = host_flags(has_state, batch);
  const at::Tensor g32 = g.to(at::kFloat).contiguous(), beta32 = beta.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  float_or_bf16(q.scalar_type(), "q, k, v", [&](auto type) {
    using scalar_t = decltype(type);
    const DeltaRuleCall<scalar_t> call{
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        g32.data_ptr<float>(), beta32.data_ptr<float>(), q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), hv, q.size(2), v.size(2),
        static_cast<float>(scale), out.data_ptr<scalar_t>()};
    gated_delta_rule_prefill_impl<scalar_t>(call, q.size(1), state.data_ptr<float>(), bounds,
                                            rows, carried, chunk, static_cast<int>(plant));
  });
  return out;
}

at::Tensor causal_conv1d_prefill(const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias, at::Tensor conv_state,
                                 const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                 const at::Tensor& has_state) {
  const at::Tensor bias32 = checked_conv_call(x, weight, bias, conv_state);
  const int64_t batch = slots.dim() == 1 ? slots.size(0) : -1;
  TORCH_CHECK(batch >= 0, "slots must be [B]");
  const std::vector<int64_t> bounds = prefill_bounds(cu_seqlens, batch, x.size(0));
  const std::vector<int64_t> rows = checked_slots(slots, batch, conv_state.size(0));
  const std::vector<char> carried = host_flags(has_state, batch);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  float_or_bf16(x.scalar_type(), "x", [&](auto xt) {
    float_or_bf16(weight.scalar_type(), "weight", [&](auto wt) {
      float_or_bf16(conv_state.scalar_type(), "conv_state", [&](auto st) {
        causal_conv1d_prefill_impl<decltype(xt), decltype(wt), decltype(st)>(
            x, weight, bias32, conv_state, bounds, rows, carried, out);
      });
    });
  });
  return out;
}
