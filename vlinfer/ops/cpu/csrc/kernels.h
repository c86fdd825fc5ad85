// The entry points one kernel file defines and another calls: paged_ops.cpp registers them all,
// decode_layer.cpp composes a decode step from them. One declaration each, here.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

// cpu/csrc/paged_ops.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale);
void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping);
void rotary_inplace(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
// cpu/csrc/attention_bf16.cpp
bool bf16_attention_available();
bool paged_decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, at::Tensor& out);
at::Tensor vision_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, double scale);
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                       const at::Tensor& block_tables, double scale, at::Tensor& out);
void prefill_attention_int8(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& k_scale,
                            const at::Tensor& v_scale, const at::Tensor& cu_seqlens_q,
                            const at::Tensor& seq_lens, const at::Tensor& block_tables,
                            double scale, at::Tensor& out);
// cpu/csrc/moe_experts.cpp
at::Tensor expert_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends);
at::Tensor expert_panel_matmul(const at::Tensor& x, const at::Tensor& panels,
                               const at::Tensor& ends);
bool expert_panels_available();
// cpu/csrc/panel_linear.cpp
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias);
bool panel_linear_available(at::ScalarType dtype);
// cpu/csrc/int8_vnni.cpp
bool int8_vnni_available();
std::vector<at::Tensor> int8_vnni_quantize(const at::Tensor& x, int64_t digits);
at::Tensor int8_vnni_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& comp,
                            const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                            int64_t digits);
// cpu/csrc/lora_panels.cpp
void lora_panels_add(const at::Tensor& x, at::Tensor& y, const at::Tensor& a_panels,
                     const at::Tensor& b_panels, const at::Tensor& k_ranges,
                     const c10::optional<at::Tensor>& rows, const at::Tensor& offsets);
// cpu/csrc/kv_quant.cpp
void store_kvcache_quantized(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                             at::Tensor& v_cache, at::Tensor& k_scale, at::Tensor& v_scale,
                             const at::Tensor& slot_mapping);
at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& k_scale,
                                            const at::Tensor& v_scale,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double scale);
// cpu/csrc/linear_attention.cpp
std::string linear_attention_kernels();
at::Tensor gated_delta_rule_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                                   const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                   const at::Tensor& has_state, double scale);
at::Tensor causal_conv1d_decode(const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, at::Tensor conv_state,
                                const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                const at::Tensor& has_state);
// cpu/csrc/linear_attention_prefill.cpp
at::Tensor gated_delta_rule_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                                    const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                    const at::Tensor& has_state, double scale, int64_t chunk,
                                    int64_t plant);
at::Tensor causal_conv1d_prefill(const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias, at::Tensor conv_state,
                                 const at::Tensor& cu_seqlens, const at::Tensor& slots,
                                 const at::Tensor& has_state);
