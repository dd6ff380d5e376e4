#include "megatorch/optim/bucket_layout.h"

#include <algorithm>

#include "megatorch/check.h"

namespace megatorch::optim {

int64_t BucketLayout::buffer_numel(at::ScalarType dtype) const {
  for (const auto& [t, n] : buffers) {
    if (t == dtype) return n;
  }
  return 0;
}

int64_t default_bucket_size(int64_t dp) { return std::max<int64_t>(40'000'000, 1'000'000 * dp); }

BucketLayout build_bucket_layout(const std::vector<std::vector<at::Tensor>>& units, int64_t bucket_size, int64_t dp,
                                 bool bucket_per_unit, const std::vector<bool>& alone) {
  MEGATORCH_CHECK(dp >= 1 && bucket_size >= 1, "bucket layout: expected dp >= 1 and bucket_size >= 1, got dp=", dp,
                  " and bucket_size=", bucket_size);
  BucketLayout layout;
  std::vector<std::pair<int64_t, int64_t>> order;  // (unit, global parameter index), backward order
  int64_t count = 0;
  std::vector<int64_t> first_index(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    first_index[u] = count;
    count += static_cast<int64_t>(units[u].size());
  }
  layout.params.resize(count);
  for (int64_t u = static_cast<int64_t>(units.size()) - 1; u >= 0; --u) {
    for (int64_t i = static_cast<int64_t>(units[u].size()) - 1; i >= 0; --i) order.emplace_back(u, first_index[u] + i);
  }
  auto param_at = [&](int64_t u, int64_t global) -> const at::Tensor& { return units[u][global - first_index[u]]; };

  // Buckets of one dtype are contiguous in that dtype's buffer; open buckets per dtype.
  std::vector<std::pair<at::ScalarType, int64_t>> open;  // dtype -> bucket index
  auto close = [&](int64_t b) {
    auto& bucket = layout.buckets[b];
    bucket.numel = (bucket.used + dp - 1) / dp * dp;
    auto it = std::find_if(layout.buffers.begin(), layout.buffers.end(),
                           [&](const auto& e) { return e.first == bucket.dtype; });
    if (it == layout.buffers.end()) {
      layout.buffers.emplace_back(bucket.dtype, 0);
      it = layout.buffers.end() - 1;
    }
    bucket.begin = it->second;
    it->second += bucket.numel;
  };
  int64_t current_unit = -1;
  for (const auto& [u, global] : order) {
    const at::Tensor& p = param_at(u, global);
    MEGATORCH_CHECK(p.defined() && p.numel() > 0, "bucket layout: expected defined, non-empty parameters; parameter ",
                    global, " is ", p.defined() ? "empty" : "undefined");
    if (bucket_per_unit && u != current_unit) {
      for (const auto& [t, b] : open) close(b);
      open.clear();
    }
    current_unit = u;
    const bool own = global < static_cast<int64_t>(alone.size()) && alone[global];
    auto it = std::find_if(open.begin(), open.end(), [&](const auto& e) { return e.first == p.scalar_type(); });
    if (own && it != open.end()) {  // close the dtype's open bucket: this one starts fresh
      close(it->second);
      open.erase(it);
      it = open.end();
    }
    if (it == open.end()) {
      layout.buckets.push_back(BucketPlace{u, p.scalar_type(), 0, 0, 0, {}});
      open.emplace_back(p.scalar_type(), static_cast<int64_t>(layout.buckets.size()) - 1);
      it = open.end() - 1;
    }
    auto& bucket = layout.buckets[it->second];
    layout.params[global] = ParamPlace{it->second, bucket.used, p.numel()};
    bucket.params.push_back(global);
    bucket.used += p.numel();
    if (own || (!bucket_per_unit && bucket.used >= bucket_size)) {
      close(it->second);
      open.erase(it);
    }
  }
  for (const auto& [t, b] : open) close(b);
  return layout;
}

}  // namespace megatorch::optim
