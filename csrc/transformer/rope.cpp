#include "megatorch/transformer/rope.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "megatorch/check.h"
#include "megatorch/util/enum_names.h"

namespace megatorch::transformer {
namespace {

// YaRN's attention temperature: 0.1·mscale·ln(factor) + 1 above factor 1.
double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

// The (fractional) channel pair whose wavelength makes `turns` rotations over `positions`.
double correction_dim(double turns, int64_t dim, double base, double positions) {
  return dim * std::log(positions / (turns * 2 * M_PI)) / (2 * std::log(base));
}

}  // namespace

const char* to_string(RopeType t) {
  switch (t) {
    case RopeType::kDefault: return "default";
    case RopeType::kLinear: return "linear";
    case RopeType::kDynamic: return "dynamic";
    case RopeType::kYarn: return "yarn";
    case RopeType::kLlama3: return "llama3";
  }
  return "?";
}

RopeType parse_rope_type(const std::string& s) {
  return util::parse_enum(s, {RopeType::kDefault, RopeType::kLinear, RopeType::kDynamic, RopeType::kYarn,
                              RopeType::kLlama3},
                          "rope_type");
}

void RopeScaling::validate() const {
  const char* t = to_string(type_);
  if (type_ == RopeType::kDefault) return;
  MEGATORCH_CHECK(factor_ >= 1, "rope_type '", t, "': expected a scaling factor >= 1, got ", factor_,
                  "; pass --rope-scaling-factor (rope_scaling.factor)");
  if (type_ == RopeType::kLinear) return;
  MEGATORCH_CHECK(original_max_position_embeddings_ > 0, "rope_type '", t, "' needs the context it extends: expected ",
                  "original_max_position_embeddings > 0, got ", original_max_position_embeddings_,
                  type_ == RopeType::kDynamic ? " (HF's max_position_embeddings)" : "",
                  "; pass --original-max-position-embeddings");
  if (type_ == RopeType::kLlama3) {
    MEGATORCH_CHECK(high_freq_factor_ > low_freq_factor_ && low_freq_factor_ > 0, "rope_type 'llama3': expected ",
                    "0 < low_freq_factor < high_freq_factor, got ", low_freq_factor_, " and ", high_freq_factor_);
  }
  if (type_ == RopeType::kYarn) {
    MEGATORCH_CHECK(beta_fast_ > beta_slow_ && beta_slow_ > 0, "rope_type 'yarn': expected beta_fast > beta_slow > 0, ",
                    "got ", beta_fast_, " and ", beta_slow_);
    MEGATORCH_CHECK(attention_factor_ >= 0, "rope_type 'yarn': expected attention_factor >= 0 (0: from the factor), ",
                    "got ", attention_factor_);
  }
}

bool RopeScaling::operator==(const RopeScaling& o) const {
  return type_ == o.type_ && factor_ == o.factor_ &&
         original_max_position_embeddings_ == o.original_max_position_embeddings_ &&
         low_freq_factor_ == o.low_freq_factor_ && high_freq_factor_ == o.high_freq_factor_ &&
         beta_fast_ == o.beta_fast_ && beta_slow_ == o.beta_slow_ && attention_factor_ == o.attention_factor_ &&
         mscale_ == o.mscale_ && mscale_all_dim_ == o.mscale_all_dim_ && truncate_ == o.truncate_;
}

RopeFrequencies rope_inverse_frequencies(int64_t dim, double base, const RopeScaling& s, int64_t seq_length) {
  MEGATORCH_CHECK(dim >= 2 && dim % 2 == 0, "RoPE: expected an even rotary dim >= 2, got ", dim,
                  "; choose a --rotary-percent that gives an even number of channels");
  s.validate();
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor exponent = at::arange(0, dim, 2, opts) / static_cast<double>(dim);
  RopeFrequencies out;
  switch (s.type()) {
    case RopeType::kDefault:
      out.inv_freq = at::pow(base, -exponent);
      break;
    case RopeType::kLinear:
      out.inv_freq = at::pow(base, -exponent) / s.factor();
      break;
    case RopeType::kDynamic: {
      const double trained = static_cast<double>(s.original_max_position_embeddings());
      const double len = std::max(static_cast<double>(seq_length), trained);
      const double scaled = base * std::pow(s.factor() * len / trained - (s.factor() - 1), dim / (dim - 2.0));
      out.inv_freq = at::pow(scaled, -exponent);
      break;
    }
    case RopeType::kYarn: {
      const at::Tensor extrapolation = at::pow(base, -exponent), interpolation = extrapolation / s.factor();
      const double trained = static_cast<double>(s.original_max_position_embeddings());
      double low = correction_dim(s.beta_fast(), dim, base, trained);
      double high = correction_dim(s.beta_slow(), dim, base, trained);
      if (s.truncate()) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(dim - 1));
      if (low == high) high += 0.001;  // a ramp of one channel
      // 1 where the channel extrapolates (short wavelengths), 0 where it interpolates.
      const at::Tensor ramp = ((at::arange(dim / 2, opts) - low) / (high - low)).clamp(0, 1);
      const at::Tensor keep = 1 - ramp;
      out.inv_freq = interpolation * (1 - keep) + extrapolation * keep;
      if (s.attention_factor() > 0) {
        out.attention_scaling = s.attention_factor();
      } else if (s.mscale() > 0 && s.mscale_all_dim() > 0) {
        out.attention_scaling = yarn_mscale(s.factor(), s.mscale()) / yarn_mscale(s.factor(), s.mscale_all_dim());
      } else {
        out.attention_scaling = yarn_mscale(s.factor(), 1.0);
      }
      break;
    }
    case RopeType::kLlama3: {
      const at::Tensor inv = at::pow(base, -exponent);
      const double trained = static_cast<double>(s.original_max_position_embeddings());
      const double low_wavelen = trained / s.low_freq_factor(), high_wavelen = trained / s.high_freq_factor();
      const at::Tensor wavelen = 2 * M_PI / inv;
      const at::Tensor scaled = at::where(wavelen > low_wavelen, inv / s.factor(), inv);
      const at::Tensor smooth = (trained / wavelen - s.low_freq_factor()) / (s.high_freq_factor() - s.low_freq_factor());
      const at::Tensor smoothed = (1 - smooth) * scaled / s.factor() + smooth * scaled;
      const at::Tensor medium = wavelen.ge(high_wavelen).logical_and(wavelen.le(low_wavelen));
      out.inv_freq = at::where(medium, smoothed, scaled);
      break;
    }
  }
  return out;
}

at::Tensor rope_frequencies(int64_t seq_length, int64_t rotary_dim, double base, const RopeScaling& scaling,
                            c10::Device device) {
  const at::Tensor inv = rope_inverse_frequencies(rotary_dim, base, scaling, seq_length).inv_freq;
  const at::Tensor angles = at::outer(at::arange(seq_length, inv.options()), inv);
  return at::cat({angles, angles}, -1).to(at::kFloat).view({seq_length, 1, 1, rotary_dim}).to(device);
}

}  // namespace megatorch::transformer
