#pragma once
// Float comparisons whose tolerance follows rounding, not one CPU's luck.
//
// A different but correct summation order (another SIMD width, thread count, MKL or oneDNN
// path) moves an fp32 result by a few ulps of the magnitudes that were summed, not of the
// element that came out: a gradient element of 1e-3 summed from terms of 20 carries errors
// of ~1e-6. So the absolute part of the tolerance scales with the reference tensor:
//
//   |got - want| <= rtol * (|want| + scale)   elementwise, scale = max |want| by default,
//
// i.e. torch::allclose with atol = rtol * scale. A reduction whose result cancels (terms
// much larger than the sum) passes its own scale: the sum of the absolute terms. With
// rtol = 1e-5 an error of 1e-4 relative to the tensor's magnitude always fails (the
// largest element alone moves by 5x the allowance); rejects_injected_error shows it on
// a test's own data. Exactness claims (resume, same layout twice) use torch::equal.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <sstream>
#include <string>

namespace tolerance {

// fp32 parity where only the summation order differs.
constexpr double kRtol = 1e-5;

struct Closeness {
  bool ok = false;
  double max_diff = 0;  // max |got - want|
  double scale = 0;     // the magnitude the absolute tolerance follows
  double rtol = 0;
  std::string why;  // set when the shapes differ or a value is not finite

  std::string describe() const {
    std::ostringstream s;
    if (!why.empty()) return why;
    s << "max |got - want| " << max_diff << ", allowed rtol " << rtol << " x (|want| + " << scale
      << "); scale = max |want| unless given";
    return s.str();
  }
};

inline Closeness compare(const at::Tensor& got, const at::Tensor& want, double rtol = kRtol, double scale = -1) {
  Closeness c;
  c.rtol = rtol;
  if (!got.defined() || !want.defined()) {
    c.why = "an undefined tensor: got " + std::string(got.defined() ? "defined" : "undefined") + ", want " +
            (want.defined() ? "defined" : "undefined");
    return c;
  }
  if (got.sizes() != want.sizes()) {
    std::ostringstream s;
    s << "shapes differ: got " << got.sizes() << ", want " << want.sizes();
    c.why = s.str();
    return c;
  }
  // Doubles, so the comparison itself adds no rounding.
  const at::Tensor g = got.detach().to(at::kDouble), w = want.detach().to(at::kDouble);
  if (!torch::isfinite(g).all().item<bool>() || !torch::isfinite(w).all().item<bool>()) {
    c.why = "a value is not finite (nan or inf) in " + std::string(torch::isfinite(g).all().item<bool>() ? "want" : "got");
    return c;
  }
  if (g.numel() == 0) {
    c.ok = true;
    return c;
  }
  const at::Tensor diff = (g - w).abs();
  c.scale = scale >= 0 ? scale : w.abs().max().item<double>();
  c.max_diff = diff.max().item<double>();
  c.ok = (diff <= rtol * (w.abs() + c.scale)).all().item<bool>();
  return c;
}

// The scale of a sum of terms: the sum of their absolute values (for a reduction that cancels).
inline double abs_sum(const at::Tensor& terms) { return terms.detach().to(at::kDouble).abs().sum().item<double>(); }

// Whether the comparison above would catch a real error of `error` relative on this data: got
// scaled by (1 + error), and got with its largest reference element moved by error x max |want|
// (a missing or extra term). True when both are rejected.
inline bool rejects_injected_error(const at::Tensor& got, const at::Tensor& want, double error = 1e-4,
                                   double rtol = kRtol, double scale = -1) {
  const at::Tensor g = got.detach().to(at::kDouble), w = want.detach().to(at::kDouble);
  const double magnitude = w.abs().max().item<double>();
  at::Tensor moved = g.clone().reshape({-1});
  const int64_t at = w.abs().reshape({-1}).argmax().item<int64_t>();
  moved[at] += error * (magnitude > 0 ? magnitude : 1.0);
  // An all-zero reference has no relative error to scale; the moved element alone must fail.
  const bool scaled_rejected = magnitude == 0 || !compare(g * (1 + error), w, rtol, scale).ok;
  return scaled_rejected && !compare(moved.reshape(g.sizes()), w, rtol, scale).ok;
}

}  // namespace tolerance

// CHECK_CLOSE(got, want [, rtol [, scale]]): a Catch2 check that reports the comparison.
#define CHECK_CLOSE(...)                                                         \
  do {                                                                           \
    const ::tolerance::Closeness mt_closeness_ = ::tolerance::compare(__VA_ARGS__); \
    INFO("CHECK_CLOSE(" #__VA_ARGS__ "): " << mt_closeness_.describe());          \
    CHECK(mt_closeness_.ok);                                                     \
  } while (false)

// CHECK_DETECTS_ERROR(got, want [, error [, rtol [, scale]]]): the same comparison rejects
// the data with an injected error (the test can fail).
#define CHECK_DETECTS_ERROR(...)                                                       \
  do {                                                                                 \
    INFO("CHECK_DETECTS_ERROR(" #__VA_ARGS__ "): an injected error was not rejected"); \
    CHECK(::tolerance::rejects_injected_error(__VA_ARGS__));                          \
  } while (false)
