#pragma once
// Plain parameter structs of the CUDA kernels and their launchers: pointers, sizes,
// strides and scalars only, no torch types, so the .cu files compile with the CUDA
// headers alone. The torch-facing code (csrc/kernels/*.cpp) checks the tensors,
// fills a struct and calls the launcher on the current stream (`stream` is a
// cudaStream_t). Every tensor is contiguous unless a stride says otherwise.
#include <cstdint>

namespace megatorch::kernels::cuda {

enum class DType : int { kFloat, kHalf, kBFloat16 };

// ---- bias_gelu.cu ----
struct BiasGeluParams {
  const void* input;  // [rows, cols]
  const void* bias;   // [cols]
  const void* grad;   // backward only: [rows, cols]
  void* out;          // forward: output; backward: grad of input
  int64_t rows, cols;
  DType dtype;
};
void bias_gelu_forward(const BiasGeluParams& p, void* stream);
void bias_gelu_backward(const BiasGeluParams& p, void* stream);

// ---- bias_dropout_add.cu ----
// Dropout draws: element i = row·cols + col takes component i % 4 of the Philox4x32-10
// block (seed, subsequence i / 4, offset), i.e. curand_init(seed, i / 4, offset) then
// curand_uniform4: one 128-bit block per subsequence, so the caller reserves an offset
// increment of 4 (kBiasDropoutAddPhiloxIncrement) on the generator per call, whatever
// the size. The draws do not depend on the launch configuration. kept = u < keep_prob.
constexpr uint64_t kBiasDropoutAddPhiloxIncrement = 4;
struct BiasDropoutAddParams {
  const void* input;     // [rows, cols]
  const void* bias;      // [cols] or null
  const void* residual;  // [rows, cols]
  void* out;             // [rows, cols]
  bool* mask;            // [rows, cols] kept elements, or null when not training
  int64_t rows, cols;
  float keep_prob;  // 1 - p
  uint64_t seed, offset;  // Philox state taken from the current CUDA generator
  DType dtype;
};
void bias_dropout_add_forward(const BiasDropoutAddParams& p, void* stream);

// ---- swiglu.cu ----
struct SwigluParams {
  const void* input;  // [rows, 2f]
  const void* grad;   // backward only: [rows, f]
  void* out;          // forward: [rows, f]; backward: grad of input [rows, 2f]
  int64_t rows, f;
  DType dtype;
};
void swiglu_forward(const SwigluParams& p, void* stream);
void swiglu_backward(const SwigluParams& p, void* stream);

// ---- rotary.cu ----
struct RotaryParams {
  const void* input;  // [s, b·heads, d] (or the incoming gradient in backward)
  const float* cos;   // [s, r] fp32
  const float* sin;   // [s, r] fp32
  void* out;           // [s, b·heads, d]
  int64_t s, bh, d, r;
  bool backward;  // apply the transposed rotation
  DType dtype;
};
void rotary(const RotaryParams& p, void* stream);

// ---- norms.cu ----
// LayerNorm (rms = false) and RMSNorm (rms = true) over the last dim, fp32 statistics.
// Weight and bias have weight_dtype: fp32, or the input's dtype (no conversion per call).
// Backward: norm_backward_partial_rows(p) (call it with every other field filled in:
// the pointers' alignment picks the kernel) says how many rows the fp32 workspaces
// grad_weight_partial / grad_bias_partial ([partial_rows, cols] each) must have; the
// launcher writes per-block partial sums there and reduces them, in a fixed order, into
// grad_weight / grad_bias ([cols], weight_dtype) with a second kernel.
struct NormParams {
  const void* input;   // [rows, cols]
  const void* weight;  // [cols], weight_dtype
  const void* bias;    // [cols] or null (LayerNorm only), weight_dtype
  const void* grad;    // backward only: [rows, cols]
  void* out;           // forward: output; backward: grad of input
  float* mean;         // [rows] (LayerNorm only): written by the forward, read by the backward
  float* rstd;         // [rows]
  float* grad_weight_partial;  // backward: fp32 workspace [partial_rows, cols]
  float* grad_bias_partial;    // backward: fp32 workspace [partial_rows, cols], or null (RMSNorm)
  void* grad_weight;           // backward: [cols], weight_dtype
  void* grad_bias;             // backward: [cols], weight_dtype, or null (RMSNorm)
  int64_t rows, cols, partial_rows;
  float eps;
  bool rms;
  DType dtype;
  DType weight_dtype;  // kFloat or dtype
};
void norm_forward(const NormParams& p, void* stream);
int64_t norm_backward_partial_rows(const NormParams& p);
void norm_backward(const NormParams& p, void* stream);

// ---- softmax.cu ----
struct SoftmaxParams {
  const void* input;  // [batch, heads, sq, sk] (causal: [batch·heads, sq, sk], heads = 1)
  const bool* mask;   // null, or indexed with the strides below (0 where broadcast)
  int64_t mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k;
  const void* grad;  // backward only
  void* out;
  int64_t batch, heads, sq, sk;
  float scale;
  bool causal;
  DType dtype;
};
void softmax_forward(const SoftmaxParams& p, void* stream);
void softmax_backward(const SoftmaxParams& p, void* stream);  // input = the forward's output

// ---- cross_entropy_local.cu ----
struct CrossEntropyLocalParams {
  const void* logits;     // [rows, cols]
  const int64_t* target;  // [rows], global ids
  float* max;             // [rows] local max over the real columns
  float* sum_exp;         // [rows] Σ exp(x - local max) over the real columns
  float* target_logit;    // [rows] raw target logit, 0 when the target is in another shard
  float* sum_logits;      // [rows] Σ x over the real columns
  int64_t rows, cols, vocab_start, real_cols;
  DType dtype;
};
void cross_entropy_local(const CrossEntropyLocalParams& p, void* stream);

// ---- cross_entropy_backward.cu ----
// The gradient of the per-token loss with respect to this rank's logits shard, in one
// pass: grad[r, c] = g'_r · (p - target_weight·[c = target[r] - vocab_start]
// - uniform_weight·[c < real_cols]), p = exp(x - log_sum_exp[r]) for c < real_cols and
// 0 for the padded columns, g'_r = grad_loss[r] or 0 where target[r] == ignore_index.
struct CrossEntropyBackwardParams {
  const void* logits;        // [rows, cols]
  const int64_t* target;     // [rows], global ids
  const float* log_sum_exp;  // [rows] the global log Σ exp over the real vocabulary
  const float* grad_loss;    // [rows] incoming gradient of the per-token loss
  void* grad;                // [rows, cols] output, the logits' dtype (not the logits)
  int64_t rows, cols, vocab_start, real_cols, ignore_index;
  float target_weight;   // 1 - ε, rounded to fp32
  float uniform_weight;  // ε / K (K: the real vocabulary size), rounded to fp32; 0 without smoothing
  DType dtype;
};
void cross_entropy_backward(const CrossEntropyBackwardParams& p, void* stream);

// ---- fused_adamw.cu (multi-tensor AdamW) ----
constexpr int kAdamWMaxTensors = 24;  // per launch; keeps the argument block < 4 KiB
struct AdamWParams {
  float* param[kAdamWMaxTensors];
  const void* grad[kAdamWMaxTensors];
  float* exp_avg[kAdamWMaxTensors];
  float* exp_avg_sq[kAdamWMaxTensors];
  void* model[kAdamWMaxTensors];  // null entries when there is no model copy
  int64_t numel[kAdamWMaxTensors];
  int count;
  int64_t max_numel;
  DType grad_dtype;
  DType model_dtype;
  bool has_model;
  float decay;  // 1 - lr·weight_decay
  float one_minus_beta1, beta2, one_minus_beta2, eps;  // 1 - beta from double, rounded once
  float step_size;             // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};
void fused_adamw(const AdamWParams& p, void* stream);

}  // namespace megatorch::kernels::cuda
