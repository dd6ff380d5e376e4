#include <catch2/catch.hpp>
#include <megatorch/tp/cross_entropy.h>
#include <megatorch/train/batch_loader.h>

#include <ATen/ATen.h>

#include <stdexcept>

using megatorch::train::MicroBatchLoader;
using megatorch::train::MicroBatchLoaderOptions;

namespace {

// Sample i is [i*1000, i*1000 + 1, ...]: every token says which sample and position it is.
class CountingDataset : public megatorch::data::SampleDataset {
 public:
  CountingDataset(int64_t size, int64_t seq, int64_t fail_from = -1) : size_(size), seq_(seq), fail_from_(fail_from) {}
  int64_t size() const override { return size_; }
  int64_t seq_length() const override { return seq_; }
  at::Tensor get(int64_t i) const override {
    if (fail_from_ >= 0 && i >= fail_from_) throw std::runtime_error("sample " + std::to_string(i) + " is unreadable");
    return at::arange(i * 1000, i * 1000 + seq_ + 1, at::kLong);
  }

 private:
  int64_t size_, seq_, fail_from_;
};

MicroBatchLoaderOptions options(int64_t dp_rank) {
  return MicroBatchLoaderOptions().micro_batch_size(2).num_micro_batches(3).data_parallel_size(2).data_parallel_rank(
      dp_rank).seq_length(5);
}

}  // namespace

TEST_CASE("MicroBatchLoader: Megatron's sample order, ids and labels shifted by one", "[train][loader]") {
  CountingDataset ds(100, 5);
  MicroBatchLoader loader(ds, options(1));
  CHECK(loader.global_batch_size() == 12);
  CHECK_FALSE(loader.pins_memory());  // CPU training: no page-locked staging
  const auto mbs = loader.load(24);
  REQUIRE(mbs.size() == 3);
  for (int64_t k = 0; k < 3; ++k) {
    // Global micro-batch k holds samples 24 + 4k .. 24 + 4k + 3; DP rank 1 takes the last two.
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t sample = 24 + 4 * k + 2 + i;
      const at::Tensor want = at::arange(sample * 1000, sample * 1000 + 6, at::kLong);
      CHECK(at::equal(mbs[k].ids[i], want.narrow(0, 0, 5)));
      CHECK(at::equal(mbs[k].labels[i], want.narrow(0, 1, 5)));
    }
    CHECK(mbs[k].ids.device().is_cpu());
    CHECK(mbs[k].ids.is_contiguous());
  }
}

TEST_CASE("MicroBatchLoader prefetches the next global batch and serves it on the next load", "[train][loader]") {
  CountingDataset ds(48, 5);  // four global batches of 12
  MicroBatchLoader loader(ds, options(0));
  MicroBatchLoader reference(ds, options(0).prefetch(false));
  for (int64_t step = 0; step < 4; ++step) {
    const auto got = loader.load(step * 12);
    const auto want = reference.load(step * 12);
    for (size_t k = 0; k < got.size(); ++k) CHECK(at::equal(got[k].ids, want[k].ids));
  }
  CHECK(loader.prefetched_loads() == 3);  // all but the first
  CHECK(reference.prefetched_loads() == 0);
  // A load that does not follow the previous one (a resume, a rewind) is read directly.
  loader.load(12);
  CHECK(loader.prefetched_loads() == 3);
  loader.load(24);
  CHECK(loader.prefetched_loads() == 4);
}

TEST_CASE("MicroBatchLoader: errors name the need, and a failed prefetch surfaces at its load", "[train][loader]") {
  using Catch::Matchers::Contains;
  CountingDataset small(20, 5);
  MicroBatchLoader loader(small, options(0));
  CHECK_THROWS_WITH(loader.load(12), Contains("the dataset has 20 samples, the run needs 24"));
  CHECK_THROWS_WITH(MicroBatchLoader(small, options(2)), Contains("data_parallel_rank < data_parallel_size"));
  CountingDataset broken(48, 5, /*fail_from=*/15);
  MicroBatchLoader failing(broken, options(0));
  CHECK_NOTHROW(failing.load(0));  // starts preparing samples 12..23 in the background
  CHECK_THROWS_WITH(failing.load(12), Contains("sample 16 is unreadable"));
}

TEST_CASE("MicroBatchLoader packs documents at the end-of-document token as Megatron does", "[train][loader]") {
  CountingDataset ds(100, 5);
  // Sample 24 is 24000..24005: its third token (24002) ends a document.
  const auto plain_options = options(0).num_micro_batches(1).data_parallel_size(1).eod(24002);
  auto packed = plain_options;
  MicroBatchLoader loader(ds, packed.reset_position_ids(true).reset_attention_mask(true).eod_mask_loss(true));
  const auto mb = loader.load(24)[0];
  CHECK(at::equal(mb.get("position_ids")[0], at::tensor({0, 1, 2, 0, 1}, at::kLong)));
  CHECK(at::equal(mb.get("document_ids")[0], at::tensor({0, 0, 0, 1, 1}, at::kLong)));
  CHECK(at::equal(mb.get("position_ids")[1], at::arange(5, at::kLong)));  // sample 25 has no EOD
  CHECK(mb.labels[0][2].item<int64_t>() == megatorch::tp::kIgnoreIndex);   // predicted from the EOD: masked
  CHECK(mb.labels[0][1].item<int64_t>() == 24002);  // the EOD itself is predicted
  // Off: the plain micro-batch.
  MicroBatchLoader plain(ds, plain_options);
  const auto unpacked = plain.load(24)[0];
  CHECK_FALSE(unpacked.has("position_ids"));
  CHECK_FALSE(unpacked.has("document_ids"));
  CHECK(unpacked.labels[0][2].item<int64_t>() == 24003);
  CHECK_THROWS_WITH(MicroBatchLoader(ds, options(0).eod_mask_loss(true)),
                    Catch::Contains("split documents at the end-of-document token, but none was given"));
}
