// Megatron-compatible data: the MMIDIDX format written byte for byte, read back for every
// dtype, every kind of corrupt file rejected with the file and fault named, numpy's shuffle
// reproduced, the GPT sample index's invariants, Megatron's split / --data-path / blending
// rules, and the preprocessing of JSONL.
#include <catch2/catch.hpp>
#include <megatorch/megatorch.h>
#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>

#include "temp_dir.h"

namespace md = megatorch::data;
using Catch::Contains;

namespace {

int64_t file_size(const std::string& p) {
  struct stat st {};
  REQUIRE(::stat(p.c_str(), &st) == 0);
  return static_cast<int64_t>(st.st_size);
}

std::vector<uint8_t> read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.insert(out.end(), b, b + sizeof(T));
}

// Writes documents (each a list of sequences) with the builder; returns the prefix.
std::string write_dataset(const std::string& prefix, md::DType dtype, const std::vector<std::vector<std::vector<int64_t>>>& docs) {
  md::IndexedDatasetBuilder b(md::bin_path(prefix), dtype);
  for (const auto& doc : docs) {
    for (const auto& seq : doc) b.add_item(seq.data(), static_cast<int64_t>(seq.size()));
    b.end_document();
  }
  b.finalize(md::idx_path(prefix));
  return prefix;
}

std::vector<int64_t> to_vec(const at::Tensor& t) {
  return {t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()};
}

// Documents of one sequence each; token = 1000 * document + position, so a sample tells
// where each of its tokens came from.
std::string write_numbered(const std::string& prefix, const std::vector<int64_t>& lengths) {
  std::vector<std::vector<std::vector<int64_t>>> docs;
  for (size_t d = 0; d < lengths.size(); ++d) {
    std::vector<int64_t> seq(static_cast<size_t>(lengths[d]));
    for (int64_t p = 0; p < lengths[d]; ++p) seq[static_cast<size_t>(p)] = 1000 * static_cast<int64_t>(d) + p;
    docs.push_back({seq});
  }
  return write_dataset(prefix, md::DType::kInt32, docs);
}

}  // namespace

TEST_CASE("the builder writes the MMIDIDX layout byte for byte", "[data]") {
  TempDir dir("megatorch_data");
  // Two documents: the first of two sentences [1, 2, 3] and [4], the second of [5, 6].
  const std::string prefix = write_dataset(dir / "d", md::DType::kUInt16, {{{1, 2, 3}, {4}}, {{5, 6}}});
  // The layout written down from Megatron's _IndexWriter.
  std::vector<uint8_t> idx = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
  put<uint64_t>(idx, 1);      // version
  put<uint8_t>(idx, 8);       // uint16
  put<uint64_t>(idx, 3);      // sequences
  put<uint64_t>(idx, 3);      // document index entries: 0, 2, 3
  for (int32_t len : {3, 1, 2}) put<int32_t>(idx, len);
  for (int64_t ptr : {0, 6, 8}) put<int64_t>(idx, ptr);
  for (int64_t d : {0, 2, 3}) put<int64_t>(idx, d);
  CHECK(read_bytes(md::idx_path(prefix)) == idx);
  std::vector<uint8_t> bin;
  for (uint16_t t : {1, 2, 3, 4, 5, 6}) put<uint16_t>(bin, t);
  CHECK(read_bytes(md::bin_path(prefix)) == bin);

  const md::IndexedDataset ds(prefix);
  CHECK(ds.dtype() == md::DType::kUInt16);
  CHECK(ds.num_sequences() == 3);
  CHECK(ds.num_documents() == 2);
  CHECK(ds.num_tokens() == 6);
  CHECK(ds.document_index(1) == 2);
  CHECK(to_vec(ds.get(0)) == std::vector<int64_t>({1, 2, 3}));
  CHECK(to_vec(ds.get(0, 1, 2)) == std::vector<int64_t>({2, 3}));
  CHECK(to_vec(ds.get(2)) == std::vector<int64_t>({5, 6}));
  CHECK_THROWS_WITH(ds.get(0, 2, 5), Contains("outside its 3 tokens"));
  CHECK_THROWS_WITH(ds.get(3), Contains("out of range"));
}

