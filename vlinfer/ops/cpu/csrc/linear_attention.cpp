// Decode steps of the hybrid models' linear attention (ops/reference/linear_attention.py defines
// them; ops/cpu/linear_attention.py says when these run): the gated delta rule and the causal
// conv1d for calls where every sequence brings one token, each updating its state slot in place.
//
// The delta rule per (sequence, value head) with S its [Dk, Dv] float32 state, k and q
// L2-normalised (q times the scale):
//   S' = e^g S;  delta = beta (v - S'^T k);  S'' = S' + k delta^T;  o = S''^T q
// which needs S^T k and S^T q before any row of S can be written: o = e^g S^T q + (k.q) delta.
// The state is walked in strips of columns: one pass over a strip's Dk rows accumulates its
// columns of S^T k and S^T q in registers, then a second pass over the same strip (now in L1)
// writes the decayed rank-1 update. Each slot's state is read from memory once and written once
// per step. Vectors over Dv: AVX-512 (16 lanes) or AVX2 (8) where built, plain loops otherwise;
// columns past the last whole vector run the scalar strip. OpenMP over (sequence, value head).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "linear_attention.h"

namespace {

// Columns [c, c + U * V::W) of one head's state s [dk, dv] (row stride dv): S^T k and S^T q over
// the strip's rows, then delta and o for its columns, then the rows decayed and updated in place.
template <class V, int U>
inline void delta_rule_strip(float* s, int64_t dk, int64_t dv, int64_t c, const float* kn,
                             const float* qn, const float* v, float decay, float beta, float kq,
                             float* o) {
  using R = typename V::reg;
  R sk[U], sq[U], d[U];
  for (int u = 0; u < U; ++u) sk[u] = sq[u] = V::set1(0.f);
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = s + i * dv + c;
    const R ki = V::set1(kn[i]), qi = V::set1(qn[i]);
    for (int u = 0; u < U; ++u) {
      const R x = V::load(row + u * V::W);
      sk[u] = V::fma(ki, x, sk[u]);
      sq[u] = V::fma(qi, x, sq[u]);
    }
  }
  const R vdecay = V::set1(decay), vbeta = V::set1(beta), vkq = V::set1(kq);
  for (int u = 0; u < U; ++u) {
    const int64_t col = c + u * V::W;
    d[u] = V::mul(vbeta, V::sub(V::load(v + col), V::mul(vdecay, sk[u])));
    V::store(o + col, V::fma(vkq, d[u], V::mul(vdecay, sq[u])));
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv + c;
    const R ki = V::set1(kn[i]);
    for (int u = 0; u < U; ++u)
      V::store(row + u * V::W, V::fma(ki, d[u], V::mul(vdecay, V::load(row + u * V::W))));
  }
}

inline void delta_rule_head(float* s, int64_t dk, int64_t dv, const float* kn, const float* qn,
                            const float* v, float decay, float beta, float kq, float* o) {
  constexpr int64_t wide = kStrip * Lanes::W;
  int64_t c = 0;
  for (; c + wide <= dv; c += wide)
    delta_rule_strip<Lanes, kStrip>(s, dk, dv, c, kn, qn, v, decay, beta, kq, o);
  for (; c + Lanes::W <= dv; c += Lanes::W)
    delta_rule_strip<Lanes, 1>(s, dk, dv, c, kn, qn, v, decay, beta, kq, o);
  for (; c < dv; ++c)
    delta_rule_strip<ScalarLanes, 1>(s, dk, dv, c, kn, qn, v, decay, beta, kq, o);
}

// The host copy of a decode call's slots, checked: one token per sequence (cu_seqlens 0, 1, ..,
// B) and the slots checked_slots takes.
std::vector<int64_t> decode_slots(const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                  int64_t batch, int64_t num_slots) {
  const std::vector<int64_t> bounds = host_ints(cu_seqlens, batch + 1, "cu_seqlens");
  for (int64_t i = 0; i <= batch; ++i)
    TORCH_CHECK(bounds[i] == i, "the decode kernels take one token per sequence (cu_seqlens 0..B)");
  return checked_slots(slots, batch, num_slots);
}

template <typename scalar_t>
void gated_delta_rule_decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                  const std::vector<int64_t>& slots,
                                  const std::vector<char>& has_state, double scale,
                                  at::Tensor& out) {
  const int64_t batch = v.size(0), hv = v.size(1), dv = v.size(2);
  const int64_t hk = q.size(1), dk = q.size(2), group = hv / hk;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t head_state = dk * dv, slot_state = hv * head_state;
  at::parallel_for(0, batch * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * dk + 2 * dv);
    float *qn = buf.data(), *kn = qn + dk, *vf = kn + dk, *of = vf + dv;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hv, h = item % hv, kh = h / group;
      float* s = sp + slots[b] * slot_state + h * head_state;
      if (!has_state[b]) std::fill_n(s, head_state, 0.f);  // a first chunk starts from zeros
      l2_normalized(qp + b * q.stride(0) + kh * q.stride(1), dk, static_cast<float>(scale), qn);
      l2_normalized(kp + b * k.stride(0) + kh * k.stride(1), dk, 1.f, kn);
      float kq = 0.f;
      for (int64_t i = 0; i < dk; ++i) kq += kn[i] * qn[i];
      const scalar_t* vrow = vp + b * v.stride(0) + h * v.stride(1);
      for (int64_t j = 0; j < dv; ++j) vf[j] = static_cast<float>(vrow[j]);
      const float decay = std::exp(gp[b * g.stride(0) + h * g.stride(1)]);
      const float bt = bp[b * beta.stride(0) + h * beta.stride(1)];
      delta_rule_head(s, dk, dv, kn, qn, vf, decay, bt, kq, of);
      scalar_t* orow = op + (b * hv + h) * dv;
      for (int64_t j = 0; j < dv; ++j) orow[j] = static_cast<scalar_t>(of[j]);
    }
  });
}

