#pragma once
// Every rank's string on every rank (an all-gather of lengths, then of the padded bytes):
// for descriptions and error reports, not for hot paths.
#include <string>
#include <vector>

#include "megatorch/comm/group.h"

namespace megatorch::comm {

// Collective over `group`; element i is rank i's `s`.
std::vector<std::string> all_gather_strings(Group& group, const std::string& s);

}  // namespace megatorch::comm