TEST_CASE("every dtype code round-trips, and tokens that do not fit are refused", "[data]") {
  TempDir dir("megatorch_data");
  for (int code = 1; code <= 8; ++code) {
    const auto dtype = static_cast<md::DType>(code);
    const std::string name = md::dtype_name(dtype);
    CHECK(md::dtype_from_name(name) == dtype);
    const std::vector<int64_t> seq{0, 1, 100, 127};
    const std::string prefix = write_dataset(dir / name, dtype, {{seq}, {{5}}});
    const md::IndexedDataset ds(prefix);
    CHECK(ds.dtype() == dtype);
    CHECK(to_vec(ds.get(0)) == seq);
    CHECK(file_size(md::bin_path(prefix)) == 5 * md::dtype_size(dtype));
  }
  md::IndexedDatasetBuilder b(dir / "narrow.bin", md::DType::kUInt8);
  const int64_t too_big[] = {256};
  CHECK_THROWS_WITH(b.add_item(too_big, 1), Contains("does not fit") && Contains("[0, 255]"));
  CHECK(md::optimal_dtype(257) == md::DType::kUInt16);
  CHECK(md::optimal_dtype(65500) == md::DType::kInt32);
}

TEST_CASE("empty documents, tensors and add_index merge as Megatron's builder does", "[data]") {
  TempDir dir("megatorch_data");
  const std::string a = write_dataset(dir / "a", md::DType::kInt32, {{{1, 2}}, {}, {{3}, {4, 5}}});
  const std::string b = write_dataset(dir / "b", md::DType::kInt32, {{{6}}});
  {
    md::IndexedDatasetBuilder m(dir / "m.bin", md::DType::kInt32);
    m.add_document(torch::tensor({7, 8, 9}), {1, 2});
    m.add_index(a);
    m.add_index(b);
    m.finalize(dir / "m.idx");
  }
  const md::IndexedDataset ds(dir / "m");
  CHECK(ds.num_documents() == 5);
  CHECK(ds.num_sequences() == 6);
  const std::vector<int64_t> expected_doc_index{0, 2, 3, 3, 5, 6};
  for (int64_t j = 0; j <= 5; ++j) CHECK(ds.document_index(j) == expected_doc_index[static_cast<size_t>(j)]);
  CHECK(to_vec(ds.get(4)) == std::vector<int64_t>({4, 5}));
  CHECK(to_vec(ds.get(5)) == std::vector<int64_t>({6}));

  md::IndexedDatasetBuilder wrong(dir / "w.bin", md::DType::kUInt16);
  CHECK_THROWS_WITH(wrong.add_index(a), Contains("dtypes must match"));
  CHECK_THROWS_WITH(wrong.add_document(torch::tensor({1, 2}), {3}), Contains("lengths summing to 3"));
}

