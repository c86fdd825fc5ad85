// The decoder layers of a dense model (Llama, SmolLM2, Qwen3, the Qwen3-VL text layers) over a step
// of decoding sequences, in one call: per layer, the kernels its modules run one by one
// (models/llama.py LlamaDecoderLayer: norm, qkv, q/k norm, rotary, cache write, decode attention,
// o, norm, gate_up, SiLU-and-multiply, down), in the same order, on the same tensors, so the result
// is bit for bit the unfused layers'.
//
// Why: a single stream reads every weight once per token, ~14 ms of streaming for SmolLM2-135M in
// float32, and the modules' Python between the kernels (module calls, views, dispatch: ~12 calls a
// layer) added ~4-5 ms to that (profiled on the 2-vCPU EPYC: linears 11.2 of an 18.4 ms step,
// attention 0.9, LM head 2.6). A DenseDecodeStack holds every layer's weights once
// (ops/cpu/backend.py dense_decode_stack, when all four projections of every layer are on 32-output
// panels) and runs a decode step's layers in one call: one layer per call from Python still cost
// ~20 us a layer in arguments and module calls. A cache stored in another dtype (kv_cache_dtype,
// csrc/kv_quant.cpp) runs its quantizing write and decode kernels here, as Attention.forward's
// unfused path does: without it an int8 cache lost the fused step and paid the Python per layer.
#include <torch/extension.h>

#include <vector>

#include "decode_layer.h"
#include "kernels.h"

namespace {

enum Projection { kQkv, kO, kGateUp, kDown };

// One projection: dense panels, or int8 panels through the kernel and path
// int8_panels.linear takes for W8A16 (digits: int8_panels.digits' rule), so the same bits.
at::Tensor project(const DenseDecodeStack::LayerWeights& w, const DenseDecodeStack::Attention& a,
                   Projection p, const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& bias) {
  if (w.int8_comp.empty()) return panel_linear(x, weight, bias);
  const int64_t digits =
    x.scalar_type() == at::kBFloat16 && x.size(0) > a.int8_widen_rows ? 0 : 2;
  return int8_vnni_linear(x, weight, w.int8_comp[p], w.int8_scale[p], bias, digits);
}

// One layer: x [R, H], the previous layer's MLP output (or the embeddings, residual undefined: the
// first layer); cos / sin [R, head_dim] float32; the layer's caches [blocks, block_size, kv_heads,
// head_dim] and, for a cache in another dtype, their scales (else undefined); one query token per
// sequence (R sequences). Returns the MLP's output and the residual
// stream, as LlamaDecoderLayer.forward does.
std::vector<at::Tensor> decode_layer(const DenseDecodeStack::LayerWeights& w,
                                     const DenseDecodeStack::Attention& a, const at::Tensor& x,
                                     const at::Tensor& residual, const at::Tensor& cos,
                                     const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor k_scale, at::Tensor v_scale,
                                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens) {
  at::Tensor h, res;
  if (residual.defined()) {
    auto normed = add_rms_norm(x, residual, w.input_norm, a.eps);
    h = normed[0];
    res = normed[1];
  } else {
    h = rms_norm(x, w.input_norm, a.eps);
    res = x;
  }
  const int64_t rows = x.size(0), q_size = a.num_heads * a.head_dim,
                kv_size = a.num_kv_heads * a.head_dim;
  const auto qkv = project(w, a, kQkv, h, w.qkv, w.qkv_bias);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, a.num_heads, a.head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, a.num_kv_heads, a.head_dim});
  const at::Tensor v =
    qkv.narrow(1, q_size + kv_size, kv_size).view({rows, a.num_kv_heads, a.head_dim});
  if (w.q_norm.has_value()) {
    q = rms_norm(q, *w.q_norm, a.qk_eps);
    k = rms_norm(k, *w.k_norm, a.qk_eps);
  }
  rotary_inplace(q, cos, sin);
  rotary_inplace(k, cos, sin);
  at::Tensor attn;
  if (k_scale.defined()) {
    store_kvcache_quantized(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping);
    attn = paged_decode_attention_quantized(q, k_cache, v_cache, k_scale, v_scale, block_tables,
                                            seq_lens, a.scale);
  } else {
    store_kvcache(k, v, k_cache, v_cache, slot_mapping);
    attn = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, a.scale);
  }
  attn = attn.flatten(1);
  auto normed = add_rms_norm(project(w, a, kO, attn, w.o, w.o_bias), res, w.post_norm, a.eps);
  const auto act = silu_and_mul(project(w, a, kGateUp, normed[0], w.gate_up, w.gate_up_bias));
  return {project(w, a, kDown, act, w.down, w.down_bias), normed[1]};
}

}  // namespace

