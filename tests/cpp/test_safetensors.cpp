// The safetensors reader against hand-made files: every malformed header or data section
// is an error naming the file (and the tensor, where there is one), never a crash, a read
// past the end or an allocation sized by a corrupt field.
#include <catch2/catch.hpp>
#include <ftw.h>
#include <megatorch/megatorch.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "temp_dir.h"

using megatorch::ckpt::SafetensorsReader;
using megatorch::ckpt::write_safetensors;

namespace {

// The 8-byte little-endian header length.
std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file: length prefix (the header's own length unless `len` overrides it), header, data.
std::string st_bytes(const std::string& header, const std::string& data, int64_t len = -1) {
  return le64(len < 0 ? header.size() : static_cast<uint64_t>(len)) + header + data;
}

std::string put(const TempDir& dir, const std::string& name, const std::string& bytes) {
  const std::string p = dir / name;
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return p;
}

// Opens `bytes` as a file and expects an error containing the file's path and each of `parts`.
void expect_rejected(const TempDir& dir, const std::string& bytes, const std::vector<std::string>& parts) {
  const std::string p = put(dir, "bad.safetensors", bytes);
  try {
    SafetensorsReader r(p);
    FAIL("expected the reader to reject the file; it read " << r.names().size() << " tensors");
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains(p));
    for (const auto& part : parts) CHECK_THAT(msg, Catch::Contains(part));
  }
}

// One F32 tensor "w" of shape [2] at data bytes [0, 8), with `entry` replacing its fields.
std::string one_tensor(const std::string& entry) { return "{\"w\":" + entry + "}"; }

}  // namespace