TEST_CASE("corrupt, truncated and mismatched files fail naming the file and the fault", "[data]") {
  TempDir dir("megatorch_data");
  const std::string good = write_dataset(dir / "good", md::DType::kInt32, {{{1, 2, 3}}, {{4, 5}}});
  const std::string other = write_dataset(dir / "other", md::DType::kInt32, {{{1, 2, 3, 4}}});
  const auto idx = read_bytes(md::idx_path(good));
  const auto bin = read_bytes(md::bin_path(good));
  // Writes a copy of good with the given idx/bin bytes and returns the error of opening it.
  int n = 0;
  auto open_with = [&](const std::vector<uint8_t>& i, const std::vector<uint8_t>& b) {
    const std::string p = dir / ("bad" + std::to_string(n++));
    write_bytes(md::idx_path(p), i);
    write_bytes(md::bin_path(p), b);
    try {
      md::IndexedDataset ds(p);
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      CHECK_THAT(msg, Contains(p));
      return msg;
    }
    FAIL("opening a corrupt dataset " << p << " did not throw");
    return std::string();
  };
  auto patched = [&](size_t offset, std::vector<uint8_t> bytes) {
    auto copy = idx;
    std::copy(bytes.begin(), bytes.end(), copy.begin() + static_cast<long>(offset));
    return copy;
  };
  auto le64 = [](int64_t v) {
    std::vector<uint8_t> b;
    put<int64_t>(b, v);
    return b;
  };
  const size_t lengths_at = 34, pointers_at = 34 + 4 * 2, doc_at = pointers_at + 8 * 2;

  CHECK_THAT(open_with({idx.begin(), idx.begin() + 20}, bin), Contains("truncated") && Contains("header"));
  CHECK_THAT(open_with(patched(0, {'X'}), bin), Contains("not a Megatron MMIDIDX index"));
  CHECK_THAT(open_with(patched(9, {2}), bin), Contains("unsupported MMIDIDX version 2"));
  CHECK_THAT(open_with(patched(17, {9}), bin), Contains("unknown dtype code 9"));
  CHECK_THAT(open_with(patched(17, {0}), bin), Contains("unknown dtype code 0"));
  CHECK_THAT(open_with({idx.begin(), idx.end() - 8}, bin), Contains("truncated or corrupt"));
  CHECK_THAT(open_with(patched(18, le64(5)), bin), Contains("5 sequences") && Contains("truncated or corrupt"));
  CHECK_THAT(open_with(patched(26, le64(-1)), bin), Contains("not a plausible count"));
  CHECK_THAT(open_with(patched(lengths_at, {0xff, 0xff, 0xff, 0xff}), bin), Contains("negative length"));
  CHECK_THAT(open_with(patched(pointers_at + 8, le64(4)), bin), Contains("points to byte 4") && Contains("corrupt"));
  CHECK_THAT(open_with(idx, {bin.begin(), bin.end() - 4}), Contains("truncated") && Contains(".bin has 16 bytes"));
  auto longer = bin;
  longer.push_back(0);
  CHECK_THAT(open_with(idx, longer), Contains("belongs to another dataset"));
  CHECK_THAT(open_with(idx, read_bytes(md::bin_path(other))), Contains("belongs to another dataset"));
  CHECK_THAT(open_with(patched(doc_at, le64(1)), bin), Contains("starts at 1; expected 0"));
  CHECK_THAT(open_with(patched(doc_at + 8, le64(3)), bin), Contains("non-decreasing"));
  {
    auto decreasing = patched(doc_at + 8, le64(2));  // 0, 2, 1
    std::copy_n(le64(1).begin(), 8, decreasing.begin() + static_cast<long>(doc_at + 16));
    CHECK_THAT(open_with(decreasing, bin), Contains("non-decreasing"));
  }
  // A document index that stops short of the last sequence: 0, 1, 1.
  CHECK_THAT(open_with(patched(doc_at + 16, le64(1)), bin), Contains("ends at sequence 1, but there are 2"));
  CHECK_THROWS_WITH(md::IndexedDataset(dir / "missing"), Contains("missing.idx") && Contains("both files exist"));
  ::unlink(md::bin_path(other).c_str());
  CHECK_THROWS_WITH(md::IndexedDataset(other), Contains("other.bin"));
}

