#include "checkpoint_metadata.h"

#include <algorithm>
#include <map>
#include <utility>

#include "megatorch/ckpt/safetensors.h"

namespace megatorch::ckpt::checkpoint_metadata {
namespace {

// A saved piece as an entry without data (for its runs).
ShardedEntry piece_entry(const std::string& key, const json& p) {
  ShardedEntry e;
  e.key = key;
  e.spec.full_shape = p.at("full_shape").get<std::vector<int64_t>>();
  e.spec.partition_dim = p.at("partition_dim").get<int64_t>();
  e.spec.rank = p.at("rank").get<int64_t>();
  e.spec.world = p.at("world").get<int64_t>();
  e.spec.parts = p.at("parts").get<int64_t>();
  e.spec.outer_rank = p.value("outer_rank", int64_t{0});
  e.spec.outer_world = p.value("outer_world", int64_t{1});
  e.begin = p.at("begin").get<int64_t>();
  e.end = p.at("end").get<int64_t>();
  e.valid_rows = p.at("valid_rows").get<int64_t>();
  return e;
}

// A shard's file, as metadata.json names it: a plain file name inside the iteration's
// directory. Anything else ("../x", "/abs", "sub/x") could read outside the checkpoint.
bool plain_file_name(const std::string& f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
         f.find('\0') == std::string::npos;
}

}  // namespace

json spec_json(const ShardedEntry& e) {
  json j = {{"full_shape", e.spec.full_shape}, {"partition_dim", e.spec.partition_dim}, {"rank", e.spec.rank},
            {"world", e.spec.world},           {"parts", e.spec.parts},                 {"begin", e.begin},
            {"end", e.end < 0 ? shard_numel(e) : e.end}, {"valid_rows", e.valid_rows}};
  // Only pieces with an outer split (experts over EP) carry it: absent means none.
  if (e.spec.outer_world > 1) {
    j["outer_rank"] = e.spec.outer_rank;
    j["outer_world"] = e.spec.outer_world;
  }
  return j;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

SavedPiece read_piece(const MetaFile& m, const std::string& key, const std::vector<int64_t>& shape, const json& p,
                      const std::string& where) {
  SavedPiece out;
  ShardedEntry& e = out.entry;
  e.key = key;
  e.spec.full_shape = m.shape(p, "full_shape", where);
  e.spec.partition_dim = m.integer(p, "partition_dim", where);
  e.spec.rank = m.integer(p, "rank", where);
  e.spec.world = m.integer(p, "world", where);
  e.spec.parts = m.integer(p, "parts", where);
  if (p.contains("outer_world")) {
    e.spec.outer_rank = m.integer(p, "outer_rank", where);
    e.spec.outer_world = m.integer(p, "outer_world", where);
  }
  e.begin = m.integer(p, "begin", where);
  e.end = m.integer(p, "end", where);
  e.valid_rows = m.integer(p, "valid_rows", where);
  out.file = m.string(p, "file", where);
  out.name = m.string(p, "name", where);
  const std::string dtype = m.string(p, "dtype", where);
  if (!plain_file_name(out.file)) {
    m.fail(where + ".file", "'" + out.file + "' leaves the checkpoint directory; expected a file name inside it "
                            "such as rank_00000.safetensors");
  }
  if (auto err = capture([&] { out.dtype = scalar_type_from_safetensors(dtype); })) {
    m.fail(where + ".dtype", without_error_prefix(*err));
  }
  if (auto err = capture([&] { validate_layout(e); })) m.fail(where, without_error_prefix(*err));
  if (logical_shape(e) != shape) {
    m.fail(where, "the piece's full_shape " + c10::str(c10::IntArrayRef(e.spec.full_shape)) + " with valid_rows " +
                      std::to_string(e.valid_rows) + " describes another tensor than the shape " +
                      c10::str(c10::IntArrayRef(shape)));
  }
  // Padding rows beyond the real ones: a vocabulary rounded up to a multiple of
  // tp x make_vocab_size_divisible_by has far fewer. Bounding them bounds the runs
  // entry_runs walks, so a damaged number cannot stall the load.
  if (e.valid_rows >= 0 && e.spec.full_shape[0] - e.valid_rows > std::max<int64_t>(e.valid_rows, 1 << 20)) {
    m.fail(where, "full_shape[0] = " + std::to_string(e.spec.full_shape[0]) + " pads valid_rows = " +
                      std::to_string(e.valid_rows) + " beyond any real padding");
  }
  if (e.end < 0) e.end = shard_numel(e);
  return out;
}

json assemble_tensors(const std::vector<json>& ranks) {
  json tensors = json::object();
  std::map<std::string, int64_t> held_by;  // keys some rank holds without writing
  for (const auto& r : ranks) {
    for (const auto& p : r.at("pieces")) {
      const std::string key = p.at("key");
      json piece = p;
      piece.erase("key");
      piece["file"] = r.at("file");
      auto& t = tensors[key];
      if (t.is_null()) t = {{"shape", p.at("shape")}, {"pieces", json::array()}};
      MEGATORCH_CHECK(t.at("shape") == p.at("shape"), "checkpoint save: '", key, "' has shape ", t.at("shape").dump(),
                      " on one rank and ", p.at("shape").dump(), " on rank ", r.at("rank").get<int64_t>(),
                      "; every rank must describe the same global tensor");
      piece.erase("shape");
      t["pieces"].push_back(piece);
    }
    for (const auto& k : r.at("held")) held_by.emplace(k.get<std::string>(), r.at("rank").get<int64_t>());
  }
  for (const auto& [key, rank] : held_by) {
    MEGATORCH_CHECK(tensors.contains(key), "checkpoint save: rank ", rank, " holds '", key,
                    "' with write = false and no rank writes it; exactly one copy of each piece needs write = true");
  }
  for (auto& [key, t] : tensors.items()) {
    std::vector<std::pair<Run, std::string>> runs;
    for (const auto& p : t.at("pieces")) {
      for (const Run& run : entry_runs(piece_entry(key, p))) runs.emplace_back(run, p.at("file").get<std::string>());
    }
    std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.first.global < b.first.global; });
    int64_t next = 0;
    for (const auto& [run, file] : runs) {
      MEGATORCH_CHECK(run.global >= next, "checkpoint save: elements of '", key, "' from element ", run.global,
                      " are written twice (again by ", file, "); set write = false on replicas (DP copies, "
                      "TP-replicated tensors on tp rank > 0)");
      MEGATORCH_CHECK(run.global == next, "checkpoint save: elements [", next, ", ", run.global, ") of '", key,
                      "' are written by no rank; every element needs one piece with write = true");
      next = run.global + run.length;
    }
    const int64_t total = numel_of(t.at("shape").get<std::vector<int64_t>>());
    MEGATORCH_CHECK(next == total, "checkpoint save: elements [", next, ", ", total, ") of '", key,
                    "' are written by no rank; every element needs one piece with write = true");
  }
  return tensors;
}

}  // namespace megatorch::ckpt::checkpoint_metadata
