// Loads a TorchScript module saved from Python that calls torch.ops.megatorch.* and
// checks it reproduces the output Python recorded in it:
//   megatorch_jit_check MODULE.pt
// The module carries `x`, `target` and `expected` attributes; it runs on a one-rank
// group made here, so no launcher is needed.
#include <megatorch/megatorch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/script.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: megatorch_jit_check MODULE.pt" << std::endl;
    return 2;
  }
  try {
    megatorch::parallel::ParallelState state(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                             megatorch::parallel::ParallelStateOptions().name("jit").device("cpu"));
    torch::jit::Module module = torch::jit::load(argv[1]);
    const auto x = module.attr("x").toTensor(), target = module.attr("target").toTensor();
    const auto expected = module.attr("expected").toTensor();
    const auto got =
        module.forward({x, target, state.group_name(megatorch::parallel::GroupKind::kWorld)}).toTensor();
    const bool ok = torch::allclose(got, expected, 1e-6, 1e-7);
    std::cout << (ok ? "jit ok" : "jit MISMATCH") << " " << got.item<double>() << " vs " << expected.item<double>()
              << std::endl;
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