TEST_CASE("NumpyRandomState shuffles as numpy.random.RandomState does", "[data]") {
  // numpy 2.x: a = np.arange(10); np.random.RandomState(1234).shuffle(a) -> the list below;
  // RandomState(1234).randint(0, 2**32, 3, dtype=np.uint64) -> the three draws below.
  md::NumpyRandomState r(1234);
  std::vector<int> a(10);
  std::iota(a.begin(), a.end(), 0);
  r.shuffle(a);
  CHECK(a == std::vector<int>({7, 2, 9, 1, 0, 8, 4, 5, 6, 3}));
  md::NumpyRandomState d(1234);
  CHECK(d.next_uint32() == 822569775u);
  CHECK(d.next_uint32() == 2137449171u);
  CHECK(d.next_uint32() == 2671936806u);
}

TEST_CASE("GPT samples: s+1 tokens, overlapping by one, covering the shuffled documents in order", "[data]") {
  TempDir dir("megatorch_data");
  const std::vector<int64_t> lengths{7, 3, 12, 1, 9, 5};  // 37 tokens
  auto indexed = std::make_shared<const md::IndexedDataset>(write_numbered(dir / "n", lengths));
  md::GPTDatasetOptions o;
  o.seq_length = 4;
  o.seed = 7;
  o.num_samples = 20;  // 81 tokens needed: 3 epochs of 37
  const md::GPTDataset ds(indexed, 0, 6, o);
  CHECK(ds.tokens_per_epoch() == 37);
  CHECK(ds.num_epochs() == 3);
  CHECK(ds.size() == (3 * 37 - 1) / 4);
  CHECK(ds.size() >= 20);
  // Each epoch's slice of the document index holds every document once.
  const auto& di = ds.document_index();
  REQUIRE(di.size() == 18);
  // The stream of tokens in document-index order; sample k of the unshuffled order is
  // stream[4k, 4k + 5).
  std::vector<int64_t> stream;
  for (int32_t d : di) {
    const auto t = to_vec(indexed->get(d));
    stream.insert(stream.end(), t.begin(), t.end());
  }
  std::set<int64_t> seen;
  for (int64_t i = 0; i < ds.size(); ++i) {
    const int64_t k = ds.shuffle_index()[static_cast<size_t>(i)];
    seen.insert(k);
    const auto sample = to_vec(ds.get(i));
    REQUIRE(sample.size() == 5);
    CHECK(sample == std::vector<int64_t>(stream.begin() + 4 * k, stream.begin() + 4 * k + 5));
  }
  CHECK(static_cast<int64_t>(seen.size()) == ds.size());  // the shuffle is a permutation
  CHECK_THROWS_WITH(ds.get(ds.size()), Contains("out of range"));

  // One epoch by default; the seed changes the order, not the content.
  o.num_samples = -1;
  o.seed = 1;
  const md::GPTDataset one(indexed, 0, 6, o);
  CHECK(one.num_epochs() == 1);
  CHECK(one.size() == 9);
  o.seed = 2;
  const md::GPTDataset other(indexed, 0, 6, o);
  CHECK(one.document_index() != other.document_index());
}

TEST_CASE("GPT dataset: a barely used final epoch is shuffled on its own", "[data]") {
  TempDir dir("megatorch_data");
  auto indexed = std::make_shared<const md::IndexedDataset>(write_numbered(dir / "n", std::vector<int64_t>(10, 10)));
  md::GPTDatasetOptions o;
  o.seq_length = 9;
  o.num_samples = 12;  // 11 samples per epoch of 100 tokens; the 2nd epoch gives 1 of 11 (< 80%)
  const md::GPTDataset ds(indexed, 0, 10, o);
  REQUIRE(ds.num_epochs() == 2);
  // The first epoch's documents come first and are all of them, then the last epoch's.
  const auto& di = ds.document_index();
  std::set<int32_t> first(di.begin(), di.begin() + 10), second(di.begin() + 10, di.end());
  CHECK(first.size() == 10);
  CHECK(second.size() == 10);
  // Samples of the first epoch are shuffled among themselves: the first 11 entries of the
  // shuffle index are exactly 0..10.
  std::set<int64_t> head(ds.shuffle_index().begin(), ds.shuffle_index().begin() + 11);
  CHECK(*head.rbegin() == 10);
  CHECK(head.size() == 11);
}

