#include "megatorch/data/preprocess.h"

#include <exception>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "megatorch/check.h"
#include "megatorch/data/indexed_dataset_builder.h"

namespace megatorch::data {

namespace {

using nlohmann::json;

// One document of one key: its tokens and the length of each sequence (sentence).
struct EncodedDoc {
  std::vector<int64_t> tokens;
  std::vector<int64_t> lengths;
};

class Encoder {
 public:
  explicit Encoder(const PreprocessOptions& o) : o_(o), byte_level_(o.tokenizer_type() == "ByteLevel") {
    if (byte_level_) {
      vocab_size_ = kByteLevelVocabSize;
      eod_ = kByteLevelEod;
    } else {
      MEGATORCH_CHECK(o.tokenizer_type() == "PreTokenized", "unknown --tokenizer-type '", o.tokenizer_type(),
                      "'; megatorch-preprocess has ByteLevel (UTF-8 bytes, vocab 257) and PreTokenized (JSON 'ids' lists)");
      MEGATORCH_CHECK(o.vocab_size() > 0, "--tokenizer-type PreTokenized needs --vocab-size (ids are checked against it)");
      vocab_size_ = o.vocab_size();
      eod_ = o.eod_id();
      MEGATORCH_CHECK(!o.append_eod() || (eod_ >= 0 && eod_ < vocab_size_),
                      "--append-eod with PreTokenized needs --eod-id in [0, --vocab-size), got ", eod_);
    }
  }
  int64_t vocab_size() const { return vocab_size_; }

  // Megatron's Encoder.encode for one line: every key's document.
  std::vector<EncodedDoc> encode(const std::string& line, int64_t line_no) const {
    json obj;
    try {
      obj = json::parse(line);
    } catch (const json::exception& e) {
      MEGATORCH_FAIL(o_.input(), " line ", line_no, " is not valid JSON: ", e.what());
    }
    MEGATORCH_CHECK(obj.is_object(), o_.input(), " line ", line_no, ": expected a JSON object, got ", obj.type_name());
    std::vector<EncodedDoc> docs;
    for (const std::string& key : o_.json_keys()) {
      const auto it = obj.find(key);
      MEGATORCH_CHECK(it != obj.end(), o_.input(), " line ", line_no, " has no key \"", key,
                      "\"; choose the field with --json-keys");
      EncodedDoc doc;
      for_each_sentence(*it, line_no, key, [&](std::vector<int64_t> ids) {
        if (ids.empty()) return;
        doc.lengths.push_back(static_cast<int64_t>(ids.size()));
        doc.tokens.insert(doc.tokens.end(), ids.begin(), ids.end());
      });
      if (!doc.tokens.empty() && o_.append_eod()) {
        doc.tokens.push_back(eod_);
        doc.lengths.back() += 1;
      }
      docs.push_back(std::move(doc));
    }
    return docs;
  }

 private:
  template <typename F>
  void for_each_sentence(const json& v, int64_t line_no, const std::string& key, F&& emit) const {
    if (byte_level_) {
      const auto one = [&](const json& s) {
        MEGATORCH_CHECK(s.is_string(), o_.input(), " line ", line_no, ": \"", key, "\" must be a string or a list of strings ",
                        "for ByteLevel, got ", s.type_name(), " (pre-tokenized ids need --tokenizer-type PreTokenized)");
        const std::string& text = s.get_ref<const std::string&>();
        std::vector<int64_t> ids(text.size());
        for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
        emit(std::move(ids));
      };
      if (v.is_array()) {
        for (const json& s : v) one(s);
      } else {
        one(v);
      }
      return;
    }
    const auto ids_of = [&](const json& list) {
      std::vector<int64_t> ids;
      ids.reserve(list.size());
      for (const json& t : list) {
        MEGATORCH_CHECK(t.is_number_integer(), o_.input(), " line ", line_no, ": \"", key,
                        "\" must hold integer token ids, got ", t.dump());
        const auto id = t.get<int64_t>();
        MEGATORCH_CHECK(id >= 0 && id < vocab_size_, o_.input(), " line ", line_no, ": token id ", id,
                        " is outside [0, --vocab-size=", vocab_size_, ")");
        ids.push_back(id);
      }
      return ids;
    };
    MEGATORCH_CHECK(v.is_array(), o_.input(), " line ", line_no, ": \"", key, "\" must be a list of token ids, got ",
                    v.type_name());
    if (!v.empty() && v.front().is_array()) {
      for (const json& s : v) {
        MEGATORCH_CHECK(s.is_array(), o_.input(), " line ", line_no, ": \"", key, "\" mixes lists and ids");
        emit(ids_of(s));
      }
    } else {
      emit(ids_of(v));
    }
  }

