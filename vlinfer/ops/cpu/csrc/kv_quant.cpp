// A KV cache stored in another dtype than the compute dtype (kv_cache_dtype): the quantizing cache
// write and decode attention reading the stored rows. int8 rows carry one float32 scale per token
// and KV head (written here, beside the row); bf16 / fp16 / fp8 rows one per-tensor scale. Meaning
// defined by vlinfer/ops/reference/kv_cache.py. Plain loops over float32 the compiler vectorizes at
// each instruction-set level the extension is built for; a row's scale multiplies its dot product
// (K) or its softmax weight (V), not each element.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_avx2.h"
#include "decode_vectors.h"

namespace {

constexpr float kInt8Max = 127.f;

template <typename T>
constexpr bool kFp8 = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// An fp8 format's 256 codes as float32: c10's conversion is bit arithmetic the compiler does not
// vectorize (11x slower than the int8 read for a decode step), a table lookup is one load.
template <typename fp8_t>
const float* fp8_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int i = 0; i < 256; ++i)
      v[i] = static_cast<float>(fp8_t(static_cast<uint8_t>(i), fp8_t::from_bits()));
    return v;
  }();
  return values.data();
}

template <typename T>
inline float to_float(T x) {
  if constexpr (kFp8<T>) return fp8_values<T>()[x.x];
  return static_cast<float>(x);
}
inline float to_float(int8_t x) { return static_cast<float>(x); }

// One row of head_dim values quantized into a cache row; returns the row's scale (int8) or the
// tensor's.
template <typename cache_t>
inline float quantize_row(const float* x, int64_t n, cache_t* out, float tensor_scale) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    float amax = 0.f;
    for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float scale = std::max(amax / kInt8Max, std::numeric_limits<float>::min());
    const float inv = 1.f / scale;
    for (int64_t d = 0; d < n; ++d) {
      // Round half away from zero would differ from torch.round's half-to-even: nearbyint is
      // half-to-even.
      const float r = std::nearbyint(x[d] * inv);
      out[d] = static_cast<int8_t>(std::min(kInt8Max, std::max(-kInt8Max, r)));
    }
    return scale;
  } else {
    const float limit = static_cast<float>(std::numeric_limits<cache_t>::max());
    const float inv = 1.f / tensor_scale;
    for (int64_t d = 0; d < n; ++d)
      out[d] = static_cast<cache_t>(std::min(limit, std::max(-limit, x[d] * inv)));
    return tensor_scale;
  }
}

template <typename scalar_t, typename cache_t>
void store_impl(const at::Tensor& x, at::Tensor& cache, at::Tensor& scale, const int64_t* slots,
                bool per_row) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  cache_t* cp = reinterpret_cast<cache_t*>(cache.data_ptr());
  float* sp = scale.data_ptr<float>();
  const float tensor_scale = per_row ? 1.f : sp[0];
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(head_dim);
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* src = xp + (i * heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(src[d]);
        const float s =
          quantize_row(row.data(), head_dim, cp + (slots[i] * heads + h) * head_dim, tensor_scale);
        if (per_row) sp[slots[i] * heads + h] = s;
      }
    }
  });
}

#if defined(__AVX512F__)
// 16 stored values from p as float32, unscaled.
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
    _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// fp8 through float16, exactly: e5m2 is float16's top byte; e4m3fn's magnitude bits shifted into