TEST_CASE("an empty split gives no samples, or an error when samples are wanted", "[data]") {
  TempDir dir("megatorch_data");
  auto indexed = std::make_shared<const md::IndexedDataset>(write_numbered(dir / "n", {5, 5}));
  md::GPTDatasetOptions o;
  o.seq_length = 4;
  o.split = md::Split::kTest;
  CHECK(md::GPTDataset(indexed, 2, 2, o).size() == 0);
  o.num_samples = 3;
  CHECK_THROWS_WITH(md::GPTDataset(indexed, 2, 2, o), Contains("test split") && Contains("has no tokens"));
  o.seq_length = 1;
  CHECK_THROWS_WITH(md::GPTDataset(indexed, 0, 2, o), Contains("--seq-length > 1"));
}

TEST_CASE("--split and --data-path parse as Megatron parses them", "[data]") {
  const auto m = md::parse_split("969,30,1");
  REQUIRE(m[0]);
  CHECK(m[0]->first == 0.0);
  CHECK(m[0]->second == 0.969);
  CHECK(m[1]->second == Approx(0.999).epsilon(1e-15));
  CHECK(m[2]->second == Approx(1.0).epsilon(1e-15));
  const auto only_train = md::parse_split("1");
  CHECK(only_train[0]);
  CHECK(!only_train[1]);
  CHECK(!only_train[2]);
  const auto no_test = md::parse_split("98,2,0");
  CHECK(no_test[1]);
  CHECK(!no_test[2]);
  CHECK_THROWS_WITH(md::parse_split("1,2,3,4"), Contains("1 to 3"));
  CHECK_THROWS_WITH(md::parse_split("0,0"), Contains("sum to 0"));
  CHECK_THROWS_WITH(md::parse_split("1.2.3"), Contains("not a number"));

  const auto w = md::parse_data_path({"0.3", "a/x", "70", "b/y"});
  CHECK(w.prefixes == std::vector<std::string>({"a/x", "b/y"}));
  CHECK(w.weights == std::vector<double>({0.3, 70}));
  const auto u = md::parse_data_path({"a/x", "b/y"});
  CHECK(u.prefixes.size() == 2);
  CHECK(u.weights.empty());
  CHECK(md::parse_data_path({"only"}).prefixes == std::vector<std::string>({"only"}));
  CHECK_THROWS_WITH(md::parse_data_path({"0.5", "a", "b"}), Contains("mixes weights and prefixes"));
  CHECK_THROWS_WITH(md::parse_data_path({"-1", "a"}), Contains("must be positive"));
  CHECK_THROWS_WITH(md::parse_data_path({}), Contains("at least one"));
}

TEST_CASE("blending follows the weights as closely as whole samples allow", "[data]") {
  std::vector<int16_t> di;
  std::vector<int64_t> dsi;
  md::build_blending_indices({0.5, 0.5}, 6, di, dsi);
  CHECK(di == std::vector<int16_t>({0, 1, 0, 1, 0, 1}));
  CHECK(dsi == std::vector<int64_t>({0, 0, 1, 1, 2, 2}));
  md::build_blending_indices(md::normalize_weights({1, 3}), 8, di, dsi);
  // Sample k goes to the dataset with the largest w*max(k,1) - taken (0.25 and 0.75), the
  // first on a tie (k = 4: both 0).
  CHECK(di == std::vector<int16_t>({1, 0, 1, 1, 0, 1, 1, 1}));
  md::build_exhaustive_blending_indices({2, 1}, di, dsi);
  CHECK(di == std::vector<int16_t>({0, 1, 0}));
  CHECK(dsi == std::vector<int64_t>({0, 0, 1}));
  CHECK(md::normalize_weights({1, 1, 2}) == std::vector<double>({0.25, 0.25, 0.5}));
  CHECK_THROWS_WITH(md::normalize_weights({1, 0}), Contains("positive"));
}

