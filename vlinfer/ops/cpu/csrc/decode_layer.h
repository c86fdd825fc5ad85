// The decoder layers of a dense model for decode steps, weights held once:
// cpu/csrc/decode_layer.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

class DenseDecodeStack {
 public:
  struct LayerWeights {
    at::Tensor input_norm, post_norm, qkv, o, gate_up, down;
    c10::optional<at::Tensor> qkv_bias, q_norm, k_norm, o_bias, gate_up_bias, down_bias;
    // int8 projections (csrc/int8_vnni.cpp panels, W8A16): qkv, o, gate_up, down's weight sums
    // and channel scales; empty: the projections are dense panels
    std::vector<at::Tensor> int8_comp, int8_scale;
  };
  struct Attention {
    int64_t num_heads, num_kv_heads, head_dim;
    double scale, eps, qk_eps;
    // int8 layers' bf16 calls above this many rows run the widened panels (int8_panels.digits)
    int64_t int8_widen_rows;
  };

  // Every layer's attention shape: query / kv heads, head_dim, softmax scale; RMSNorm eps of the
  // layer norms and of the per-head q / k norms; int8_widen_rows: int8_panels.WIDEN_ROWS (-1:
  // no int8 layers).
  DenseDecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                   double eps, double qk_eps, int64_t int8_widen_rows);
  // The next layer's weights: norms, the four projections in panels and their biases (or none), q /
  // k norms (or none); for int8 projections (int8 [N / 32, K / 4, 32, 4] panels) the four
  // projections' weight sums and channel scales (else empty).
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const at::Tensor& qkv,
                 const c10::optional<at::Tensor>& qkv_bias, const c10::optional<at::Tensor>& q_norm,
                 const c10::optional<at::Tensor>& k_norm, const at::Tensor& o,
                 const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up,
                 const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                 const c10::optional<at::Tensor>& down_bias,
                 const std::vector<at::Tensor>& int8_comp,
                 const std::vector<at::Tensor>& int8_scale);
  // A decode step (one token per sequence) through every layer: x [R, H] embeddings, cos / sin [R,
  // head_dim], each layer's caches, the step's slots / block tables / lengths, and each layer's
  // cache scales for a cache in another dtype (empty: the caches hold the compute dtype). Returns
  // the last layer's (mlp output, residual).
  std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  const std::vector<at::Tensor>& k_caches,
                                  const std::vector<at::Tensor>& v_caches,
                                  const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens,
                                  const std::vector<at::Tensor>& k_scales,
                                  const std::vector<at::Tensor>& v_scales) const;
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  Attention attention_;
  std::vector<LayerWeights> layers_;
};