// float16's place read as float16 are the value / 2^8 (the exponent biases differ by 8), subnormals
// included.
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(codes, 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x7F)), 7);
  const __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(magnitude), _mm512_set1_ps(256.f));
  const __m512i sign =
    _mm512_slli_epi32(_mm512_and_si512(_mm512_cvtepu16_epi32(codes), _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

template <typename cache_t>
constexpr bool kVectorRows =
  std::is_same_v<cache_t, int8_t> || std::is_same_v<cache_t, c10::BFloat16> ||
  std::is_same_v<cache_t, c10::Half> || kFp8<cache_t>;

// decode_impl's work for one (sequence, KV head) on AVX-512, the float32 kernel's structure
// (paged_ops.cpp decode_one_f32): 16 keys at a time, their dot products summed by sum16 and
// multiplied by the rows' scales, softmax with exp512, then the value rows weighted by p x their
// scale; NV = head_dim / 16 vectors per row. q: the group's query rows, already times the softmax
// scale; out: the group's output rows, float32. The row scales sit in slot order beside the cache
// (per_row) or are one per tensor (scales[0]).
template <int NV, typename cache_t>
void decode_one_quantized(const float* q, int64_t group, const cache_t* k_base,
                          const cache_t* v_base, const float* ks, const float* vs, bool per_row,
                          const int32_t* table, int64_t block_size, int64_t num_kv_heads,
                          int64_t kvh, int64_t len, float* out, std::vector<float>& scores,
                          std::vector<float>& v_scales, std::vector<float>& inv_sum) {
  constexpr int64_t kHeadDim = 16 * NV;
  constexpr int64_t kHeadsPerPass = NV <= 4 ? 4 : 2;
  constexpr int64_t kLines = std::max<int64_t>(1, kHeadDim * sizeof(cache_t) / 64);
  const int64_t padded = (len + 15) / 16 * 16;
  scores.resize(group * padded);
  v_scales.resize(padded);
  inv_sum.resize(group);
  const RowCursor start{table, block_size, block_size * num_kv_heads,
                        num_kv_heads};  // walks scale (slot) indices
  RowCursor cur = start, pre = start.ahead(kPrefetch);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    const cache_t* rows[16];
    alignas(64) float k_row_scale[16];
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= n) {  // lanes past the end: any row, masked below
        rows[i] = rows[0];
        k_row_scale[i] = 0.f;
        continue;
      }
      const int64_t at = cur.index() + kvh;  // slot * num_kv_heads + kvh
      rows[i] = k_base + at * kHeadDim;
      k_row_scale[i] = per_row ? ks[at] : ks[0];
      v_scales[t0 + i] = per_row ? vs[at] : vs[0];
      if (t0 + i + kPrefetch < len) {
        const int64_t ahead = pre.index() + kvh;
        prefetch_lines(k_base + ahead * kHeadDim, kLines);
        prefetch_lines(v_base + ahead * kHeadDim, kLines);
      }
      cur.next();
      pre.next();
    }
    const __m512 row_scale = _mm512_load_ps(k_row_scale);
    if (group == 1) {
      const __m512 s = scores16<NV>(q, rows, [](const cache_t* p) { return load16(p); });
      _mm512_storeu_ps(scores.data() + t0, _mm512_mul_ps(s, row_scale));
      continue;
    }
    // A group's query heads share the key rows: each row converted to float32 once, into L1, not
    // once per head.
    alignas(64) float converted[16 * kHeadDim];
    const float* float_rows[16];
    for (int64_t j = 0; j < 16; ++j) {
      float_rows[j] = converted + j * kHeadDim;
      for (int i = 0; i < NV; ++i)
        _mm512_store_ps(converted + j * kHeadDim + 16 * i, load16(rows[j] + 16 * i));
    }
    for (int64_t g = 0; g < group; ++g) {
      const __m512 s = scores16<NV>(q + g * kHeadDim, float_rows,
                                    [](const float* p) { return _mm512_load_ps(p); });
      _mm512_storeu_ps(scores.data() + g * padded + t0, _mm512_mul_ps(s, row_scale));
    }
  }
  for (int64_t g = 0; g < group; ++g)
    inv_sum[g] = softmax16_unnormalized(scores.data() + g * padded, len, padded);
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    const int64_t heads = std::min(kHeadsPerPass, group - g0);
    __m512 acc[kHeadsPerPass][NV];
    for (int64_t h = 0; h < kHeadsPerPass; ++h)
      for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_setzero_ps();
    RowCursor vcur = start;
    for (int64_t t = 0; t < len; ++t, vcur.next()) {
      const cache_t* v = v_base + (vcur.index() + kvh) * kHeadDim;
      __m512 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load16(v + 16 * i);
      for (int64_t h = 0; h < kHeadsPerPass; ++h) {
        if (h >= heads) break;
        const __m512 p = _mm512_set1_ps(scores[(g0 + h) * padded + t] * v_scales[t]);
        for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_fmadd_ps(p, vv[i], acc[h][i]);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const __m512 inv = _mm512_set1_ps(inv_sum[g0 + h]);
      for (int i = 0; i < NV; ++i)
        _mm512_storeu_ps(out + (g0 + h) * kHeadDim + 16 * i, _mm512_mul_ps(acc[h][i], inv));
    }
  }
}
#endif  // __AVX512F__

// Decode attention, one query token per sequence, over stored rows: per (sequence, kv head), every
// query head of the group against each key row once (grouped-query attention), float32
// accumulation.
template <typename scalar_t, typename cache_t>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& k_scale, const at::Tensor& v_scale,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                 at::Tensor& out, bool per_row) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = reinterpret_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* v_ptr = reinterpret_cast<const cache_t*>(v_cache.data_ptr());
  const float* ks_ptr = k_scale.data_ptr<float>();
  const float* vs_ptr = v_scale.data_ptr<float>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_stride_b = q.stride(0), q_stride_h = q.stride(1);
  const int64_t o_stride_b = out.stride(0), o_stride_h = out.stride(1);
  const float fscale = static_cast<float>(scale);