DenseDecodeStack::DenseDecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   double scale, double eps, double qk_eps,
                                   int64_t int8_widen_rows)
    : attention_{num_heads, num_kv_heads, head_dim, scale, eps, qk_eps, int8_widen_rows} {}

void DenseDecodeStack::add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm,
                                 const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
                                 const c10::optional<at::Tensor>& q_norm,
                                 const c10::optional<at::Tensor>& k_norm, const at::Tensor& o,
                                 const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up,
                                 const c10::optional<at::Tensor>& gate_up_bias,
                                 const at::Tensor& down,
                                 const c10::optional<at::Tensor>& down_bias,
                                 const std::vector<at::Tensor>& int8_comp,
                                 const std::vector<at::Tensor>& int8_scale) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
              "DenseDecodeStack: q_norm and k_norm come together");
  const bool int8 = qkv.scalar_type() == at::kChar;
  // a layer's four projections share one form: all int8 panels with their sums and scales, or
  // all dense panels
  for (const auto* p : {&qkv, &o, &gate_up, &down})
    TORCH_CHECK((p->scalar_type() == at::kChar) == int8,
                "DenseDecodeStack: a layer's projections are all int8 or all dense");
  TORCH_CHECK(int8 ? int8_comp.size() == 4 && int8_scale.size() == 4 &&
                       attention_.int8_widen_rows >= 0
                   : int8_comp.empty() && int8_scale.empty(),
              "DenseDecodeStack: int8 projections take 4 weight sums and 4 scales and a stack "
              "built with int8_widen_rows; dense ones none, got ",
              int8_comp.size(), " and ", int8_scale.size());
  layers_.push_back(LayerWeights{input_norm, post_norm, qkv, o, gate_up, down, qkv_bias, q_norm,
                                 k_norm, o_bias, gate_up_bias, down_bias, int8_comp,
                                 int8_scale});
}

std::vector<at::Tensor> DenseDecodeStack::forward(const at::Tensor& x, const at::Tensor& cos,
                                                  const at::Tensor& sin,
                                                  const std::vector<at::Tensor>& k_caches,
                                                  const std::vector<at::Tensor>& v_caches,
                                                  const at::Tensor& slot_mapping,
                                                  const at::Tensor& block_tables,
                                                  const at::Tensor& seq_lens,
                                                  const std::vector<at::Tensor>& k_scales,
                                                  const std::vector<at::Tensor>& v_scales) const {
  TORCH_CHECK(x.dim() == 2, "DenseDecodeStack: x must be [sequences, hidden], got ", x.sizes());
  TORCH_CHECK(seq_lens.numel() == x.size(0),
              "DenseDecodeStack: one query token per sequence: ", x.size(0), " rows for ",
              seq_lens.numel(), " sequences");
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "DenseDecodeStack: ", layers_.size(), " layers, ", k_caches.size(), " key and ",
              v_caches.size(), " value caches");
  const bool quantized = !k_scales.empty();
  TORCH_CHECK(!quantized ||
                (k_scales.size() == layers_.size() && v_scales.size() == k_scales.size()),
              "DenseDecodeStack: ", layers_.size(), " layers, ", k_scales.size(), " key and ",
              v_scales.size(), " value cache scales");
  const auto cos_f = cos.to(at::kFloat).contiguous(), sin_f = sin.to(at::kFloat).contiguous();
  const auto tables = block_tables.to(at::kInt), lens = seq_lens.to(at::kInt);
  std::vector<at::Tensor> out{
    x, at::Tensor()};  // (mlp output, residual); the first layer has no residual
  for (size_t i = 0; i < layers_.size(); ++i)
    out = decode_layer(layers_[i], attention_, out[0], out[1], cos_f, sin_f, k_caches[i],
                       v_caches[i], quantized ? k_scales[i] : at::Tensor(),
                       quantized ? v_scales[i] : at::Tensor(), slot_mapping, tables, lens);
  return out;
}
