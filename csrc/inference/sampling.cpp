#include "megatorch/inference/sampling.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "megatorch/check.h"

namespace megatorch::inference {

void SamplingOptions::validate() const {
  MEGATORCH_CHECK(temperature() > 0, "sampling: expected --temperature > 0, got ", temperature(),
                  "; for greedy decoding leave out --temperature, --top-k and --top-p");
  MEGATORCH_CHECK(top_k() >= 0, "sampling: expected --top-k >= 0 (0: off), got ", top_k());
  MEGATORCH_CHECK(top_p() >= 0 && top_p() <= 1, "sampling: expected --top-p in [0, 1] (0: off), got ", top_p());
}

at::Tensor filter_logits(const at::Tensor& logits, const SamplingOptions& o) {
  o.validate();
  MEGATORCH_CHECK(logits.dim() == 1 && logits.size(0) > 0, "sampling: expected logits [V], got ", logits.sizes());
  const double inf = std::numeric_limits<double>::infinity();
  at::Tensor out = logits.to(at::kFloat) / o.temperature();
  const int64_t v = out.size(0);
  if (o.top_k() > 0 && o.top_k() < v) {
    const at::Tensor kth = std::get<0>(at::topk(out, o.top_k())).select(0, o.top_k() - 1);
    out = out.masked_fill(out < kth, -inf);
  }
  if (o.top_p() > 0 && o.top_p() < 1) {
    const auto [sorted, order] = at::sort(out, /*dim=*/0, /*descending=*/true);
    const at::Tensor cumulative = at::softmax(sorted, 0).cumsum(0);
    // Drop a token when the ones before it already reach top_p: shift right by one so
    // the token that crosses top_p stays, and the most likely one always does.
    at::Tensor drop = at::zeros_like(cumulative, at::kBool);
    drop.narrow(0, 1, v - 1).copy_(cumulative.narrow(0, 0, v - 1) > o.top_p());
    out = out.masked_fill(at::zeros_like(drop).scatter(0, order, drop), -inf);
  }
  return out;
}

int64_t sample_token(const at::Tensor& logits, const SamplingOptions& o, at::Generator& generator) {
  if (o.greedy() || o.top_k() == 1) {
    MEGATORCH_CHECK(logits.dim() == 1 && logits.size(0) > 0, "sampling: expected logits [V], got ", logits.sizes());
    return logits.argmax().item<int64_t>();
  }
  const at::Tensor probs = at::softmax(filter_logits(logits.to(at::kCPU), o).to(at::kDouble), 0);
  // Inverse CDF: the first token whose cumulative probability exceeds one uniform draw.
  const double u = at::rand({1}, generator, at::TensorOptions().dtype(at::kDouble)).item<double>();
  const at::Tensor cumulative = probs.cumsum(0);
  int64_t token = (cumulative <= u).sum().item<int64_t>();
  // Rounding can leave the total a hair below u: then the last token that can be drawn.
  return std::min(token, at::nonzero(probs > 0).max().item<int64_t>());
}

}  // namespace megatorch::inference
