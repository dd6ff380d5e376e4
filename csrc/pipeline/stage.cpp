#include "megatorch/pipeline/stage.h"

#include <ATen/ATen.h>

#include <sstream>

#include "megatorch/check.h"

namespace megatorch::pipeline {

bool MicroBatch::has(const std::string& name) const {
  if (name == "ids") return ids.defined();
  if (name == "labels") return labels.defined();
  const auto it = tensors.find(name);
  return it != tensors.end() && it->second.defined();
}

const at::Tensor& MicroBatch::get(const std::string& name) const {
  if (has(name)) return name == "ids" ? ids : name == "labels" ? labels : tensors.at(name);
  std::ostringstream held;
  if (ids.defined()) held << " ids";
  if (labels.defined()) held << " labels";
  for (const auto& [k, t] : tensors) {
    if (t.defined()) held << " " << k;
  }
  MEGATORCH_FAIL("micro-batch: expected a tensor named '", name, "', the micro-batch holds {", held.str(),
                 " }; put it in MicroBatch::tensors under that name, or name the one to read in the stage's options");
}

MicroBatch MicroBatch::to(const c10::Device& device, bool non_blocking) const {
  auto move = [&](const at::Tensor& t) { return t.defined() ? t.to(device, non_blocking) : t; };
  MicroBatch out{move(ids), move(labels), {}};
  for (const auto& [k, t] : tensors) out.tensors[k] = move(t);
  return out;
}

std::string to_string(const ActivationSpec& spec) {
  std::ostringstream o;
  o << c10::toString(spec.dtype) << "[";
  for (size_t i = 0; i < spec.shape.size(); ++i) o << (i ? ", " : "") << spec.shape[i];
  o << "]";
  return o.str();
}

}  // namespace megatorch::pipeline