TEST_CASE("safetensors: a valid file still reads", "[safetensors]") {
  TempDir dir("megatorch_st");
  const at::Tensor a = torch::arange(6, torch::kFloat).reshape({2, 3});
  const at::Tensor b = torch::tensor({1, -2, 3}, torch::kLong);
  const at::Tensor empty = torch::empty({0, 4}, torch::kBFloat16);
  const at::Tensor scalar = torch::tensor(true);
  const std::string p = dir / "ok.safetensors";
  write_safetensors(p, {{"a", a}, {"empty", empty}, {"b", b}, {"s", scalar}}, {{"format", "pt"}}, false);
  SafetensorsReader r(p);
  CHECK(r.names() == std::vector<std::string>{"a", "empty", "b", "s"});
  CHECK(r.metadata().at("format") == "pt");
  CHECK(torch::equal(r.read("a"), a));
  CHECK(torch::equal(r.read("b"), b));
  CHECK(r.read("empty").sizes() == empty.sizes());
  CHECK(r.read("s").item<bool>());
  CHECK_THROWS_WITH(r.read("nope"), Catch::Contains(p) && Catch::Contains("'nope'"));

  // By hand: whitespace padding after the JSON, no tensors at all, unknown extra fields.
  SafetensorsReader none(put(dir, "none.safetensors", st_bytes("{}      ", "")));
  CHECK(none.names().empty());
  const std::string data(8, '\0');
  SafetensorsReader extra(put(dir, "x.safetensors",
                              st_bytes(one_tensor(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1})"), data)));
  CHECK(extra.read("w").sizes() == std::vector<int64_t>{2});
}

TEST_CASE("safetensors: the header length is checked before anything is allocated", "[safetensors]") {
  TempDir dir("megatorch_st");
  expect_rejected(dir, "", {"at least 8"});
  expect_rejected(dir, "\x10\x00\x00", {"at least 8"});
  // Far beyond the format's limit: must fail without trying to allocate it.
  expect_rejected(dir, st_bytes("{}", "", int64_t{1} << 62), {"at most 100000000"});
  expect_rejected(dir, le64(~uint64_t{0}) + "{}", {"at most 100000000"});
  expect_rejected(dir, st_bytes("{}", "", 100'000'001), {"at most 100000000"});
  // Within the limit but larger than the file.
  expect_rejected(dir, st_bytes("{}", "", 3), {"header of 3 bytes in a file of 10"});
  expect_rejected(dir, st_bytes("{}", "", 1000), {"truncated"});
}

TEST_CASE("safetensors: the header must be a JSON object of entries", "[safetensors]") {
  TempDir dir("megatorch_st");
  expect_rejected(dir, st_bytes("{\"w\":", ""), {"not valid JSON"});
  expect_rejected(dir, st_bytes("not json", ""), {"not valid JSON"});
  expect_rejected(dir, st_bytes("[1,2]", ""), {"expected a JSON object", "array"});
  expect_rejected(dir, st_bytes("7", ""), {"expected a JSON object", "number"});
  expect_rejected(dir, st_bytes(std::string(100000, '[') + std::string(100000, ']'), ""), {"nested deeper"});
  expect_rejected(dir, st_bytes(R"({"__metadata__":[1]})", ""), {"__metadata__", "array"});
  expect_rejected(dir, st_bytes(R"({"__metadata__":{"k":1}})", ""), {"__metadata__", "'k'", "string"});
  const std::string e = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  expect_rejected(dir, st_bytes("{\"w\":" + e + ",\"w\":" + e + "}", std::string(8, '\0')), {"'w' appears twice"});
}

TEST_CASE("safetensors: every bad tensor entry names the file and the tensor", "[safetensors]") {
  TempDir dir("megatorch_st");
  const std::string d8(8, '\0');
  const auto rejected = [&](const std::string& entry, const std::vector<std::string>& parts, const std::string& data) {
    INFO(entry);
    std::vector<std::string> all = parts;
    all.push_back("tensor 'w'");
    expect_rejected(dir, st_bytes(one_tensor(entry), data), all);
  };
  rejected("[]", {"expected an object", "array"}, d8);
  rejected(R"({"shape":[2],"data_offsets":[0,8]})", {"no \"dtype\""}, d8);
  rejected(R"({"dtype":"F32","data_offsets":[0,8]})", {"no \"shape\""}, d8);
  rejected(R"({"dtype":"F32","shape":[2]})", {"no \"data_offsets\""}, d8);
  rejected(R"({"dtype":5,"shape":[2],"data_offsets":[0,8]})", {"\"dtype\"", "number"}, d8);
  rejected(R"({"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,8]})", {"unsupported dtype 'F8_E4M3'"}, d8);
  // Shapes: not an array, negative, fractional, beyond int64, products that overflow.
  rejected(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})", {"\"shape\" to be an array"}, d8);
  rejected(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})", {"non-negative", "-2"}, d8);
  rejected(R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})", {"integers", "2.5"}, d8);
  rejected(R"({"dtype":"F32","shape":["2"],"data_offsets":[0,8]})", {"integers"}, d8);
  rejected(R"({"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]})", {"fit in 64 bits"}, d8);
  rejected(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})", {"overflows"}, d8);
  rejected(R"({"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]})", {"overflows"}, "");
  rejected(R"({"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]})", {"overflows 64 bits of bytes"}, d8);
  // Offsets: shape, sign, order, bounds, and their agreement with the shape.
  rejected(R"({"dtype":"F32","shape":[2],"data_offsets":8})", {"[begin, end]"}, d8);
  rejected(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4,8]})", {"[begin, end]"}, d8);
  rejected(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})", {"non-negative"}, d8);
  rejected(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8.0]})", {"integers"}, d8);
  rejected(R"({"dtype":"F32","shape":[0],"data_offsets":[8,0]})", {"end before they begin"}, d8);
  rejected(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", {"past the data section of 4 bytes", "truncated"},
           std::string(4, '\0'));
  rejected(R"({"dtype":"F32","shape":[2],"data_offsets":[0,9223372036854775807]})", {"past the data section"}, d8);
  rejected(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})", {"hold 8 bytes", "needs 12"}, d8);
  rejected(R"({"dtype":"F64","shape":[2],"data_offsets":[0,8]})", {"hold 8 bytes", "needs 16"}, d8);
}

