// Attention dropout keyed by position (attention_dropout.h): the keep rate, that a piece
// of the mask is the same piece of the whole mask, that the key and every index change it,
// and keyed_dropout_attention against the math written out (and SDPA at p = 0).
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cmath>

#include "megatorch/transformer/attention_dropout.h"
#include "tolerance.h"

using megatorch::transformer::attention_dropout_keep;
using megatorch::transformer::draw_attention_dropout_key;
using megatorch::transformer::keyed_dropout_attention;

namespace {

at::Tensor range(int64_t begin, int64_t end) { return torch::arange(begin, end, torch::kLong); }
const at::Tensor kKey = torch::tensor(int64_t{987654321});

}  // namespace

TEST_CASE("keyed attention dropout keeps 1 - p of the pairs", "[attention_dropout]") {
  for (double p : {0.1, 0.5, 0.9}) {
    INFO("p " << p);
    const at::Tensor keep = attention_dropout_keep(kKey, 4, range(0, 8), range(0, 128), range(0, 128), p);
    REQUIRE(keep.sizes() == at::IntArrayRef({4, 8, 128, 128}));
    REQUIRE(keep.scalar_type() == at::kBool);
    const double n = static_cast<double>(keep.numel());
    const double kept = keep.sum().item<double>();
    // Within 5 standard deviations of a binomial(n, 1 - p).
    CHECK(std::abs(kept - n * (1 - p)) < 5 * std::sqrt(n * p * (1 - p)));
    // Neighbouring pairs are independent: the rate of both kept is (1 - p)^2.
    const double both = (keep.narrow(3, 0, 127) & keep.narrow(3, 1, 127)).sum().item<double>();
    const double m = n * 127 / 128;
    CHECK(std::abs(both - m * (1 - p) * (1 - p)) < 5 * std::sqrt(m * (1 - p) * (1 - p) * (1 - (1 - p) * (1 - p))));
  }
  CHECK(attention_dropout_keep(kKey, 2, range(0, 2), range(0, 16), range(0, 16), 0.0).all().item<bool>());
}

TEST_CASE("a piece of the keyed mask is that piece of the whole mask", "[attention_dropout]") {
  const at::Tensor whole = attention_dropout_keep(kKey, 3, range(0, 6), range(0, 40), range(0, 40), 0.4);
  // Scattered positions and heads in any order, as ring steps and head shards ask for them.
  const at::Tensor heads = torch::tensor({5, 1, 2}, torch::kLong);
  const at::Tensor qs = torch::tensor({3, 39, 0, 17}, torch::kLong), ks = torch::tensor({8, 9, 30}, torch::kLong);
  const at::Tensor piece = attention_dropout_keep(kKey, 3, heads, qs, ks, 0.4);
  CHECK(torch::equal(piece, whole.index_select(1, heads).index_select(2, qs).index_select(3, ks)));
  // Another key, and a shifted head, query or key index, give other masks.
  const at::Tensor other = attention_dropout_keep(torch::tensor(int64_t{987654322}), 3, range(0, 6), range(0, 40),
                                                  range(0, 40), 0.4);
  CHECK_FALSE(torch::equal(other, whole));
  CHECK_FALSE(torch::equal(attention_dropout_keep(kKey, 3, range(1, 7), range(0, 40), range(0, 40), 0.4), whole));
  CHECK_FALSE(torch::equal(attention_dropout_keep(kKey, 3, range(0, 6), range(1, 41), range(0, 40), 0.4), whole));
  CHECK_FALSE(torch::equal(attention_dropout_keep(kKey, 3, range(0, 6), range(0, 40), range(1, 41), 0.4), whole));
  // Samples differ from each other too.
  CHECK_FALSE(torch::equal(whole[0], whole[1]));
}

TEST_CASE("keys come from the default generator and replay with its state", "[attention_dropout]") {
  torch::manual_seed(11);
  const at::Tensor a = draw_attention_dropout_key(torch::kCPU);
  const at::Tensor b = draw_attention_dropout_key(torch::kCPU);
  torch::manual_seed(11);
  CHECK(torch::equal(draw_attention_dropout_key(torch::kCPU), a));
  CHECK_FALSE(torch::equal(a, b));
  CHECK(a.dim() == 0);
  CHECK(a.scalar_type() == at::kLong);
  CHECK(a.item<int64_t>() >= 0);
}

TEST_CASE("keyed_dropout_attention: softmax, then the keyed mask over 1 - p, then V", "[attention_dropout]") {
  torch::manual_seed(3);
  const int64_t b = 2, heads = 4, groups = 2, s = 12, d = 8;
  const at::Tensor q = torch::randn({b, heads, s, d}, torch::kDouble), k = torch::randn({b, groups, s, d}, torch::kDouble),
                   v = torch::randn({b, groups, s, d}, torch::kDouble);
  const at::Tensor pos = range(0, s), head_ids = range(2, 2 + heads);
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  for (bool causal : {true, false}) {
    INFO("causal " << causal);
    const at::Tensor ke = k.repeat_interleave(2, 1), ve = v.repeat_interleave(2, 1);
    at::Tensor scores = at::matmul(q, ke.transpose(-2, -1)) * scale;
    if (causal) scores = scores.masked_fill(torch::ones({s, s}, torch::kBool).triu(1), -INFINITY);
    const at::Tensor keep = attention_dropout_keep(kKey, b, head_ids, pos, pos, 0.25);
    const at::Tensor want = at::matmul(at::softmax(scores, -1) * keep / 0.75, ve);
    CHECK_CLOSE(keyed_dropout_attention(q, k, v, pos, pos, head_ids, kKey, 0.25, causal, scale), want);
    const at::Tensor sdpa = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal, scale, true);
    CHECK_CLOSE(keyed_dropout_attention(q, k, v, pos, pos, head_ids, kKey, 0.0, causal, scale), sdpa);
  }
  CHECK_THROWS_WITH(attention_dropout_keep(kKey, 1, range(0, 1), range(0, 2), range(0, 2), 1.0),
                    Catch::Contains("expected a probability in [0, 1), got 1"));
  CHECK_THROWS_WITH(attention_dropout_keep(torch::tensor(1.5), 1, range(0, 1), range(0, 2), range(0, 2), 0.1),
                    Catch::Contains("expected a one-element int64 key"));
  CHECK_THROWS_WITH(attention_dropout_keep(kKey, 1, range(0, 1).to(torch::kInt), range(0, 2), range(0, 2), 0.1),
                    Catch::Contains("expected head indices as a 1-D int64 tensor"));
}
