#pragma once
// The library-backed tokenizer types (GPT2BPETokenizer, HuggingFaceTokenizer,
// SentencePieceTokenizer, Llama2Tokenizer) through megatorch's tokenizers.py in a Python
// co-process. Private to csrc/data: build_tokenizer is the public way in.
#include <memory>

#include "megatorch/data/tokenizer.h"

namespace megatorch::data {

// Starts the co-process and reads the tokenizer's vocab_size and eod from it; the options'
// files are assumed checked by build_tokenizer.
std::unique_ptr<Tokenizer> make_python_tokenizer(const TokenizerOptions& options);

}  // namespace megatorch::data
