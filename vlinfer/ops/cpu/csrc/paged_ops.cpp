// CPU kernels for the engine's hot ops: paged decode attention, the paged KV-cache write, in-place
// rotary, RMSNorm (plain and fused with the residual add), SiLU-and-multiply, tanh GELU and the
// structured-output token bitmask. The AVX512-BF16 attention kernels (bf16 decode, the vision
// tower's attention) are in attention_bf16.cpp, the MoE experts' small-batch matmul in
// moe_experts.cpp; all are registered here.
// bfloat16 / float32 storage, float32 accumulation, OpenMP over independent rows or sequences.
// Semantics are defined by vlinfer/ops/reference/; tests compare against it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "decode_avx2.h"
#include "decode_layer.h"
#include "decode_vectors.h"
#include "kernels.h"

// decode_layer.cpp composes the entry points below (kernels.h; hence outside the anonymous namespace)

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Decode attention: one query token per sequence. For each (sequence, kv head), read that head's
// keys and values once and serve all `group` query heads that share it (grouped-query attention),
// so KV traffic is minimal.
template <typename scalar_t>
void paged_decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_stride_b = q.stride(0), q_stride_h = q.stride(1);
  const int64_t o_stride_b = out.stride(0), o_stride_h = out.stride(1);
  const int64_t c_stride_block = k_cache.stride(0), c_stride_tok = k_cache.stride(1),
                c_stride_h = k_cache.stride(2);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * head_dim), acc(group * head_dim);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, kvh = work % num_kv_heads;
      const int64_t len = lens[b];
      scores.assign(group * len, 0.f);
      scaled_query_group(q_ptr, q_stride_b, q_stride_h, b, kvh, group, head_dim, fscale, qf.data());
      // Pass 1: scores for every cached token.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[b * max_blocks + t / block_size];
        const scalar_t* kv =
          k_ptr + block * c_stride_block + (t % block_size) * c_stride_tok + kvh * c_stride_h;
        float kf[512];
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_f(kv[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kf[d];
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax_in_place(scores.data() + g * len, len);
      // Pass 2: weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[b * max_blocks + t / block_size];
        const scalar_t* vv =
          v_ptr + block * c_stride_block + (t % block_size) * c_stride_tok + kvh * c_stride_h;
        float vf[512];
        for (int64_t d = 0; d < head_dim; ++d) vf[d] = to_f(vv[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* ov = o_ptr + b * o_stride_b + (kvh * group + g) * o_stride_h;
        for (int64_t d = 0; d < head_dim; ++d) ov[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

#if defined(__AVX512F__)
// float32 decode on AVX-512, the bf16 kernel's structure with FMAs (attention_bf16.cpp): per
// sequence, each kv head in turn (the first prefetching whole token rows), scores 16 keys at a time
// summed by sum16, softmax with exp512, then the value rows weighted per query head, NV = head_dim
// / 16 vectors per row. The generic loop above took 2.4x as long as bf16 on SmolLM2's decode batch
// (8.3 against 3.4 s of a 38 s run, AMD EPYC).
template <int NV>
void decode_one_f32(const float* q, int64_t q_stride_h, int64_t group, const float* k_base,
                    const float* v_base, const int32_t* table, int64_t block_size,
                    int64_t stride_block, int64_t stride_tok, int64_t len, float scale, float* out,
                    int64_t o_stride_h, const HeadPrefetch& fetch, std::vector<float>& scores,
                    std::vector<float>& inv_sum) {
  constexpr int64_t kHeadsPerPass =
    NV <= 4 ? 4 : 2;  // value accumulators: kHeadsPerPass x NV <= 16 registers
  const int64_t padded = (len + 15) / 16 * 16;
  scores.resize(group * padded);
  inv_sum.resize(group);
  const RowCursor start{table, block_size, stride_block, stride_tok};
  const __m512 vscale = _mm512_set1_ps(scale);
  RowCursor cur = start, pre = start.ahead(kPrefetch);
  const float* rows[16];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    next_rows16(cur, pre, k_base, t0, len, fetch, rows);  // lanes past the end: masked below
    for (int64_t g = 0; g < group; ++g) {
      const __m512 s =
        scores16<NV>(q + g * q_stride_h, rows, [](const float* p) { return _mm512_loadu_ps(p); });
      _mm512_storeu_ps(scores.data() + g * padded + t0, _mm512_mul_ps(s, vscale));
    }
  }
  for (int64_t g = 0; g < group; ++g)
    inv_sum[g] = softmax16_unnormalized(scores.data() + g * padded, len, padded);
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    const int64_t heads = std::min(kHeadsPerPass, group - g0);
    __m512 acc[kHeadsPerPass][NV];
    for (int64_t h = 0; h < kHeadsPerPass; ++h)
      for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_setzero_ps();
    RowCursor vcur = start, vpre = start.ahead(kPrefetch);
    for (int64_t t = 0; t < len; ++t, vcur.next(), vpre.next()) {
      const float* v = vcur.row(v_base);
      if (t + kPrefetch < len)
        prefetch_lines(vpre.row(v_base) - fetch.offset, g0 == 0 ? fetch.lines : 0);
      __m512 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = _mm512_loadu_ps(v + 16 * i);
      for (int64_t h = 0; h < kHeadsPerPass; ++h) {
        if (h >= heads) break;
        const __m512 p = _mm512_set1_ps(scores[(g0 + h) * padded + t]);
        for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_fmadd_ps(p, vv[i], acc[h][i]);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const __m512 inv = _mm512_set1_ps(inv_sum[g0 + h]);
      for (int i = 0; i < NV; ++i)
        _mm512_storeu_ps(out + (g0 + h) * o_stride_h + 16 * i, _mm512_mul_ps(acc[h][i], inv));
    }
  }
}

// true when it ran: float32, head_dim 64 or 128, contiguous head_dim.
bool paged_decode_attention_f32(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& tables,
                                const at::Tensor& lens, double scale, at::Tensor& out) {
  if (q.scalar_type() != at::kFloat || (q.size(2) != 64 && q.size(2) != 128)) return false;
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2),
                group = num_heads / num_kv_heads;
  const int64_t max_blocks = tables.size(1);
  const int64_t sb = k_cache.stride(0), st = k_cache.stride(1), sh = k_cache.stride(2);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const DecodeItems items(batch, num_kv_heads, at::get_num_threads());
  at::parallel_for(0, items.count(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv_sum;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = items.sequence(item);
      for (int64_t kvh = items.first_head(item); kvh < items.end_head(item); ++kvh) {
        const HeadPrefetch fetch = items.fetch(kvh, head_dim, head_dim / 16, sh, st);
        const float* qb = qp + b * q.stride(0) + kvh * group * q.stride(1);
        float* ob = op + b * out.stride(0) + kvh * group * out.stride(1);
        if (head_dim == 64)
          decode_one_f32<4>(qb, q.stride(1), group, kp + kvh * sh, vp + kvh * sh,
                            tp + b * max_blocks, block_size, sb, st, lp[b],
                            static_cast<float>(scale), ob, out.stride(1), fetch, scores, inv_sum);
        else
          decode_one_f32<8>(qb, q.stride(1), group, kp + kvh * sh, vp + kvh * sh,
                            tp + b * max_blocks, block_size, sb, st, lp[b],
                            static_cast<float>(scale), ob, out.stride(1), fetch, scores, inv_sum);
      }
    }
  });
  return true;
}
#else
bool paged_decode_attention_f32(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, at::Tensor&) {
  return false;
}
#endif

}  // namespace

// Which decode attention kernels this build runs, for the load-time log (ops/cpu/backend.py) and
// the tests.
std::string decode_attention_kernels() {
#if defined(__AVX512F__)
  return "AVX-512 (head_dim 64 / 128): float32, compressed caches" +
         std::string(bf16_attention_available() ? ", bf16 (AVX512-BF16)"
                                                : "; bf16 / fp16 the plain loops");
#elif defined(VLINFER_AVX2_DECODE)
  return "AVX2 (head_dim 64 / 128): float32, bf16, fp16, compressed caches";
#else
  return "the plain loops";
#endif
}

namespace {

// Decode attention into out by the best kernel this build has for q's dtype and head_dim; returns
// that kernel's name.
const char* decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, double scale,
                        at::Tensor& out) {
  if (paged_decode_attention_bf16(q, k_cache, v_cache, tables, lens, scale, out))
    return "AVX512-BF16";
  if (paged_decode_attention_f32(q, k_cache, v_cache, tables, lens, scale, out)) return "AVX-512";
#if defined(VLINFER_AVX2_DECODE)
  static const float kNoScale = 1.f;  // rows of the compute dtype: stored as they are
  auto avx2 = [&](auto value) {
    using scalar_t = decltype(value);
    return decode_attention_avx2<scalar_t, scalar_t>(q, k_cache, v_cache, &kNoScale, &kNoScale,
                                                     false, tables, lens, scale, out);
  };
  const auto type = q.scalar_type();
  if ((type == at::kFloat && avx2(float{})) || (type == at::kBFloat16 && avx2(c10::BFloat16{})) ||
      (type == at::kHalf && avx2(c10::Half{})))
    return "AVX2";
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(
    at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention",
    [&] { paged_decode_attention_impl<scalar_t>(q, k_cache, v_cache, tables, lens, scale, out); });
  return "the plain loops";
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k and v caches must share a layout");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) <= 512, "head_dim mismatch or over 512");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "int32 tables");
  auto out = at::empty_like(q);
  decode_into(q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale, out);
  return out;
}

// The kernel paged_decode_attention runs for q's dtype and head_dim over this cache: its own
// dispatch over no rows, so the name cannot drift from what runs (the op table logs it).
std::string decode_attention_kernel(const at::Tensor& q, const at::Tensor& k_cache) {
  const auto none = q.narrow(0, 0, 0);
  auto out = at::empty_like(none);
  const auto ints = none.options().dtype(at::kInt);
  return decode_into(none, k_cache, k_cache, at::empty({0, 1}, ints), at::empty({0}, ints), 1.0,
                     out);
}

// Paged KV-cache write: token i goes to flat slot slot_mapping[i] (block * block_size + offset);
// slots < 0 are padding and skipped.
void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && k_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(
    key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
    "key/value dtype must match the cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  auto k = key.contiguous(), v = value.contiguous();
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t bytes = row * k.element_size();
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t i = 0; i < tokens; ++i)
    TORCH_CHECK(s[i] < num_slots, "slot ", s[i], " outside the cache");
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (s[i] < 0) continue;
      std::memcpy(kd + s[i] * bytes, ks + i * bytes, bytes);
      std::memcpy(vd + s[i] * bytes, vs + i * bytes, bytes);
    }
  });
}

