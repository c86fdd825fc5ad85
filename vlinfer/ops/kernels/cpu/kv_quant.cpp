// A KV cache stored in another dtype than the compute dtype (kv_cache_dtype): the quantizing cache write and decode
// attention reading the stored rows. int8 rows carry one float32 scale per token and KV head (written here, beside
// the row); bf16 / fp16 / fp8 rows one per-tensor scale. Meaning defined by vlinfer/ops/kv_quant_reference.py.
// Plain loops over float32 the compiler vectorizes at each instruction-set level the extension is built for; a row's
// scale multiplies its dot product (K) or its softmax weight (V), not each element.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_vectors.h"

namespace {

constexpr float kInt8Max = 127.f;

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// One row of head_dim values quantized into a cache row; returns the row's scale (int8) or the tensor's.
template <typename cache_t>
inline float quantize_row(const float* x, int64_t n, cache_t* out, float tensor_scale) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    float amax = 0.f;
    for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float scale = std::max(amax / kInt8Max, std::numeric_limits<float>::min());
    const float inv = 1.f / scale;
    for (int64_t d = 0; d < n; ++d) {
      // Round half away from zero would differ from torch.round's half-to-even: nearbyint is half-to-even.
      const float r = std::nearbyint(x[d] * inv);
      out[d] = static_cast<int8_t>(std::min(kInt8Max, std::max(-kInt8Max, r)));
    }
    return scale;
  } else {
    const float limit = static_cast<float>(std::numeric_limits<cache_t>::max());
    const float inv = 1.f / tensor_scale;
    for (int64_t d = 0; d < n; ++d) out[d] = static_cast<cache_t>(std::min(limit, std::max(-limit, x[d] * inv)));
    return tensor_scale;
  }
}

template <typename scalar_t, typename cache_t>
void store_impl(const at::Tensor& x, at::Tensor& cache, at::Tensor& scale, const int64_t* slots, bool per_row) {
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
        const float s = quantize_row(row.data(), head_dim, cp + (slots[i] * heads + h) * head_dim, tensor_scale);
        if (per_row) sp[slots[i] * heads + h] = s;
      }
    }
  });
}

// Decode attention, one query token per sequence, over stored rows: per (sequence, kv head), every query head of
// the group against each key row once (grouped-query attention), float32 accumulation.
template <typename scalar_t, typename cache_t>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scale,
                 const at::Tensor& v_scale, const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
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

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * head_dim), acc(group * head_dim), row(head_dim);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, kvh = work % num_kv_heads;
      const int64_t len = lens[b];
      scores.assign(group * len, 0.f);
      scaled_query_group(q_ptr, q_stride_b, q_stride_h, b, kvh, group, head_dim, fscale, qf.data());
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

void check_scales(const at::Tensor& cache, const at::Tensor& k_scale, const at::Tensor& v_scale, bool per_row) {
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat, "scales must be float32");
  TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous(), "scales must be contiguous");
  if (per_row) {
    TORCH_CHECK(k_scale.sizes() == cache.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
                "int8 caches need one scale per slot and KV head");
  } else {
    TORCH_CHECK(k_scale.numel() == 1 && v_scale.numel() == 1, "floating caches take one scale per tensor");
  }
}

}  // namespace

void store_kvcache_quantized(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                             at::Tensor& k_scale, at::Tensor& v_scale, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "rows do not fit the cache");
  const bool per_row = k_cache.scalar_type() == at::kChar;
  check_scales(k_cache, k_scale, v_scale, per_row);
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(s[i] < num_slots, "slot ", s[i], " outside the cache");
  auto k = key.contiguous(), v = value.contiguous();
  dispatch_cache(k_cache.scalar_type(), [&](auto cache_value) {
    using cache_t = decltype(cache_value);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kvcache_quantized", [&] {
      store_impl<scalar_t, cache_t>(k, k_cache, k_scale, s, per_row);
      store_impl<scalar_t, cache_t>(v, v_cache, v_scale, s, per_row);
    });
  });
}

at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                            const at::Tensor& k_scale, const at::Tensor& v_scale,
                                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous rows needed");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  const bool per_row = k_cache.scalar_type() == at::kChar;
  check_scales(k_cache, k_scale, v_scale, per_row);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  dispatch_cache(k_cache.scalar_type(), [&](auto cache_value) {
    using cache_t = decltype(cache_value);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_quantized",
                                    [&] {
      decode_impl<scalar_t, cache_t>(q, k_cache, v_cache, k_scale, v_scale, tables, lens, scale, out, per_row);
    });
  });
  return out;
}
