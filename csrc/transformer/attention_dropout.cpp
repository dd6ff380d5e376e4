#include "megatorch/transformer/attention_dropout.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "megatorch/check.h"

namespace megatorch::transformer {
namespace {

// Constants of splitmix64 (Steele, Lea and Flood) as int64: ATen's int64 arithmetic wraps
// modulo 2^64 like the unsigned original.
constexpr int64_t kGolden = static_cast<int64_t>(0x9E3779B97F4A7C15ULL);
constexpr int64_t kMul1 = static_cast<int64_t>(0xBF58476D1CE4E5B9ULL);
constexpr int64_t kMul2 = static_cast<int64_t>(0x94D049BB133111EBULL);

// x >> s with zeros shifted in (ATen's int64 shift is arithmetic).
at::Tensor shift_right(const at::Tensor& x, int64_t s) {
  return x.bitwise_right_shift(s).bitwise_and_((int64_t{1} << (64 - s)) - 1);
}

// splitmix64's finaliser: a bijection of 64-bit words that mixes every input bit into
// every output bit.
at::Tensor mix(at::Tensor z) {
  z = z.bitwise_xor(shift_right(z, 30)).mul_(kMul1);
  z = z.bitwise_xor(shift_right(z, 27)).mul_(kMul2);
  return z.bitwise_xor(shift_right(z, 31));
}

// The chain's next link: every index of `values` gives another word (kGolden is odd, so
// x -> x·kGolden is a bijection), mixed with the prefix's word.
at::Tensor link(const at::Tensor& prefix, const at::Tensor& values) { return mix(values.mul(kGolden).add(prefix)); }

void check_indices(const char* name, const at::Tensor& t) {
  MEGATORCH_CHECK(t.defined() && t.dim() == 1 && t.scalar_type() == at::kLong, "attention dropout: expected ", name,
                  " as a 1-D int64 tensor, got ", t.defined() ? t.toString() : std::string("an undefined tensor"),
                  t.defined() ? " of shape " : "", t.defined() ? c10::str(t.sizes()) : "");
}

}  // namespace

at::Tensor draw_attention_dropout_key(c10::Device device) {
  return at::randint(std::numeric_limits<int64_t>::max(), {}, at::TensorOptions().dtype(at::kLong).device(device));
}

at::Tensor attention_dropout_keep(const at::Tensor& key, int64_t batch, const at::Tensor& heads,
                                  const at::Tensor& q_positions, const at::Tensor& k_positions, double p) {
  MEGATORCH_CHECK(p >= 0 && p < 1, "attention dropout: expected a probability in [0, 1), got ", p);
  MEGATORCH_CHECK(key.defined() && key.numel() == 1 && key.scalar_type() == at::kLong,
                  "attention dropout: expected a one-element int64 key (draw_attention_dropout_key), got ",
                  key.defined() ? c10::str(key.scalar_type(), key.sizes()) : std::string("an undefined tensor"));
  MEGATORCH_CHECK(batch >= 1, "attention dropout: expected a batch of at least one sample, got ", batch);
  check_indices("head indices", heads);
  check_indices("query positions", q_positions);
  check_indices("key positions", k_positions);
  const auto dev = key.device();
  // One link per index, innermost last, so only the final link runs over every pair.
  const at::Tensor per_sample = link(mix(key.reshape({}).add(kGolden)), at::arange(batch, key.options()));
  const at::Tensor per_head = link(per_sample.unsqueeze(1), heads.to(dev).unsqueeze(0));
  const at::Tensor per_query = link(per_head.unsqueeze(2), q_positions.to(dev).view({1, 1, -1}));
  const at::Tensor word = link(per_query.unsqueeze(3), k_positions.to(dev).view({1, 1, 1, -1}));
  // The top 53 bits as a uniform on [0, 1): kept when at least p.
  const auto threshold = static_cast<int64_t>(std::llround(std::ldexp(p, 53)));
  return shift_right(word, 11).ge(threshold);
}

at::Tensor keyed_dropout_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& q_positions, const at::Tensor& k_positions,
                                   const at::Tensor& heads, const at::Tensor& key, double p, bool causal,
                                   double scale, const at::Tensor& visible) {
  MEGATORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && k.size(1) >= 1 &&
                      q.size(1) % k.size(1) == 0 && q.size(2) == q_positions.numel() &&
                      k.size(2) == k_positions.numel() && q.size(1) == heads.numel(),
                  "keyed_dropout_attention: expected q [b, H, Q, d], k and v [b, G, K, d] with G dividing H, ",
                  "H head indices, Q query and K key positions; got q ", q.sizes(), ", k ", k.sizes(), ", v ",
                  v.sizes(), ", ", heads.numel(), " heads, ", q_positions.numel(), " and ", k_positions.numel(),
                  " positions");
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t repeat = q.size(1) / k.size(1);
  const at::Tensor kf = k.to(acc).repeat_interleave(repeat, 1), vf = v.to(acc).repeat_interleave(repeat, 1);
  at::Tensor scores = at::matmul(q.to(acc), kf.transpose(-2, -1)) * scale;
  if (visible.defined()) {
    scores = scores.masked_fill(visible.logical_not().unsqueeze(1), -std::numeric_limits<double>::infinity());
  } else if (causal) {
    const at::Tensor later = k_positions.to(q.device()).unsqueeze(0) > q_positions.to(q.device()).unsqueeze(1);
    scores = scores.masked_fill(later, -std::numeric_limits<double>::infinity());
  }
  at::Tensor probs = at::softmax(scores, -1);
  if (p > 0) {
    const at::Tensor keep = attention_dropout_keep(key, q.size(0), heads, q_positions, k_positions, p);
    probs = probs * keep.to(acc) * (1.0 / (1.0 - p));
  }
  return at::matmul(probs, vf).to(q.scalar_type());
}

}  // namespace megatorch::transformer