namespace {

// Neox rotary in place on x [T, heads, D] with float32 cos/sin [T, D]: x = x*cos +
// rotate_half(x)*sin.
template <typename scalar_t>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  scalar_t* xp = x.data_ptr<scalar_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* v = xp + t * st + h * sh;
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = to_f(v[d]), x2 = to_f(v[d + half]);
          v[d] = static_cast<scalar_t>(x1 * c[d] - x2 * s[d]);
          v[d + half] = static_cast<scalar_t>(x2 * c[d + half] + x1 * s[d + half]);
        }
      }
    }
  });
}

}  // namespace

void rotary_inplace(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with contiguous D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin must be float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == x.size(2),
              "cos/sin [T, D]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_inplace", [&] {
    rotary_impl<scalar_t>(x, cos, sin);
  });
}

namespace {

// ---- Norms and the gated activation, one pass each. The reference's rounding points are kept: in
// bfloat16 the normalized value is rounded before the weight multiplies it (as transformers does),
// so outputs match it bit for bit up to float32 summation order.

// Rows of x [T, D] or [T, heads, D] (last dim contiguous, any outer strides: q/k come as views of
// the qkv output).
struct Rows {
  int64_t outer, inner, dim, stride_outer, stride_inner;
  explicit Rows(const at::Tensor& x) {
    TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
                "expected [T, D] or [T, H, D], contiguous D");
    outer = x.size(0);
    inner = x.dim() == 3 ? x.size(1) : 1;
    dim = x.size(-1);
    stride_outer = x.stride(0);
    stride_inner = x.dim() == 3 ? x.stride(1) : 0;
  }
  int64_t count() const { return outer * inner; }
  int64_t offset(int64_t r) const {
    return (r / inner) * stride_outer + (r % inner) * stride_inner;
  }
};

