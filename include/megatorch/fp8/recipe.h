#pragma once
// FP8 training recipes (Transformer Engine's, under Megatron's flag names): which 8-bit
// formats the GEMM operands take and how each tensor's scale is chosen. Only the GEMMs of
// the tensor-parallel linear layers run in FP8; their inputs, weights and output
// gradients are quantised per call, everything else keeps its dtype.
#include <ATen/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <string>

namespace megatorch::fp8 {

// kNone: FP8 off. kE4M3: every operand in E4M3 (max 448). kHybrid: activations and weights
// in E4M3, output gradients in E5M2 (max 57344: range over precision).
enum class Format { kNone, kE4M3, kHybrid };
// kTensorwise: current scaling, each tensor scaled by the amax it has now. kDelayed: the
// scale comes from a history of past amaxes (TE's DelayedScaling); this call's amax only
// enters the history, for the calls after it.
enum class Recipe { kTensorwise, kDelayed };
// Which amax of the history the delayed scale is computed from.
enum class AmaxAlgo { kMostRecent, kMax };
// The three GEMM operands a linear layer quantises: its input, its weight, and the
// gradient of its output.
enum class Role { kInput = 0, kWeight = 1, kGradOutput = 2 };
constexpr int kNumRoles = 3;

struct Fp8Options {
  TORCH_ARG(Format, format) = Format::kNone;
  TORCH_ARG(Recipe, recipe) = Recipe::kDelayed;
  // Delayed scaling: how many past amaxes are kept (Megatron's default 1), which one
  // counts, and the margin: scale = (fp8_max / amax) / 2^margin.
  TORCH_ARG(int64_t, amax_history_len) = 1;
  TORCH_ARG(AmaxAlgo, amax_compute_algo) = AmaxAlgo::kMostRecent;
  TORCH_ARG(int64_t, margin) = 0;

 public:
  bool enabled() const { return format_ != Format::kNone; }
  // Checks the values (a history of at least one, a margin >= 0), naming `where`.
  void validate(const std::string& where) const;
};

// The 8-bit dtype of an operand under a format (E5M2 for hybrid's output gradients).
c10::ScalarType dtype_of(Format format, Role role);
// The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2).
double max_of(c10::ScalarType fp8_dtype);

const char* to_string(Format f);
const char* to_string(Recipe r);
const char* to_string(AmaxAlgo a);
const char* to_string(Role r);
// The inverses of to_string (Megatron's strings), failing with the valid names.
Format parse_format(const std::string& s);       // "e4m3" | "hybrid"
Recipe parse_recipe(const std::string& s);       // "tensorwise" | "delayed"
AmaxAlgo parse_amax_algo(const std::string& s);  // "most_recent" | "max"
// One line that identifies a recipe ("none", or "hybrid/delayed/len=16/max/margin=0"):
// what checkpoints record and compare.
std::string describe(const Fp8Options& o);

}  // namespace megatorch::fp8