TEST_CASE("safetensors: tensors must tile the data section", "[safetensors]") {
  TempDir dir("megatorch_st");
  const auto entry = [](const std::string& name, int64_t n, int64_t begin) {
    return "\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(n) + "],\"data_offsets\":[" +
           std::to_string(begin) + "," + std::to_string(begin + n) + "]}";
  };
  // Overlap: b starts inside a.
  expect_rejected(dir, st_bytes("{" + entry("a", 4, 0) + "," + entry("b", 4, 2) + "}", std::string(6, 'x')),
                  {"tensor 'b'", "overlaps tensor 'a'"});
  // The same bytes twice.
  expect_rejected(dir, st_bytes("{" + entry("a", 4, 0) + "," + entry("b", 4, 0) + "}", std::string(4, 'x')),
                  {"overlaps"});
  // Gaps: before the first tensor, between two.
  expect_rejected(dir, st_bytes("{" + entry("a", 4, 2) + "}", std::string(6, 'x')),
                  {"tensor 'a'", "begins at data byte 2", "gap of 2"});
  expect_rejected(dir, st_bytes("{" + entry("a", 4, 0) + "," + entry("b", 2, 6) + "}", std::string(8, 'x')),
                  {"tensor 'b'", "tensor 'a' ends", "gap of 2"});
  // Bytes after the last tensor.
  expect_rejected(dir, st_bytes("{" + entry("a", 4, 0) + "}", std::string(7, 'x')),
                  {"has 7 bytes but the tensors cover 4", "'a'"});
  expect_rejected(dir, st_bytes("{}", "xyz"), {"has 3 bytes", "no tensors"});
  // Zero-size tensors may sit anywhere in the tiling (the writer puts them in order).
  TempDir ok;
  SafetensorsReader r(put(ok, "z.safetensors", st_bytes("{" + entry("a", 4, 0) + "," + entry("z", 0, 4) + "," +
                                                          entry("b", 2, 4) + "}",
                                                      std::string(6, 'x'))));
  CHECK(r.read("b").size(0) == 2);
  CHECK(r.read("z").numel() == 0);
}

TEST_CASE("safetensors: a file truncated after opening fails the read, naming the tensor", "[safetensors]") {
  TempDir dir("megatorch_st");
  const std::string p = dir / "t.safetensors";
  write_safetensors(p, {{"a", torch::ones({16})}, {"b", torch::ones({16})}}, {}, false);
  SafetensorsReader r(p);
  struct stat st {};
  REQUIRE(::stat(p.c_str(), &st) == 0);
  REQUIRE(::truncate(p.c_str(), st.st_size - 10) == 0);
  CHECK(r.read("a").sum().item<float>() == 16.0f);
  CHECK_THROWS_WITH(r.read("b"), Catch::Contains(p) && Catch::Contains("tensor 'b'") &&
                                     Catch::Contains("unexpected end of file"));
}

TEST_CASE("safetensors: every truncation and many corruptions are errors, never crashes", "[safetensors]") {
  TempDir dir("megatorch_st");
  const std::string src = dir / "src.safetensors";
  write_safetensors(src, {{"a", torch::arange(12, torch::kFloat).reshape({3, 4})}, {"b", torch::ones({5}, torch::kLong)}},
                    {{"format", "pt"}}, false);
  std::ifstream in(src, std::ios::binary);
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Reads whatever the reader accepts: an accepted file must read every tensor in bounds.
  const auto attempt = [&](const std::string& bytes) -> bool {
    const std::string p = put(dir, "c.safetensors", bytes);
    try {
      SafetensorsReader r(p);
      for (const auto& n : r.names()) (void)r.read(n);
      return true;
    } catch (const c10::Error& e) {
      CHECK_THAT(std::string(e.what()), Catch::Contains(p));
      return false;
    }
  };
  REQUIRE(attempt(good));
  for (size_t n = 0; n < good.size(); ++n) {
    INFO("truncated to " << n << " bytes");
    CHECK_FALSE(attempt(good.substr(0, n)));
  }
  std::mt19937 rng(1234);
  int accepted = 0;
  for (int i = 0; i < 400; ++i) {
    std::string bad = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) bad[rng() % bad.size()] = static_cast<char>(rng() & 0xff);
    accepted += attempt(bad) ? 1 : 0;  // a flip in the data or the padding is still a valid file
  }
  CHECK(accepted < 400);
}