#if defined(__AVX512F__)
// 16 bf16 <-> float32 at a time. The compiler does not vectorize c10::BFloat16's scalar rounding:
// bf16 RMSNorm ran 4x slower than float32 on the same rows ([64, 576]: 41 against 10 us). Rounding
// is c10's: to nearest even, NaN to 0x7FC0 (tested on integers, which -ffast-math cannot fold).
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide =
    _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512i bf16_bits(
  __m512 v) {  // round to nearest even; the bf16 in the low 16 bits of each lane
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(
    _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}
inline __m512 round16(__m512 v, c10::BFloat16) {  // v rounded to bf16, as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
inline __m512 round16(__m512 v, float) { return v; }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <typename T>
constexpr bool kVector16 = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
#else
template <typename T>
constexpr bool kVector16 = false;
#endif

template <typename scalar_t>
inline void rms_norm_row(const float* xf, const scalar_t* w, scalar_t* y, int64_t dim, float eps) {
  float sum = 0.f;
  for (int64_t d = 0; d < dim; ++d) sum += xf[d] * xf[d];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
  int64_t d = 0;
#if defined(__AVX512F__)
  if constexpr (kVector16<scalar_t>) {
    const __m512 rv = _mm512_set1_ps(r);
    for (; d + 16 <= dim; d += 16) {
      const __m512 normed = round16(_mm512_mul_ps(_mm512_loadu_ps(xf + d), rv), scalar_t{});
      store16(y + d, _mm512_mul_ps(load16(w + d), normed));
    }
  }
#endif
  for (; d < dim; ++d) {
    const scalar_t normed =
      static_cast<scalar_t>(xf[d] * r);  // rounded to the activation dtype first
    y[d] = static_cast<scalar_t>(to_f(w[d]) * to_f(normed));
  }
}

template <typename scalar_t>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const Rows rows(x);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows.count(), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(rows.dim);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* src = xp + rows.offset(r);
      int64_t d = 0;
#if defined(__AVX512F__)
      if constexpr (kVector16<scalar_t>) {
        for (; d + 16 <= rows.dim; d += 16) _mm512_storeu_ps(xf.data() + d, load16(src + d));
      }
#endif
      for (; d < rows.dim; ++d) xf[d] = to_f(src[d]);
      rms_norm_row<scalar_t>(xf.data(), wp, op + r * rows.dim, rows.dim, static_cast<float>(eps));
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                weight.numel() == x.size(-1),
              "weight must be contiguous [D] in x's dtype");
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, weight, eps, out);
  });
  return out;
}