#if defined(VLINFER_AVX2_DECODE)
  if (decode_attention_avx2<scalar_t, cache_t>(q, k_cache, v_cache, ks_ptr, vs_ptr, per_row,
                                               block_tables, seq_lens, scale, out))
    return;
#endif

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * head_dim), acc(group * head_dim), row(head_dim), v_scales,
      inv_sum;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, kvh = work % num_kv_heads;
      const int64_t len = lens[b];
      scaled_query_group(q_ptr, q_stride_b, q_stride_h, b, kvh, group, head_dim, fscale, qf.data());
#if defined(__AVX512F__)
      if constexpr (kVectorRows<cache_t>) {
        if (head_dim == 64 || head_dim == 128) {
          const int32_t* table = tables + b * max_blocks;
          if (head_dim == 64)
            decode_one_quantized<4>(qf.data(), group, k_ptr, v_ptr, ks_ptr, vs_ptr, per_row, table,
                                    block_size, num_kv_heads, kvh, len, acc.data(), scores,
                                    v_scales, inv_sum);
          else
            decode_one_quantized<8>(qf.data(), group, k_ptr, v_ptr, ks_ptr, vs_ptr, per_row, table,
                                    block_size, num_kv_heads, kvh, len, acc.data(), scores,
                                    v_scales, inv_sum);
          for (int64_t g = 0; g < group; ++g) {
            scalar_t* ov = o_ptr + b * o_stride_b + (kvh * group + g) * o_stride_h;
            for (int64_t d = 0; d < head_dim; ++d)
              ov[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
          }
          continue;
        }
      }
#endif
      scores.assign(group * len, 0.f);
      // Token t's stored row of this KV head into `row`, as stored (unscaled); returns its scale.
      auto load_row = [&](const cache_t* cache, const float* scales, int64_t t) {
        const int64_t slot = tables[b * max_blocks + t / block_size] * block_size + t % block_size;
        const int64_t at = slot * num_kv_heads + kvh;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(cache[at * head_dim + d]);
        return per_row ? scales[at] : scales[0];
      };
      for (int64_t t = 0; t < len; ++t) {
        const float row_scale = load_row(k_ptr, ks_ptr, t);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
          scores[g * len + t] = s * row_scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax_in_place(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float row_scale = load_row(v_ptr, vs_ptr, t);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t] * row_scale;
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* ov = o_ptr + b * o_stride_b + (kvh * group + g) * o_stride_h;
        for (int64_t d = 0; d < head_dim; ++d) ov[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

// Calls fn with a value of the cache's element type (int8, bf16, fp16, fp8 e4m3 / e5m2).
template <typename Fn>
void dispatch_cache(at::ScalarType type, Fn&& fn) {
  switch (type) {
    case at::kChar: fn(int8_t{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    case at::kFloat8_e4m3fn: fn(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: fn(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "no quantized KV kernel for cache dtype ", type);
  }
}

void check_scales(const at::Tensor& cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
                  bool per_row) {
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat,
              "scales must be float32");
  TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous(), "scales must be contiguous");
  if (per_row) {
    TORCH_CHECK(k_scale.sizes() == cache.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
                "int8 caches need one scale per slot and KV head");
  } else {
    TORCH_CHECK(k_scale.numel() == 1 && v_scale.numel() == 1,
                "floating caches take one scale per tensor");
  }
}

}  // namespace

void store_kvcache_quantized(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                             at::Tensor& v_cache, at::Tensor& k_scale, at::Tensor& v_scale,
                             const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
              "rows do not fit the cache");
  const bool per_row = k_cache.scalar_type() == at::kChar;
  check_scales(k_cache, k_scale, v_scale, per_row);
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(s[i] < num_slots, "slot ", s[i], " outside the cache");
  auto k = key.contiguous(), v = value.contiguous();
  dispatch_cache(k_cache.scalar_type(), [&](auto cache_value) {
    using cache_t = decltype(cache_value);
    AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, k.scalar_type(), "store_kvcache_quantized", [&] {
        store_impl<scalar_t, cache_t>(k, k_cache, k_scale, s, per_row);
        store_impl<scalar_t, cache_t>(v, v_cache, v_scale, s, per_row);
      });
  });
}

at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& k_scale,
                                            const at::Tensor& v_scale,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "contiguous rows needed");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "int32 tables");
  const bool per_row = k_cache.scalar_type() == at::kChar;
  check_scales(k_cache, k_scale, v_scale, per_row);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  dispatch_cache(k_cache.scalar_type(), [&](auto cache_value) {
    using cache_t = decltype(cache_value);
    AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_quantized", [&] {
        decode_impl<scalar_t, cache_t>(q, k_cache, v_cache, k_scale, v_scale, tables, lens, scale,
                                       out, per_row);
      });
  });
  return out;
}
