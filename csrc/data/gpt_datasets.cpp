#include "megatorch/data/gpt_datasets.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "megatorch/check.h"

namespace megatorch::data {

namespace {

// A split with no share in --split.
class EmptyDataset : public SampleDataset {
 public:
  explicit EmptyDataset(int64_t seq_length) : seq_length_(seq_length) {}
  int64_t size() const override { return 0; }
  int64_t seq_length() const override { return seq_length_; }
  at::Tensor get(int64_t i) const override { MEGATORCH_FAIL("sample ", i, " requested from an empty split"); }

 private:
  int64_t seq_length_;
};

// A whole-string float, as Python's float() would accept it (no trailing garbage).
std::optional<double> parse_number(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// The document (sequence) range of one split, rounded half to even as Python's round().
std::pair<int64_t, int64_t> split_range(const std::pair<double, double>& bookends, int64_t n) {
  return {static_cast<int64_t>(std::nearbyint(bookends.first * static_cast<double>(n))),
          static_cast<int64_t>(std::nearbyint(bookends.second * static_cast<double>(n)))};
}

using Mid = std::array<std::shared_ptr<const SampleDataset>, 3>;

Mid build_mid_level(const std::string& prefix, const SplitMatrix& matrix, const std::array<int64_t, 3>& sizes,
                    const GPTDataOptions& o) {
  auto indexed = std::make_shared<const IndexedDataset>(prefix);
  Mid out;
  for (int s = 0; s < 3; ++s) {
    if (!matrix[s]) {
      out[s] = std::make_shared<EmptyDataset>(o.seq_length());
      continue;
    }
    const auto [begin, end] = split_range(*matrix[s], indexed->num_sequences());
    GPTDatasetOptions g;
    g.seq_length = o.seq_length();
    g.seed = static_cast<uint32_t>(o.seed());
    g.num_samples = sizes[s];
    g.split = static_cast<Split>(s);
    out[s] = std::make_shared<GPTDataset>(indexed, begin, end, g);
  }
  return out;
}

}  // namespace

DataBlend DataBlend::weighted(const std::vector<std::pair<double, std::string>>& items) {
  DataBlend b;
  for (const auto& [w, p] : items) {
    b.weights.push_back(w);
    b.prefixes.push_back(p);
  }
  return b;
}

DataBlend parse_data_path(const std::vector<std::string>& tokens) {
  MEGATORCH_CHECK(!tokens.empty(), "--data-path needs at least one dataset prefix");
  DataBlend b;
  size_t numbers_at_even = 0;
  for (size_t i = 0; i < tokens.size(); i += 2) numbers_at_even += parse_number(tokens[i]).has_value();
  const size_t pairs = (tokens.size() + 1) / 2;
  if (tokens.size() % 2 == 0 && numbers_at_even == pairs) {
    for (size_t i = 0; i < tokens.size(); i += 2) {
      const double w = *parse_number(tokens[i]);
      MEGATORCH_CHECK(w > 0, "--data-path weight ", tokens[i], " for ", tokens[i + 1], " must be positive");
      b.weights.push_back(w);
      b.prefixes.push_back(tokens[i + 1]);
    }
    return b;
  }
  MEGATORCH_CHECK(numbers_at_even == 0, "--data-path mixes weights and prefixes: expected either \"PREFIX...\" or pairs ",
                  "\"WEIGHT PREFIX ...\", got ", tokens.size(), " tokens of which ", numbers_at_even, " look like weights");
  b.prefixes = tokens;
  return b;
}

SplitMatrix parse_split(const std::string& split) {
  // Megatron's forms: "969,30,1", "969/30/1" or one number, spaces allowed around the
  // shares. Each share is plain decimal digits: a sign or an exponent ("-1", "+1", "1e2")
  // is refused by name rather than read as separators or passed to strtod.
  const auto is_space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  const char sep = split.find(',') != std::string::npos ? ',' : '/';
  std::vector<double> v;
  const bool blank = std::all_of(split.begin(), split.end(), is_space);
  for (size_t i = 0; !blank && i <= split.size();) {
    size_t j = split.find(sep, i);
    if (j == std::string::npos) j = split.size();
    size_t b = i, e = j;
    while (b < e && is_space(split[b])) ++b;
    while (e > b && is_space(split[e - 1])) --e;
    const std::string share = split.substr(b, e - b);
    const auto is_digit = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; };
    const bool plain = std::any_of(share.begin(), share.end(), is_digit) &&
                       std::all_of(share.begin(), share.end(), [&](char c) { return is_digit(c) || c == '.'; }) &&
                       std::count(share.begin(), share.end(), '.') <= 1;
    const auto num = plain ? parse_number(share) : std::nullopt;
    MEGATORCH_CHECK(num.has_value(), "--split \"", split, "\": \"", share, "\" is not a number of the form DIGITS[.DIGITS] ",
                    "(no sign, no exponent); expected 1 to 3 comma-separated non-negative shares, e.g. 969,30,1");
    v.push_back(*num);
    i = j + 1;
  }
  MEGATORCH_CHECK(!v.empty() && v.size() <= 3, "--split \"", split,
                  "\": expected 1 to 3 comma-separated shares (train,valid,test), e.g. 969,30,1");
  v.resize(3, 0.0);
  const double sum = (v[0] + v[1]) + v[2];
  MEGATORCH_CHECK(sum > 0 && std::isfinite(sum), "--split \"", split, "\": the shares sum to ", sum,
                  "; expected a positive finite sum, e.g. 969,30,1");
  SplitMatrix m;
  double begin = 0.0;
  for (int s = 0; s < 3; ++s) {
    const double end = begin + v[static_cast<size_t>(s)] / sum;
    if (end > begin) m[static_cast<size_t>(s)] = std::make_pair(begin, end);
    begin = end;
  }
  return m;
}

const std::shared_ptr<const SampleDataset>& GPTDatasets::operator[](Split s) const {
  return s == Split::kTrain ? train : s == Split::kValid ? valid : test;
}

GPTDatasets build_gpt_datasets(const GPTDataOptions& o) {
  const DataBlend& blend = o.blend();
  MEGATORCH_CHECK(!blend.prefixes.empty(), "no data: pass --data-path PREFIX (or W1 P1 W2 P2 ...)");
  MEGATORCH_CHECK(blend.weights.empty() || blend.weights.size() == blend.prefixes.size(), "--data-path got ",
                  blend.weights.size(), " weights for ", blend.prefixes.size(), " prefixes");
  MEGATORCH_CHECK(o.seq_length() > 1, "expected --seq-length > 1, got ", o.seq_length());
  MEGATORCH_CHECK(o.seed() >= 0 && o.seed() <= 0xffffffffLL, "--seed must be in [0, 2^32), got ", o.seed());
  const auto& sizes = o.num_samples();
  for (int64_t n : sizes) MEGATORCH_CHECK(n >= -1, "num_samples must be >= 0 (or -1 for one epoch), got ", n);
  const SplitMatrix matrix = parse_split(o.split());

  std::array<std::shared_ptr<const SampleDataset>, 3> out;
  if (blend.prefixes.size() == 1 && blend.weights.empty()) {
    out = build_mid_level(blend.prefixes[0], matrix, sizes, o);
    return {out[0], out[1], out[2]};
  }

  const size_t n = blend.prefixes.size();
  std::vector<double> weights;
  std::vector<std::array<int64_t, 3>> target(n, {-1, -1, -1}), buffer(n, {-1, -1, -1});
  if (!blend.weights.empty()) {
    weights = normalize_weights(blend.weights);
    for (size_t d = 0; d < n; ++d) {
      for (int s = 0; s < 3; ++s) {
        MEGATORCH_CHECK(sizes[s] >= 0, "weighted --data-path needs a sample count for every split; the ",
                        split_name(static_cast<Split>(s)), " split has none");
        const double t = std::ceil(static_cast<double>(sizes[s]) * weights[d]);
        target[d][s] = static_cast<int64_t>(t);
        buffer[d][s] = static_cast<int64_t>(std::ceil(t * (1.0 + 0.005)));  // Megatron's mid-level surplus
      }
    }
  }
  std::vector<Mid> mids;
  for (size_t d = 0; d < n; ++d) mids.push_back(build_mid_level(blend.prefixes[d], matrix, buffer[d], o));

  for (int s = 0; s < 3; ++s) {
    if (!matrix[s]) {
      out[s] = std::make_shared<EmptyDataset>(o.seq_length());
      continue;
    }
    std::vector<std::shared_ptr<const SampleDataset>> parts;
    for (size_t d = 0; d < n; ++d) parts.push_back(mids[d][s]);
    std::vector<double> w = weights;
    int64_t size = 0;
    if (!weights.empty()) {
      for (size_t d = 0; d < n; ++d) size += target[d][s];
    } else {
      int64_t total = 0;
      for (const auto& p : parts) {
        w.push_back(static_cast<double>(p->size()));
        total += p->size();
      }
      size = sizes[s] >= 0 ? std::min(sizes[s], total) : -1;
    }
    out[s] = std::make_shared<BlendedDataset>(std::move(parts), std::move(w), size);
  }
  return {out[0], out[1], out[2]};
}

}  // namespace megatorch::data