namespace {

// (norm(x + residual), x + residual) for contiguous [T, D]: the sum is rounded to the activation
// dtype (it is the residual stream the next layer reads) and the norm is taken of the rounded sum,
// as the reference does.
template <typename scalar_t>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       double eps, at::Tensor& out, at::Tensor& new_residual) {
  const int64_t tokens = x.size(0), dim = x.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* rp = residual.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  scalar_t* np = new_residual.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(dim);
    for (int64_t t = begin; t < end; ++t) {
      int64_t d = 0;
#if defined(__AVX512F__)
      if constexpr (kVector16<scalar_t>) {
        for (; d + 16 <= dim; d += 16) {
          const __m512 sum =
            round16(_mm512_add_ps(load16(xp + t * dim + d), load16(rp + t * dim + d)), scalar_t{});
          store16(np + t * dim + d, sum);
          _mm512_storeu_ps(xf.data() + d, sum);
        }
      }
#endif
      for (; d < dim; ++d) {
        const scalar_t sum = static_cast<scalar_t>(to_f(xp[t * dim + d]) + to_f(rp[t * dim + d]));
        np[t * dim + d] = sum;
        xf[d] = to_f(sum);
      }
      rms_norm_row<scalar_t>(xf.data(), wp, op + t * dim, dim, static_cast<float>(eps));
    }
  });
}

}  // namespace

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes(), "x and residual must be [T, D]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, residual and weight must share a dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be contiguous [D]");
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto out = at::empty_like(xc), new_residual = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(xc, rc, weight, eps, out, new_residual);
  });
  return {out, new_residual};
}

namespace {

// silu(gate) * up for x = [gate | up] [T, 2I] -> [T, I]; silu rounded to the activation dtype
// before the product.
template <typename scalar_t>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t tokens = x.size(0), inter = out.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* gate = xp + t * 2 * inter;
      const scalar_t* up = gate + inter;
      scalar_t* y = op + t * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float g = to_f(gate[i]);
        const scalar_t act = static_cast<scalar_t>(g / (1.f + std::exp(-g)));
        y[i] = static_cast<scalar_t>(to_f(act) * to_f(up[i]));
      }
    }
  });
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 * intermediate]");
  auto xc = x.contiguous();
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(xc, out);
  });
  return out;
}

