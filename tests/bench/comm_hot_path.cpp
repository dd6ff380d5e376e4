// Micro-benchmark of the communication hot path: what one call of the f / g mappings
// costs on top of the collective itself, and what constructing a comm::Group costs.
// Not a test (nothing is asserted, numbers depend on the machine); built on request:
//
//   MEGATORCH_TARGETS=megatorch_comm_bench scripts/build.sh
//   OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone
//       --nproc-per-node=N --no-python build/bin/megatorch_comm_bench [--quick] [--batches B]
//
// N ranks form one tensor-parallel group of N (Gloo, CPU tensors). Each case is timed in
// batches of calls; the figures are the median over batches of the time per call, in µs,
// and the batches' 25th-75th percentiles.
// Cases:
//   resolve_process_group  c10d's registry lookup alone (what a Group must at least do)
//   group()                comm::Group(name) for the TP group
//   f fwd                  copy_to_tp_region forward, input without grad (C++ layers' path)
//   f fwd+bwd / g fwd+bwd  forward, then backward of a ones gradient (leaf input)
//   op: ...                the same through the registered operator (torch.ops / TorchScript path)
//   clone+all_reduce       a copy all-reduced by Group::all_reduce: what g costs without a mapping
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "megatorch/comm/group.h"
#include "megatorch/comm/mappings.h"
#include "megatorch/parallel/parallel_state.h"

namespace {

namespace comm = megatorch::comm;
using Clock = std::chrono::steady_clock;
using MappingOp = at::Tensor(const at::Tensor&, c10::string_view);

struct Timing {
  double median, p25, p75;  // µs per call, over batches
};

Timing us_per_call(comm::Group& sync, int64_t calls, int batches, const std::function<void()>& fn) {
  for (int64_t i = 0; i < std::max<int64_t>(calls / 10, 5); ++i) fn();  // warm-up
  std::vector<double> per_call;
  for (int b = 0; b < batches; ++b) {
    sync.barrier();  // every rank starts the batch together (a no-op for one rank)
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < calls; ++i) fn();
    const auto t1 = Clock::now();
    per_call.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / static_cast<double>(calls));
  }
  std::sort(per_call.begin(), per_call.end());
  const auto at = [&](double q) { return per_call[static_cast<size_t>(q * (per_call.size() - 1) + 0.5)]; };
  return {at(0.5), at(0.25), at(0.75)};
}

void print(bool report, const std::string& name, const Timing& t) {
  if (report) std::printf("  %-26s %10.3f   (%.3f-%.3f)\n", name.c_str(), t.median, t.p25, t.p75);
}

c10::TypedOperatorHandle<MappingOp> mapping_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string("megatorch::") + name).c_str(), "").typed<MappingOp>();
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  bool quick = false;
  int batches = 15;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") quick = true;
    if (arg == "--batches" && i + 1 < argc) batches = std::max(1, std::atoi(argv[++i]));
  }
  if (quick) batches = 5;
  const int64_t world = std::atoll(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1");
  megatorch::parallel::ParallelState state(
      megatorch::parallel::ParallelStateOptions(world, 1).name("comm_bench").device("cpu"));
  const std::string tp = state.group_name(megatorch::parallel::GroupKind::kTensor);
  comm::Group sync(state, megatorch::parallel::GroupKind::kWorld);
  const bool report = state.rank() == 0;

  struct Size {
    const char* label;
    std::vector<int64_t> shape;  // [s, b, h]
    int64_t calls;               // per batch, at TP=1 (collectives are slower: fewer at TP>1)
  };
  const std::vector<Size> sizes{{"1 KiB [8,2,16] fp32", {8, 2, 16}, 2000},
                                {"4 MiB [256,4,1024] fp32", {256, 4, 1024}, 20}};
  if (report) {
    std::printf("comm hot path, TP=%lld (Gloo, CPU), median of %d batches, us per call\n",
                static_cast<long long>(world), batches);
  }

  const int64_t group_calls = quick ? 2000 : 20000;
  print(report, "resolve_process_group",
        us_per_call(sync, group_calls, batches, [&] { (void)c10d::resolve_process_group(tp); }));
  print(report, "group()", us_per_call(sync, group_calls, batches, [&] { comm::Group g(tp); (void)g; }));

  const auto copy_op = mapping_op("copy_to_tp_region");
  const auto reduce_op = mapping_op("reduce_from_tp_region");
  for (const Size& size : sizes) {
    int64_t calls = world > 1 ? std::max<int64_t>(size.calls / 10, 5) : size.calls;
    if (quick) calls = std::max<int64_t>(calls / 5, 2);
    const auto data = torch::ones(size.shape);
    const auto x = data.clone().requires_grad_(true);
    const auto ones = torch::ones(size.shape);
    auto fwd_bwd = [&](const std::function<at::Tensor(const at::Tensor&)>& mapping) {
      return [&, mapping] {
        auto y = mapping(x);
        y.backward(ones);
        x.mutable_grad() = at::Tensor();
      };
    };
    struct Case {
      std::string name;
      std::function<void()> fn;
    };
    const std::vector<Case> cases{
        {"f fwd", [&] { comm::copy_to_tp_region(data, tp); }},
        {"f fwd+bwd", fwd_bwd([&](const at::Tensor& t) { return comm::copy_to_tp_region(t, tp); })},
        {"g fwd+bwd", fwd_bwd([&](const at::Tensor& t) { return comm::reduce_from_tp_region(t, tp); })},
        {"op: f fwd", [&] { copy_op.call(data, tp); }},
        {"op: f fwd+bwd", fwd_bwd([&](const at::Tensor& t) { return copy_op.call(t, tp); })},
        {"op: g fwd+bwd", fwd_bwd([&](const at::Tensor& t) { return reduce_op.call(t, tp); })},
        {"clone+all_reduce", [&] { auto t = data.clone(); comm::Group(tp).all_reduce(t); }},
    };
    if (report) std::printf(" %s\n", size.label);
    for (const Case& c : cases) print(report, c.name, us_per_call(sync, calls, batches, c.fn));
  }
  return 0;
}
