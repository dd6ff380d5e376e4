#pragma once
// Choosing the next token from the full vocabulary's logits: greedy (argmax), or a draw
// from softmax(logits / temperature) restricted by top-k and then top-p (Megatron's
// text-generation sampling). A draw uses exactly one uniform number of the generator
// (inverse CDF), so a seeded run picks the same tokens whatever produced the logits.
#include <ATen/core/Generator.h>
#include <ATen/Tensor.h>
#include <torch/arg.h>

#include <cstdint>

namespace megatorch::inference {

struct SamplingOptions {
  TORCH_ARG(bool, greedy) = true;
  TORCH_ARG(double, temperature) = 1.0;  // > 0
  TORCH_ARG(int64_t, top_k) = 0;         // 0: off; 1 is greedy
  TORCH_ARG(double, top_p) = 0.0;        // 0: off; else in (0, 1]

  // TORCH_ARG leaves the struct in `private:`.
 public:
  // Fails, naming the flag, on a temperature <= 0, a negative top-k or top-p outside [0, 1].
  void validate() const;
};

// logits / temperature with everything outside the top-k, then outside the top-p
// nucleus, set to -inf; `logits` is [V] (fp32). The nucleus keeps the most likely tokens
// whose cumulative probability first reaches top_p (at least one).
at::Tensor filter_logits(const at::Tensor& logits, const SamplingOptions& options);

// The chosen token id of `logits` [V]; `generator` (a CPU generator) is used when
// sampling, once per call.
int64_t sample_token(const at::Tensor& logits, const SamplingOptions& options, at::Generator& generator);

}  // namespace megatorch::inference