  const PreprocessOptions& o_;
  bool byte_level_;
  int64_t vocab_size_ = 0;
  int64_t eod_ = -1;
};

bool is_blank(const std::string& line) {
  return line.find_first_not_of(" \t\r\n") == std::string::npos;
}

}  // namespace

PreprocessReport preprocess_jsonl(const PreprocessOptions& o) {
  MEGATORCH_CHECK(!o.input().empty(), "--input JSONL file is required");
  MEGATORCH_CHECK(!o.output_prefix().empty(), "--output-prefix is required");
  MEGATORCH_CHECK(!o.json_keys().empty(), "--json-keys needs at least one key");
  MEGATORCH_CHECK(o.workers() >= 1, "--workers must be >= 1, got ", o.workers());
  const Encoder encoder(o);
  std::ifstream in(o.input(), std::ios::binary);
  MEGATORCH_CHECK(in.good(), "cannot open --input ", o.input());

  PreprocessReport report;
  report.dtype = dtype_name(optimal_dtype(encoder.vocab_size()));
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  for (const std::string& key : o.json_keys()) {
    PreprocessOutput out;
    out.key = key;
    out.prefix = o.output_prefix() + "_" + key + "_document";
    builders.push_back(std::make_unique<IndexedDatasetBuilder>(bin_path(out.prefix), optimal_dtype(encoder.vocab_size())));
    report.outputs.push_back(out);
  }

  // Lines are read in batches, encoded by the workers in parallel (each a contiguous slice)
  // and written in input order.
  const auto workers = static_cast<size_t>(o.workers());
  const size_t batch = 512 * workers;
  std::vector<std::string> lines;
  std::vector<int64_t> line_nos;
  std::vector<std::vector<EncodedDoc>> encoded;
  int64_t line_no = 0;
  bool eof = false;
  while (!eof) {
    lines.clear();
    line_nos.clear();
    std::string line;
    while (lines.size() < batch) {
      if (!std::getline(in, line)) {
        eof = true;
        break;
      }
      ++line_no;
      report.input_bytes += static_cast<int64_t>(line.size()) + 1;
      if (is_blank(line)) continue;
      lines.push_back(std::move(line));
      line_nos.push_back(line_no);
    }
    encoded.assign(lines.size(), {});
    std::vector<std::exception_ptr> errors(workers);
    const auto work = [&](size_t w) {
      try {
        for (size_t i = w * lines.size() / workers; i < (w + 1) * lines.size() / workers; ++i) {
          encoded[i] = encoder.encode(lines[i], line_nos[i]);
        }
      } catch (...) {
        errors[w] = std::current_exception();
      }
    };
    if (workers == 1) {
      work(0);
    } else {
      std::vector<std::thread> threads;
      for (size_t w = 0; w < workers; ++w) threads.emplace_back(work, w);
      for (auto& t : threads) t.join();
    }
    for (const auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    for (const auto& docs : encoded) {
      for (size_t k = 0; k < docs.size(); ++k) {
        builders[k]->add_document(docs[k].tokens.data(), docs[k].lengths);
        auto& out = report.outputs[k];
        out.documents += 1;
        out.sequences += static_cast<int64_t>(docs[k].lengths.size());
        out.tokens += static_cast<int64_t>(docs[k].tokens.size());
      }
    }
    report.lines += static_cast<int64_t>(lines.size());
  }
  MEGATORCH_CHECK(!in.bad(), "reading ", o.input(), " failed");
  for (size_t k = 0; k < builders.size(); ++k) builders[k]->finalize(idx_path(report.outputs[k].prefix));
  return report;
}

}  // namespace megatorch::data