// One token per sequence: conv state [C, K - 1] shifted by x, the dot over K, SiLU. Rounded where
// the reference rounds: x into the state's dtype, the window and the sum into the weight's.
// kWidth: the conv width as a constant (4, Qwen3.5's, unrolls the channel's loops), 0 at run time.
template <typename x_t, typename w_t, typename s_t, int64_t kWidth>
void causal_conv1d_decode_impl(const at::Tensor& x, const at::Tensor& weight, const float* bias,
                               at::Tensor& conv_state, const std::vector<int64_t>& slots,
                               const std::vector<char>& has_state, at::Tensor& out) {
  const int64_t batch = x.size(0), channels = x.size(1);
  const int64_t width = kWidth ? kWidth : weight.size(1);
  const int64_t keep = width - 1, x_stride = x.stride(0);
  const x_t* xp = x.data_ptr<x_t>();
  const w_t* wp = weight.data_ptr<w_t>();
  s_t* sp = conv_state.data_ptr<s_t>();
  x_t* op = out.data_ptr<x_t>();
  constexpr int64_t kChannels = 256;  // channels per work item
  const int64_t blocks = (channels + kChannels - 1) / kChannels;
  at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / blocks, c0 = (item % blocks) * kChannels;
      const int64_t c1 = std::min(channels, c0 + kChannels);
      s_t* st = sp + slots[b] * channels * keep;
      for (int64_t c = c0; c < c1; ++c) {
        s_t* past = st + c * keep;
        const w_t* w = wp + c * width;
        if (!has_state[b]) std::fill_n(past, keep, static_cast<s_t>(0.f));
        const s_t xs = static_cast<s_t>(static_cast<float>(xp[b * x_stride + c]));
        float acc = static_cast<float>(static_cast<w_t>(xs)) * static_cast<float>(w[keep]);
        for (int64_t j = 0; j < keep; ++j)
          acc += static_cast<float>(static_cast<w_t>(past[j])) * static_cast<float>(w[j]);
        if (bias) acc += bias[c];
        for (int64_t j = 0; j + 1 < keep; ++j) past[j] = past[j + 1];
        past[keep - 1] = xs;
        acc = static_cast<float>(static_cast<w_t>(acc));
        // exp clamped: an inf would meet -ffast-math's reciprocal refinement (inf * 0 = NaN)
        op[b * channels + c] = static_cast<x_t>(acc / (1.f + std::exp(std::min(-acc, 80.f))));
      }
    }
  });
}

}  // namespace

std::string linear_attention_kernels() { return kKernels; }

at::Tensor gated_delta_rule_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                                   const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                   const at::Tensor& has_state, double scale) {
  check_delta_rule_call(q, k, v, state);
  const int64_t batch = v.size(0);
  TORCH_CHECK(g.dim() == 2 && beta.dim() == 2 && g.size(0) == batch && beta.size(0) == batch &&
                g.size(1) == v.size(1) && beta.size(1) == v.size(1),
              "g and beta must be [B, Hv]");
  const std::vector<int64_t> rows = decode_slots(cu_seqlens, slots, batch, state.size(0));
  const std::vector<char> carried = host_flags(has_state, batch);
  const at::Tensor g32 = g.to(at::kFloat), beta32 = beta.to(at::kFloat);
  at::Tensor out = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  float_or_bf16(q.scalar_type(), "q, k, v", [&](auto type) {
    using scalar_t = decltype(type);
    gated_delta_rule_decode_impl<scalar_t>(q, k, v, g32, beta32, state, rows, carried, scale,
                                           out);
  });
  return out;
}

at::Tensor causal_conv1d_decode(const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, at::Tensor conv_state,
                                const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                const at::Tensor& has_state) {
  const at::Tensor bias32 = checked_conv_call(x, weight, bias, conv_state);
  const int64_t batch = x.size(0);
  const std::vector<int64_t> rows = decode_slots(cu_seqlens, slots, batch, conv_state.size(0));
  const std::vector<char> carried = host_flags(has_state, batch);
  const float* bias_p = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({batch, x.size(1)}, x.options());
  float_or_bf16(x.scalar_type(), "x", [&](auto xt) {
    float_or_bf16(weight.scalar_type(), "weight", [&](auto wt) {
      float_or_bf16(conv_state.scalar_type(), "conv_state", [&](auto st) {
        using x_t = decltype(xt);
        using w_t = decltype(wt);
        using s_t = decltype(st);
        if (weight.size(1) == 4) {
          causal_conv1d_decode_impl<x_t, w_t, s_t, 4>(x, weight, bias_p, conv_state, rows, carried,
                                                      out);
        } else {
          causal_conv1d_decode_impl<x_t, w_t, s_t, 0>(x, weight, bias_p, conv_state, rows, carried,
                                                      out);
        }
      });
    });
  });
  return out;
}
