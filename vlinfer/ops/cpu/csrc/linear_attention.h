// Pieces the linear-attention kernels share (linear_attention.cpp: decode steps,
// linear_attention_prefill.cpp: prefill chunks): the vector lanes of this build, the L2
// normalisation of q and k, the host copies of the call's flags, the float32 / bf16 dispatch.
#pragma once
#include <torch/extension.h>

#include <cmath>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

struct ScalarLanes {
  using reg = float;
  static constexpr int64_t W = 1;
  static reg load(const float* p) { return *p; }
  static void store(float* p, reg x) { *p = x; }
  static reg set1(float x) { return x; }
  static reg fma(reg a, reg b, reg c) { return a * b + c; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg sub(reg a, reg b) { return a - b; }
};

#if defined(__AVX512F__)
struct Lanes {
  using reg = __m512;
  static constexpr int64_t W = 16;
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
};
constexpr int kStrip = 2;  // vectors per strip: 32 columns, 16 KB of a 128-row state
constexpr const char* kKernels = "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  using reg = __m256;
  static constexpr int64_t W = 8;
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
};
constexpr int kStrip = 4;  // 32 columns: 8 accumulators of AVX2's 16 registers
constexpr const char* kKernels = "AVX2";
#else
using Lanes = ScalarLanes;
constexpr int kStrip = 16;  // 16 scalar columns, which the compiler may vectorize itself
constexpr const char* kKernels = "the plain loops";
#endif

// x [dim] as float32 into out, times factor / sqrt(sum(x^2) + eps) (the reference's l2_normalize)
template <typename scalar_t>
inline void l2_normalized(const scalar_t* x, int64_t dim, float factor, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < dim; ++i) {
    out[i] = static_cast<float>(x[i]);
    ss += out[i] * out[i];
  }
  const float r = factor / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < dim; ++i) out[i] *= r;
}

// A 1-D int tensor of `size` entries (named `what` in the error) as a host vector
std::vector<int64_t> host_ints(const at::Tensor& t, int64_t size, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == size, what, " must have ", size, " entries, got ",
              t.sizes());
  const at::Tensor h = t.to(at::kLong).contiguous();
  const int64_t* p = h.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + size);
}

// The slots of a call's B sequences, checked: inside the pool and distinct (two sequences in one
// slot would race).
std::vector<int64_t> checked_slots(const at::Tensor& slots, int64_t batch, int64_t num_slots) {
  std::vector<int64_t> out = host_ints(slots, batch, "slots");
  std::vector<char> taken(num_slots, 0);
  for (int64_t s : out) {
    TORCH_CHECK(s >= 0 && s < num_slots, "slot ", s, " outside the state pool of ", num_slots);
    TORCH_CHECK(!taken[s], "slot ", s, " given to two sequences of one call");
    taken[s] = 1;
  }
  return out;
}

std::vector<char> host_flags(const at::Tensor& has_state, int64_t batch) {
  TORCH_CHECK(has_state.dim() == 1 && has_state.size(0) == batch, "has_state must be [B]");
  const at::Tensor h = has_state.to(at::kBool).contiguous();
  const bool* p = h.data_ptr<bool>();
  return std::vector<char>(p, p + batch);
}

// f(T{}) for T the C++ type of a float32 or bf16 tensor
template <typename F>
void float_or_bf16(at::ScalarType type, const char* what, F f) {
  if (type == at::kFloat) {
    f(float{});
  } else if (type == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, what, " must be float32 or bfloat16, got ", type);
  }
}

// A delta-rule call's q, k ([tokens, Hk, Dk]), v ([tokens, Hv, Dv]) and state pool checked
void check_delta_rule_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& state) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "q, k must be [tokens, Hk, Dk] and v [tokens, Hv, Dv]");
  TORCH_CHECK(v.size(1) % q.size(1) == 0, "value heads must be a multiple of key heads");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "q, k, v need unit stride along the head dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k, v must share a dtype");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 &&
                state.size(1) == v.size(1) && state.size(2) == q.size(2) &&
                state.size(3) == v.size(2),
              "state must be a contiguous float32 [slots, Hv, Dk, Dv] pool");
}

// A conv call's x ([tokens, C], unit channel stride), weight, pool and bias checked; the bias as
// float32 (undefined when there is none)
at::Tensor checked_conv_call(const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& conv_state) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, C] with unit channel stride");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                weight.size(1) >= 2,
              "weight must be a contiguous [C, K] with K >= 2");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() &&
                conv_state.size(1) == x.size(1) && conv_state.size(2) == weight.size(1) - 1,
              "conv_state must be a contiguous [slots, C, K - 1] pool");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == x.size(1), "bias must be [C]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  return bias32;
}

}  // namespace
