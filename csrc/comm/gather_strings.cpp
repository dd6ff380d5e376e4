#include "megatorch/comm/gather_strings.h"

#include <ATen/ATen.h>

#include <cstring>

namespace megatorch::comm {

std::vector<std::string> all_gather_strings(Group& group, const std::string& s) {
  const at::Tensor len = at::full({1}, static_cast<int64_t>(s.size()), at::kLong);
  const at::Tensor lens = group.all_gather(len);
  const int64_t longest = lens.max().item<int64_t>();
  at::Tensor buf = at::zeros({longest}, at::kByte);
  if (!s.empty()) std::memcpy(buf.data_ptr(), s.data(), s.size());
  const at::Tensor all = group.all_gather(buf).view({group.size(), longest});
  std::vector<std::string> out;
  for (int64_t i = 0; i < group.size(); ++i) {
    out.emplace_back(reinterpret_cast<const char*>(all[i].data_ptr()), lens[i].item<int64_t>());
  }
  return out;
}

}  // namespace megatorch::comm