TEST_CASE("build_gpt_datasets: one prefix split by documents, blends sized as Megatron sizes them", "[data]") {
  TempDir dir("megatorch_data");
  const std::string a = write_numbered(dir / "a", std::vector<int64_t>(100, 20));
  const std::string b = write_numbered(dir / "b", std::vector<int64_t>(50, 30));
  auto opts = md::GPTDataOptions().seq_length(16).seed(1234).split("90,8,2");
  const auto one = md::build_gpt_datasets(opts.blend(md::parse_data_path({a})).num_samples({200, 10, 5}));
  const auto* train = dynamic_cast<const md::GPTDataset*>(one.train.get());
  REQUIRE(train != nullptr);
  CHECK(train->tokens_per_epoch() == 90 * 20);  // documents [0, 90)
  CHECK(train->size() >= 200);
  CHECK(dynamic_cast<const md::GPTDataset&>(*one.valid).tokens_per_epoch() == 8 * 20);
  CHECK(dynamic_cast<const md::GPTDataset&>(*one.test).tokens_per_epoch() == 2 * 20);
  // Every valid token comes from documents 90..97.
  for (int64_t i = 0; i < one.valid->size(); ++i) {
    for (int64_t t : to_vec(one.valid->get(i))) CHECK((t / 1000 >= 90 && t / 1000 < 98));
  }

  const auto blend = md::build_gpt_datasets(opts.blend(md::parse_data_path({"1", a, "3", b})).num_samples({101, 10, 5}));
  // Dataset d gives ceil(n * w_d) samples: ceil(25.25) + ceil(75.75) = 102.
  CHECK(blend.train->size() == 26 + 76);
  CHECK(blend.valid->size() == 3 + 8);
  const auto& bt = dynamic_cast<const md::BlendedDataset&>(*blend.train);
  CHECK(bt.weights() == std::vector<double>({0.25, 0.75}));
  CHECK(bt.datasets()[0]->size() >= 27);  // built with Megatron's 0.5% surplus: ceil(26 * 1.005)
  CHECK(blend.train->get(0).size(0) == 17);

  const auto by_size = md::build_gpt_datasets(opts.blend(md::parse_data_path({a, b})).num_samples({50, -1, -1}));
  CHECK(by_size.train->size() == 50);
  const auto& u = dynamic_cast<const md::BlendedDataset&>(*by_size.valid);
  CHECK(u.size() == u.datasets()[0]->size() + u.datasets()[1]->size());  // exhaustive

  const auto no_test = md::build_gpt_datasets(opts.blend(md::parse_data_path({a})).split("1").num_samples({10, 0, 0}));
  CHECK(no_test.valid->size() == 0);
  CHECK(no_test.test->size() == 0);
  CHECK_THROWS_WITH(md::build_gpt_datasets(opts.blend(md::parse_data_path({"1", a, "1", b})).num_samples({10, -1, 1})),
                    Contains("valid split has none"));
}

