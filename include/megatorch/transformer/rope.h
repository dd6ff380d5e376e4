#pragma once
// RoPE's frequencies, with the context-extension schemes of today's checkpoints, as
// HuggingFace transformers computes them (modeling_rope_utils.py: rope_type "default",
// "linear", "dynamic", "yarn", "llama3"), over the first rotary_dim channels of a head
// (partial rotary: HF's partial_rotary_factor, Megatron's --rotary-percent).
//
//   default   inv_freq_i = base^(-2i/r)
//   linear    inv_freq / factor (position interpolation, Chen et al.)
//   dynamic   NTK: base · (factor·S/max_positions − (factor − 1))^(r/(r−2)) for a sequence of
//             S > max_positions tokens (S = max_positions below it); the angles depend on S,
//             not on the position alone
//   yarn      per channel between interpolation (1/factor) and extrapolation by a linear ramp
//             over the channels whose wavelength lies between beta_fast and beta_slow turns of
//             original_max_position_embeddings; cos and sin scaled by attention_factor
//             (0.1·ln(factor) + 1 by default)
//   llama3    channels with wavelength above original/low_freq_factor divided by factor,
//             below original/high_freq_factor kept, smoothly mixed in between (Llama 3.1)
#include <torch/arg.h>
#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace megatorch::transformer {

enum class RopeType { kDefault, kLinear, kDynamic, kYarn, kLlama3 };
const char* to_string(RopeType t);                // HF's rope_type: "default", "linear", ...
RopeType parse_rope_type(const std::string& s);  // the inverse, failing with the valid names

struct RopeScaling {
  TORCH_ARG(RopeType, type) = RopeType::kDefault;
  TORCH_ARG(double, factor) = 1.0;
  // The context the model was pretrained for (llama3, yarn), and for dynamic HF's
  // max_position_embeddings, above which it scales.
  TORCH_ARG(int64_t, original_max_position_embeddings) = 0;
  TORCH_ARG(double, low_freq_factor) = 1.0;   // llama3
  TORCH_ARG(double, high_freq_factor) = 4.0;  // llama3
  TORCH_ARG(double, beta_fast) = 32.0;        // yarn
  TORCH_ARG(double, beta_slow) = 1.0;         // yarn
  // yarn: the cos/sin scale; 0 derives it from factor (and mscale / mscale_all_dim when both set).
  TORCH_ARG(double, attention_factor) = 0.0;
  TORCH_ARG(double, mscale) = 0.0;
  TORCH_ARG(double, mscale_all_dim) = 0.0;
  TORCH_ARG(bool, truncate) = true;  // yarn: round the ramp's ends to whole channels

 public:  // TORCH_ARG leaves the members private
  // Fails naming the field a type needs and lacks (a factor >= 1, original positions, ...).
  void validate() const;
  bool operator==(const RopeScaling& o) const;
  bool operator!=(const RopeScaling& o) const { return !(*this == o); }
};

// The inverse frequencies [rotary_dim / 2] (double) for a sequence of `seq_length` tokens
// (read by dynamic only), and the scale yarn puts on cos and sin (1 otherwise).
struct RopeFrequencies {
  at::Tensor inv_freq;
  double attention_scaling = 1.0;
};
RopeFrequencies rope_inverse_frequencies(int64_t rotary_dim, double base, const RopeScaling& scaling,
                                         int64_t seq_length);

// Angles [seq_length, 1, 1, rotary_dim] (fp32, rotate-half layout) of positions
// [0, seq_length) under `scaling`; rope_frequencies(s, d, base, device) is the default type
// over the whole head.
at::Tensor rope_frequencies(int64_t seq_length, int64_t rotary_dim, double base, const RopeScaling& scaling,
                            c10::Device device);

}  // namespace megatorch::transformer
