#include "megatorch/data/preprocess.h"

#include <cstring>
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

// Megatron's Encoder.encode for one line: every key's document. Stateless apart from the
// options; the tokenizer is the calling worker's own.
class Encoder {
 public:
  Encoder(const PreprocessOptions& o, int64_t vocab_size, int64_t eod) : o_(o), vocab_size_(vocab_size), eod_(eod) {}

  std::vector<EncodedDoc> encode(const std::string& line, int64_t line_no, Tokenizer& tok) const {
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
      for_each_sentence(*it, line_no, key, tok, [&](std::vector<int64_t> ids) {
        // As Megatron: a sentence whose encoding is empty adds no sequence.
        if (ids.empty()) return;
        for (const int64_t id : ids) {
          MEGATORCH_CHECK(id >= 0 && id < vocab_size_, o_.input(), " line ", line_no, ": token id ", id,
                          " is outside [0, ", tok.has_text() ? "the " + tok.name() + " vocabulary" : "--vocab-size",
                          "=", vocab_size_, ")");
        }
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
  void for_each_sentence(const json& v, int64_t line_no, const std::string& key, Tokenizer& tok, F&& emit) const {
    if (tok.has_text()) {
      const auto one = [&](const json& s) {
        MEGATORCH_CHECK(s.is_string(), o_.input(), " line ", line_no, ": \"", key, "\" must be a string or a list of ",
                        "strings for ", tok.name(), ", got ", s.type_name(),
                        " (pre-tokenized ids need --tokenizer-type PreTokenized)");
        emit(tok.tokenize(s.get_ref<const std::string&>()));
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
        ids.push_back(t.get<int64_t>());
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
  int64_t vocab_size_;
  int64_t eod_;
};

// Runs fn(w) for w in [0, n) on n threads (inline for one) and rethrows the first error.
template <typename F>
void parallel_for(size_t n, F&& fn) {
  std::vector<std::exception_ptr> errors(n);
  const auto run = [&](size_t w) {
    try {
      fn(w);
    } catch (...) {
      errors[w] = std::current_exception();
    }
  };
  if (n == 1) {
    run(0);
  } else {
    std::vector<std::thread> threads;
    for (size_t w = 0; w < n; ++w) threads.emplace_back(run, w);
    for (auto& t : threads) t.join();
  }
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

bool is_blank(const std::string& line) {
  return line.find_first_not_of(" \t\r\n") == std::string::npos;
}

// Lines of a stream, read in fixed chunks so that no line is held beyond max_bytes: a line
// without a newline in sight (a binary file, one giant document) fails with its number
// instead of exhausting memory the way std::getline would.
class LineReader {
 public:
  LineReader(std::istream& in, const std::string& name, int64_t max_bytes)
      : in_(in), name_(name), max_bytes_(max_bytes), buf_(size_t{1} << 20) {}

  // The next line without its '\n' into line; false at the end of the input. line_no
  // (the number this line will have) is for the error message only.
  bool next(std::string& line, int64_t line_no) {
    line.clear();
    bool any = false;
    for (;;) {
      if (pos_ == len_) {
        in_.read(buf_.data(), static_cast<std::streamsize>(buf_.size()));
        len_ = static_cast<size_t>(in_.gcount());
        pos_ = 0;
        if (len_ == 0) return any;
      }
      any = true;
      const char* start = buf_.data() + pos_;
      const auto* nl = static_cast<const char*>(std::memchr(start, '\n', len_ - pos_));
      const size_t n = nl != nullptr ? static_cast<size_t>(nl - start) : len_ - pos_;
      MEGATORCH_CHECK(static_cast<int64_t>(line.size() + n) <= max_bytes_, name_, " line ", line_no,
                      " is longer than --max-line-bytes ", max_bytes_, " (", line.size() + n,
                      " bytes read without a newline); split the document, or raise --max-line-bytes if the "
                      "line is meant to be this long");
      line.append(start, n);
      pos_ += n + (nl != nullptr ? 1 : 0);
      if (nl != nullptr) return true;
    }
  }

 private:
  std::istream& in_;
  const std::string& name_;
  int64_t max_bytes_;
  std::vector<char> buf_;
  size_t pos_ = 0, len_ = 0;
};

}  // namespace

PreprocessReport preprocess_jsonl(const PreprocessOptions& o) {
  MEGATORCH_CHECK(!o.input().empty(), "--input JSONL file is required");
  MEGATORCH_CHECK(!o.output_prefix().empty(), "--output-prefix is required");
  MEGATORCH_CHECK(!o.json_keys().empty(), "--json-keys needs at least one key");
  MEGATORCH_CHECK(o.workers() >= 1, "--workers must be >= 1, got ", o.workers());
  MEGATORCH_CHECK(o.max_line_bytes() >= 1, "--max-line-bytes must be >= 1, got ", o.max_line_bytes());
  std::ifstream in(o.input(), std::ios::binary);
  MEGATORCH_CHECK(in.good(), "cannot open --input ", o.input());
  const auto workers = static_cast<size_t>(o.workers());
  // One tokenizer per worker, started together (a library-backed one is a process that
  // takes a moment to import its library).
  std::vector<std::unique_ptr<Tokenizer>> tokenizers(workers);
  parallel_for(workers, [&](size_t w) { tokenizers[w] = build_tokenizer(o.tokenizer()); });
  const int64_t vocab_size = tokenizers[0]->vocab_size();
  const int64_t eod = tokenizers[0]->eod();
  MEGATORCH_CHECK(!o.append_eod() || (eod >= 0 && eod < vocab_size), "--append-eod needs an end-of-document id in [0, ",
                  vocab_size, ") but the ", tokenizers[0]->name(), " tokenizer has ", eod,
                  tokenizers[0]->has_text() ? " (a HuggingFace tokenizer needs an eos_token)" : " (give --eod-id)");
  const Encoder encoder(o, vocab_size, eod);
  LineReader reader(in, o.input(), o.max_line_bytes());

  PreprocessReport report;
  report.tokenizer = tokenizers[0]->name();
  report.vocab_size = vocab_size;
  report.dtype = dtype_name(optimal_dtype(vocab_size));
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  for (const std::string& key : o.json_keys()) {
    PreprocessOutput out;
    out.key = key;
    out.prefix = o.output_prefix() + "_" + key + "_document";
    builders.push_back(std::make_unique<IndexedDatasetBuilder>(bin_path(out.prefix), optimal_dtype(vocab_size)));
    report.outputs.push_back(out);
  }

  // Lines are read in batches, encoded by the workers in parallel (each a contiguous slice)
  // and written in input order.
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
      if (!reader.next(line, line_no + 1)) {
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
    parallel_for(workers, [&](size_t w) {
      for (size_t i = w * lines.size() / workers; i < (w + 1) * lines.size() / workers; ++i) {
        encoded[i] = encoder.encode(lines[i], line_nos[i], *tokenizers[w]);
      }
    });
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