TEST_CASE("preprocess_jsonl: ByteLevel and PreTokenized, Megatron's document rules, clear errors", "[data]") {
  TempDir dir("megatorch_data");
  const std::string in = dir / "in.jsonl";
  {
    std::ofstream f(in);
    f << R"({"text": "ab", "other": "x"})" << "\n";
    f << R"({"text": ""})" << "\n";  // an empty document: no tokens, no end-of-document
    f << "\n";                       // blank lines are skipped
    f << R"({"text": ["c", "", "de"]})" << "\n";  // sentences: two non-empty sequences
    f << R"({"text": "\u00e9"})" << "\n";        // UTF-8: two bytes
  }
  for (int64_t workers : {1, 3}) {
    const std::string out = dir / ("w" + std::to_string(workers));
    const auto r = md::preprocess_jsonl(
        md::PreprocessOptions().input(in).output_prefix(out).append_eod(true).workers(workers));
    CHECK(r.lines == 4);
    CHECK(r.dtype == "uint16");
    REQUIRE(r.outputs.size() == 1);
    CHECK(r.outputs[0].prefix == out + "_text_document");
    const md::IndexedDataset ds(r.outputs[0].prefix);
    CHECK(ds.num_documents() == 4);
    CHECK(ds.num_sequences() == 4);
    CHECK(to_vec(ds.get(0)) == std::vector<int64_t>({'a', 'b', 256}));
    CHECK(ds.document_index(2) == 1);  // the empty document
    CHECK(to_vec(ds.get(1)) == std::vector<int64_t>({'c'}));
    CHECK(to_vec(ds.get(2)) == std::vector<int64_t>({'d', 'e', 256}));
    CHECK(to_vec(ds.get(3)) == std::vector<int64_t>({0xc3, 0xa9, 256}));
  }
  CHECK(read_bytes(dir / "w1_text_document.bin") == read_bytes(dir / "w3_text_document.bin"));
  CHECK(read_bytes(dir / "w1_text_document.idx") == read_bytes(dir / "w3_text_document.idx"));

  const std::string ids = dir / "ids.jsonl";
  {
    std::ofstream f(ids);
    f << R"({"ids": [70000, 1, 2]})" << "\n" << R"({"ids": [[3], [4, 5]]})" << "\n";
  }
  const auto r = md::preprocess_jsonl(md::PreprocessOptions()
                                          .input(ids)
                                          .output_prefix(dir / "p")
                                          .json_keys({"ids"})
                                          .tokenizer(md::TokenizerOptions()
                                                         .tokenizer_type("PreTokenized")
                                                         .vocab_size(80000)
                                                         .eod_id(79999))
                                          .append_eod(true));
  CHECK(r.dtype == "int32");
  const md::IndexedDataset p(dir / "p_ids_document");
  CHECK(to_vec(p.get(0)) == std::vector<int64_t>({70000, 1, 2, 79999}));
  CHECK(to_vec(p.get(2)) == std::vector<int64_t>({4, 5, 79999}));

  auto base = md::PreprocessOptions().input(in).output_prefix(dir / "e");
  CHECK_THROWS_WITH(md::preprocess_jsonl(base.json_keys({"missing"})), Contains("line 1 has no key \"missing\""));
  CHECK_THROWS_WITH(md::preprocess_jsonl(md::PreprocessOptions().input(ids).output_prefix(dir / "e")
                                             .json_keys({"ids"})
                                             .tokenizer(md::TokenizerOptions().tokenizer_type("PreTokenized").vocab_size(100))),
                    Contains("token id 70000 is outside [0, --vocab-size=100)"));
  CHECK_THROWS_WITH(md::preprocess_jsonl(md::PreprocessOptions().input(ids).output_prefix(dir / "e").json_keys({"ids"})),
                    Contains("must be a string") && Contains("PreTokenized"));
  CHECK_THROWS_WITH(md::preprocess_jsonl(md::PreprocessOptions().input(in).output_prefix(dir / "e")
                                             .tokenizer(md::TokenizerOptions().tokenizer_type("GPT2BPE"))),
                    Contains("unknown --tokenizer-type 'GPT2BPE'"));
  {
    std::ofstream f(dir / "bad.jsonl");
    f << R"({"text": "ok"})" << "\n" << "{not json\n";
  }
  CHECK_THROWS_WITH(md::preprocess_jsonl(md::PreprocessOptions().input(dir / "bad.jsonl").output_prefix(dir / "e")),
                    Contains("line 2 is not valid JSON"));
  CHECK_THROWS_WITH(md::preprocess_jsonl(md::PreprocessOptions().input(dir / "nope.jsonl").output_prefix(dir / "e")),
                    Contains("cannot open --input"));
}
