#pragma once
// metadata.json of a checkpoint iteration, apart from the save and load that use it
// (checkpoint.cpp): how a piece is described, how the ranks' descriptions become the
// tensors' table (checked to cover each tensor exactly once), and how a description is
// read back with every field checked for presence and type, errors naming the file and
// the field ("tensors['model/x'].pieces[0].world"), never a bare nlohmann message.
// Private to csrc/ckpt.
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megatorch/check.h"
#include "megatorch/ckpt/sharded_entry.h"

namespace megatorch::ckpt::checkpoint_metadata {

using nlohmann::json;

// Runs f; its error message, if it threw.
template <class F>
std::optional<std::string> capture(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return std::string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

// A piece's layout as metadata.json stores it.
json spec_json(const ShardedEntry& e);
int64_t numel_of(const std::vector<int64_t>& shape);
// A metadata value for an error message, cut short (a damaged file may hold anything).
std::string show(const json& v);

struct MetaFile {
  std::string path;  // metadata.json

  [[noreturn]] void fail(const std::string& where, const std::string& problem) const {
    MEGATORCH_FAIL("checkpoint metadata '", path, "': ", where, ": ", problem,
                   "; the file is damaged or was edited by hand (restore it from the saving run)");
  }
  const json& member(const json& obj, const std::string& key, const std::string& where) const {
    if (!obj.is_object()) fail(where, "expected an object, got " + show(obj));
    const auto it = obj.find(key);
    if (it == obj.end()) fail(where + "." + key, "missing");
    return *it;
  }
  int64_t integer(const json& obj, const std::string& key, const std::string& where) const {
    const json& v = member(obj, key, where);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX)) {
      fail(where + "." + key, "expected an integer, got " + show(v));
    }
    return v.get<int64_t>();
  }
  std::string string(const json& obj, const std::string& key, const std::string& where) const {
    const json& v = member(obj, key, where);
    if (!v.is_string()) fail(where + "." + key, "expected a string, got " + show(v));
    return v.get<std::string>();
  }
  std::vector<int64_t> shape(const json& obj, const std::string& key, const std::string& where) const {
    const json& v = member(obj, key, where);
    bool ok = v.is_array();
    for (const auto& d : v) ok = ok && d.is_number_integer() && !(d.is_number_unsigned() && d.get<uint64_t>() > INT64_MAX);
    if (!ok) fail(where + "." + key, "expected a list of integers, got " + show(v));
    const auto out = v.get<std::vector<int64_t>>();
    for (int64_t d : out) {
      if (d < 0) fail(where + "." + key, "expected sizes >= 0, got " + show(v));
    }
    return out;
  }
  const json& array(const json& obj, const std::string& key, const std::string& where) const {
    const json& v = member(obj, key, where);
    if (!v.is_array()) fail(where + "." + key, "expected a list, got " + show(v));
    return v;
  }
  const json& object(const json& obj, const std::string& key, const std::string& where) const {
    const json& v = member(obj, key, where);
    if (!v.is_object()) fail(where + "." + key, "expected an object, got " + show(v));
    return v;
  }
};

// One saved piece of tensor `key` (logical `shape`) as metadata.json describes it.
struct SavedPiece {
  ShardedEntry entry;  // without data
  std::string file, name;
  c10::ScalarType dtype = c10::kFloat;
};
// Reads and checks piece `p` (at `where` in the file) of tensor `key`.
SavedPiece read_piece(const MetaFile& m, const std::string& key, const std::vector<int64_t>& shape, const json& p,
                      const std::string& where);

// Every rank's description -> the tensors' table, checking that the written pieces of
// each tensor cover it exactly once.
json assemble_tensors(const std::vector<json>& ranks);

}  // namespace megatorch::ckpt::checkpoint_metadata
