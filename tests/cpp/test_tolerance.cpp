// The comparison every fp32 parity test uses (tolerance.h): a correct result summed in
// another order passes on any CPU, a real error of 1e-4 relative fails.
#include <ATen/CPUGeneratorImpl.h>
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "tolerance.h"

namespace {

at::Tensor randn(at::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

}  // namespace

TEST_CASE("tolerance: another summation order passes, an error of 1e-4 relative does not", "[tolerance]") {
  // Gradients summed over 4096 tokens of magnitude ~1, as the parity tests' weight gradients
  // are: float32 in chunks of 16 (a narrow SIMD width) against float64 rounded once.
  const at::Tensor terms = randn({4096, 64}, 1) * 3;
  const at::Tensor chunked = terms.reshape({256, 16, 64}).sum(1).sum(0);
  const at::Tensor exact = terms.to(at::kDouble).sum(0).to(at::kFloat);
  REQUIRE(!torch::equal(chunked, exact));  // the orders do round differently
  CHECK_CLOSE(chunked, exact);
  CHECK_DETECTS_ERROR(chunked, exact);

  // The case that failed with atol 1e-6: values up to ~20 apart by a few 1e-6.
  const at::Tensor want = randn({64, 16}, 2) * 7;
  const at::Tensor got = want + randn({64, 16}, 3) * 2e-6;
  REQUIRE(want.abs().max().item<double>() > 15);
  CHECK(!torch::allclose(got, want, 1e-5, 1e-6));
  CHECK_CLOSE(got, want);

  // Real errors, relative to the tensor's magnitude.
  CHECK_FALSE(tolerance::compare(want * (1 + 1e-4), want).ok);
  at::Tensor sign = want.clone().reshape({-1});
  const int64_t largest = want.abs().reshape({-1}).argmax().item<int64_t>();
  sign[largest] = -sign[largest];  // a wrong sign on one element
  CHECK_FALSE(tolerance::compare(sign.reshape(want.sizes()), want).ok);
  at::Tensor missing = chunked - terms[17];  // one token's term left out
  CHECK_FALSE(tolerance::compare(missing, exact).ok);
  CHECK(tolerance::rejects_injected_error(chunked, exact));
  CHECK(tolerance::rejects_injected_error(at::zeros({3}), at::zeros({3})));
}

TEST_CASE("tolerance: scale, shapes and non-finite values", "[tolerance]") {
  // A sum that cancels: the result is small, the terms are not; the terms' scale admits it.
  const at::Tensor terms = at::tensor({1000.0f, -999.9f, 1e-3f});
  const at::Tensor got = terms.sum().reshape({1}), want = terms.to(at::kDouble).sum().reshape({1});
  CHECK(tolerance::compare(got, want, tolerance::kRtol, tolerance::abs_sum(terms)).ok);
  // A zero reference allows nothing but zero (scale 0).
  CHECK(tolerance::compare(at::zeros({4}), at::zeros({4})).ok);
  CHECK_FALSE(tolerance::compare(at::full({4}, 1e-12), at::zeros({4})).ok);
  const auto shape = tolerance::compare(at::zeros({2, 3}), at::zeros({3, 2}));
  CHECK_FALSE(shape.ok);
  CHECK(shape.describe().find("shapes differ") != std::string::npos);
  const auto nan = tolerance::compare(at::full({2}, std::nan("")), at::zeros({2}));
  CHECK_FALSE(nan.ok);
  CHECK(nan.describe().find("not finite") != std::string::npos);
  CHECK(tolerance::compare(at::ones({2}, at::kBFloat16), at::ones({2})).ok);  // dtypes compared as doubles
}