namespace {

// tanh-approximated GELU in place (the vision MLP's gelu_pytorch_tanh), written as x * sigmoid(2u)
// with u = sqrt(2/pi) * (x + 0.044715 x^3): the same function as 0.5 x (1 + tanh(u)) without its
// cancellation for negative x, in one vectorizable pass where torch spends a Sleef tanh per
// element.
template <typename scalar_t>
void gelu_tanh_impl(at::Tensor& x) {
  scalar_t* xp = x.data_ptr<scalar_t>();
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  at::parallel_for(0, x.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = to_f(xp[i]);
      const float u = kBeta * (v + kKappa * v * v * v);
      // Clamped: exp overflowing to inf would meet -ffast-math's reciprocal refinement (inf * 0 =
      // NaN).
      xp[i] = static_cast<scalar_t>(v / (1.f + std::exp(std::min(-2.f * u, 80.f))));
    }
  });
}

at::Tensor gelu_tanh_(at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous(), "gelu_tanh_ needs a contiguous tensor");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_tanh_", [&] {
    gelu_tanh_impl<scalar_t>(x);
  });
  return x;
}

}  // namespace

// Structured outputs: logits[rows[i], t] = -inf wherever bit t % 32 of word t / 32 of bitmask[i] is
// clear (the layout llguidance and xgrammar write), and past the mask's 32 * words tokens. One pass
// over the words; a word of all ones (most of them inside a JSON string) costs one compare, one of
// all zeros a vector fill. Defined by ops/reference/bitmask.py.
template <typename scalar_t>
void apply_token_bitmask_impl(at::Tensor& logits, const at::Tensor& rows,
                              const at::Tensor& bitmask) {
  const int64_t vocab = logits.size(1), words = bitmask.size(1), count = rows.size(0);
  scalar_t* base = logits.data_ptr<scalar_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const scalar_t neg_inf = static_cast<scalar_t>(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* row = base + row_ids[i] * vocab;
      const uint32_t* mask = masks + i * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = w < words ? mask[w] : 0u;
        if (word == 0xFFFFFFFFu) continue;
        const int64_t n = std::min<int64_t>(32, vocab - w * 32);
        if (word == 0u) {  // outside a string most words allow nothing: a straight fill the
                           // compiler vectorizes
          std::fill_n(row + w * 32, n, neg_inf);
          continue;
        }
        for (int64_t b = 0; b < n; ++b) {
          if (!((word >> b) & 1u)) row[w * 32 + b] = neg_inf;
        }
      }
    }
  });
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous [B, vocab] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [rows, words] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "rows must be int64 [rows], one per bitmask row");
  if (rows.size(0)) {
    const int64_t lo = rows.min().item<int64_t>(), hi = rows.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < logits.size(0), "rows must index the logits' rows");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
    at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask",
    [&] { apply_token_bitmask_impl<scalar_t>(logits, rows, bitmask); });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("store_kvcache", &store_kvcache, "paged KV-cache write (CPU)");
  m.def("store_kvcache_quantized", &store_kvcache_quantized,
        "paged KV-cache write into an int8 / bf16 / fp16 / fp8 "
        "cache, int8 with per-row scales (CPU)");
  m.def("paged_decode_attention_quantized", &paged_decode_attention_quantized,
        "paged decode attention over an "
        "int8 / bf16 / fp16 / fp8 cache (CPU)");
  m.def("rotary_inplace", &rotary_inplace, "neox rotary in place (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "grammar token bitmask applied to logits rows in place (CPU)");
  m.def("gelu_tanh_", &gelu_tanh_, "tanh-approximated GELU in place (CPU)");
  m.def("bf16_attention_available", &bf16_attention_available, "built with AVX512-BF16");
  m.def("decode_attention_kernels", &decode_attention_kernels,
        "the decode attention kernels of this build");
  m.def("decode_attention_kernel", &decode_attention_kernel,
        "the kernel paged_decode_attention runs for q's dtype and head_dim");
  m.def("prefill_attention", &prefill_attention,
        "bf16 causal attention of prefill chunks over the paged cache (CPU)");
  m.def("prefill_attention_int8", &prefill_attention_int8,
        "prefill_attention over an int8 cache with per-row scales, rows read back in bf16 (CPU)");
  m.def("vision_attention", &vision_attention,
        "bf16 varlen bidirectional attention (CPU, AVX512-BF16)");
  m.def("expert_matmul", &expert_matmul,
        "rows sorted by expert times their expert's [N, K] weight, transposed (CPU)");
  m.def("expert_panel_matmul", &expert_panel_matmul,
        "expert_matmul on weights packed in 32-output bf16 panels "
        "(CPU, AVX512-BF16)");
  m.def("expert_panels_available", &expert_panels_available,
        "built with AVX512-BF16: expert_panel_matmul runs");
  m.def("panel_linear", &panel_linear,
        "x @ w^T (+ bias) on weights packed in 32-output panels (CPU, AVX-512)", py::arg("x"),
        py::arg("panels"), py::arg("bias") = py::none());
  m.def("panel_linear_available", &panel_linear_available,
        "whether this build runs panel_linear for a dtype");
  m.def("int8_vnni_available", &int8_vnni_available,
        "built with AVX512-VNNI (and BF16): int8_vnni_linear runs");
  m.def("int8_vnni_quantize", &int8_vnni_quantize,
        "rows -> (uint8 [M, digits, K], float32 row scales): int8_vnni_linear's activations");
  m.def("int8_vnni_linear", &int8_vnni_linear,
        "x @ (q * scale)^T (+ bias) on int8 VNNI panels, activations per row as 1 (W8A8) or 2 "
        "(W8A16) digits (CPU, AVX512-VNNI)",
        py::arg("x"), py::arg("panels"), py::arg("comp"), py::arg("scale"),
        py::arg("bias") = py::none(), py::arg("digits"));
  m.def("gated_delta_rule_decode", &gated_delta_rule_decode,
        "the gated delta rule for one token per sequence, states updated in place by slot (CPU)");
  m.def("causal_conv1d_decode", &causal_conv1d_decode,
        "causal conv1d + SiLU for one token per sequence, conv states shifted by slot (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("conv_state"),
        py::arg("cu_seqlens"), py::arg("slots"), py::arg("has_state"));
  m.def("gated_delta_rule_prefill", &gated_delta_rule_prefill,
        "the gated delta rule in chunks over packed sequences of any lengths, states read and "
        "written by slot (CPU); plant: a bug for the tests' negative controls, 0 in use",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state"),
        py::arg("cu_seqlens"), py::arg("slots"), py::arg("has_state"), py::arg("scale"),
        py::arg("chunk"), py::arg("plant") = 0);
  m.def("causal_conv1d_prefill", &causal_conv1d_prefill,
        "causal conv1d + SiLU over packed sequences of any lengths, conv states by slot (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("conv_state"),
        py::arg("cu_seqlens"), py::arg("slots"), py::arg("has_state"));
  m.def("linear_attention_kernels", &linear_attention_kernels,
        "the vector path of this build's linear-attention decode kernels");
  m.def("lora_panels_add", &lora_panels_add,
        "y[t] += (x[t] @ A[s]^T) @ B[s]^T per row's slot, A in 16-output and B in "
        "32-output panels (CPU, AVX-512)",
        py::arg("x"), py::arg("y"), py::arg("a_panels"), py::arg("b_panels"), py::arg("k_ranges"),
        py::arg("rows"), py::arg("offsets"));
  // module_local: each instruction-set level's extension registers its own class (tests load
  // several at once).
  py::class_<DenseDecodeStack>(
    m, "DenseDecodeStack", py::module_local(),
    "a dense model's decoder layers for decode steps, one call a step (CPU; projections "
    "on panels, AVX-512)")
    .def(py::init<int64_t, int64_t, int64_t, double, double, double, int64_t>(),
         py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"),
         py::arg("eps"), py::arg("qk_eps"), py::arg("int8_widen_rows") = -1)
    .def("add_layer", &DenseDecodeStack::add_layer, py::arg("input_norm"), py::arg("post_norm"),
         py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norm"), py::arg("k_norm"), py::arg("o"),
         py::arg("o_bias"), py::arg("gate_up"), py::arg("gate_up_bias"), py::arg("down"),
         py::arg("down_bias"), py::arg("int8_comp") = std::vector<at::Tensor>(),
         py::arg("int8_scale") = std::vector<at::Tensor>())
    .def("forward", &DenseDecodeStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"),
         py::arg("k_caches"), py::arg("v_caches"), py::arg("slot_mapping"),
         py::arg("block_tables"), py::arg("seq_lens"),
         py::arg("k_scales") = std::vector<at::Tensor>(),
         py::arg("v_scales") = std::vector<at::Tensor>())
    .def_property_readonly("num_layers", &DenseDecodeStack::num_layers);
}
