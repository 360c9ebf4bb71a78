// Byte-level BPE tokenizer for Hugging Face tokenizer.json files (GPT-2, SmolLM, Llama-3, Qwen).
//
// Written here because no installable C++ library reads tokenizer.json: the executorch wheel ships
// no tokenizer, pytorch-tokenizers ships headers without sources, and the Rust `tokenizers` crate
// would add a Rust toolchain to the build. It implements exactly what those files use:
//   * added/special tokens matched first, verbatim (e.g. "<|im_start|>");
//   * pre-tokenization by the ByteLevel regex (GPT-2's), or a Split regex (Isolated) followed by
//     ByteLevel without regex, optionally preceded by Digits; regexes run in PCRE2 with Unicode
//     properties, the same patterns the `tokenizers` library compiles with Oniguruma;
//   * an NFC normalizer (Qwen2's) on ASCII text only, where it is the identity;
//   * GPT-2's byte -> printable-character map, then BPE merges by rank;
//   * decoding to raw bytes per token, so a streamer can hold back an incomplete UTF-8 character.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace spinquant {

class Tokenizer {
 public:
  // Throws std::runtime_error with a one-line reason when the file is missing or unusable.
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  std::vector<int64_t> encode(const std::string& text) const;
  // The raw bytes a token stands for (may be part of a UTF-8 character).
  const std::string& token_bytes(int64_t id) const;
  // The id of an added token's text, or -1.
  int64_t added_token_id(const std::string& content) const;
  size_t vocab_size() const { return id_bytes_.size(); }

 private:
  struct Regex;
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;
  void encode_ordinary(const std::string& text, std::vector<int64_t>& out) const;

  std::unordered_map<std::string, int64_t> vocab_;   // byte-level token string -> id
  std::vector<std::string> id_bytes_;                // id -> raw bytes
  std::unordered_map<std::string, int> merge_rank_;  // left + '\x01' + right -> rank
  std::vector<std::pair<std::string, int64_t>> added_;  // longest first
  std::string byte_char_[256];                       // byte -> UTF-8 of its printable stand-in
  Regex* split_ = nullptr;                           // the pre-tokenizer regex
  bool split_digits_ = false;                        // Digits(individual_digits=true) first
  bool nfc_ = false;                                 // an NFC normalizer: encode takes ASCII only
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

// Turns a stream of token bytes into whole UTF-8 characters.
class Utf8Streamer {
 public:
  // Bytes ready to print: complete characters, U+FFFD for invalid bytes; an incomplete trailing
  // sequence is kept for the next push (flush turns it into U+FFFD).
  std::string push(const std::string& bytes);
  std::string flush();

 private:
  std::string pending_;
};

}  // namespace spinquant
