#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace spinquant {

namespace {

// GPT-2's pre-tokenizer pattern (the ByteLevel pre-tokenizer's use_regex=true).
const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// Length of the UTF-8 sequence starting with byte c (1 for stray continuation bytes).
size_t utf8_len(unsigned char c) {
  if (c >= 0xF0) return 4;
  if (c >= 0xE0) return 3;
  if (c >= 0xC0) return 2;
  return 1;
}

}  // namespace

struct Tokenizer::Regex {
  pcre2_code* code = nullptr;
  pcre2_match_data* match = nullptr;
  explicit Regex(const std::string& pattern) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                         PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      throw std::runtime_error("pre-tokenizer regex does not compile: " + std::string(reinterpret_cast<char*>(msg)));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // best effort: falls back to the interpreter
    match = pcre2_match_data_create_from_pattern(code, nullptr);
  }
  ~Regex() {
    pcre2_match_data_free(match);
    pcre2_code_free(code);
  }
  // Isolated split: every match is a piece, and so is every gap between matches.
  std::vector<std::string> split(const std::string& text) const {
    std::vector<std::string> pieces;
    size_t pos = 0, last = 0;
    while (pos <= text.size()) {
      int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                           PCRE2_NO_UTF_CHECK, match, nullptr);
      if (rc < 0) break;
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match);
      size_t start = ov[0], end = ov[1];
      if (start > last) pieces.emplace_back(text.substr(last, start - last));
      if (end > start) pieces.emplace_back(text.substr(start, end - start));
      last = end;
      pos = end > start ? end : end + utf8_len(static_cast<unsigned char>(text[end]));
    }
    if (last < text.size()) pieces.emplace_back(text.substr(last));
    return pieces;
  }
};

Tokenizer::Tokenizer(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open tokenizer file " + path);
  nlohmann::json j;
  try {
    file >> j;
  } catch (const std::exception& e) {
    throw std::runtime_error(path + " is not valid JSON (" + std::string(e.what()) + ")");
  }
  try {
    const auto& model = j.at("model");
    if (model.value("type", "BPE") != "BPE")
      throw std::runtime_error("only BPE models are supported, this is " + model.value("type", "?"));

    // GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256, 257, ...
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_char_[b] = utf8_of(printable ? b : 256 + n++);
    }
    std::unordered_map<std::string, unsigned char> char_byte;
    for (int b = 0; b < 256; ++b) char_byte[byte_char_[b]] = static_cast<unsigned char>(b);

    for (const auto& [token, id] : model.at("vocab").items()) {
      int64_t i = id.get<int64_t>();
      vocab_[token] = i;
      if (static_cast<size_t>(i) >= id_bytes_.size()) id_bytes_.resize(i + 1);
      std::string raw;
      for (size_t k = 0; k < token.size();) {
        size_t len = utf8_len(static_cast<unsigned char>(token[k]));
        auto it = char_byte.find(token.substr(k, len));
        if (it != char_byte.end()) raw += static_cast<char>(it->second);
        else raw += token.substr(k, len);
        k += len;
      }
      id_bytes_[i] = raw;
    }
    int rank = 0;
    for (const auto& m : model.at("merges")) {
      std::string a, b;
      if (m.is_string()) {  // older files: "a b"
        const std::string s = m.get<std::string>();
        size_t sp = s.find(' ', 1);
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      merge_rank_.emplace(a + '\x01' + b, rank++);
    }
    for (const auto& t : j.value("added_tokens", nlohmann::json::array())) {
      std::string content = t.at("content").get<std::string>();
      int64_t id = t.at("id").get<int64_t>();
      added_.emplace_back(content, id);
      if (static_cast<size_t>(id) >= id_bytes_.size()) id_bytes_.resize(id + 1);
      id_bytes_[id] = content;
    }
    std::sort(added_.begin(), added_.end(),
              [](const auto& x, const auto& y) { return x.first.size() > y.first.size(); });

    // Pre-tokenizer: ByteLevel(use_regex) | Sequence[(Digits)?, (Split(Isolated))?, ByteLevel]
    const auto& pre = j.at("pre_tokenizer");
    std::vector<nlohmann::json> steps;
    if (pre.is_null()) throw std::runtime_error("no pre_tokenizer; only byte-level BPE files are supported");
    if (pre.at("type") == "Sequence") {
      for (const auto& s : pre.at("pretokenizers")) steps.push_back(s);
    } else {
      steps.push_back(pre);
    }
    std::string pattern;
    bool byte_level = false;
    for (const auto& s : steps) {
      const std::string type = s.at("type").get<std::string>();
      if (type == "ByteLevel") {
        byte_level = true;
        if (s.value("add_prefix_space", false))
          throw std::runtime_error("ByteLevel add_prefix_space=true is not supported");
        if (s.value("use_regex", true) && pattern.empty()) pattern = kByteLevelPattern;
      } else if (type == "Split") {
        if (s.value("behavior", "") != "Isolated" || s.value("invert", false))
          throw std::runtime_error("only Split with behavior Isolated is supported");
        pattern = s.at("pattern").contains("Regex") ? s.at("pattern").at("Regex").get<std::string>()
                                                    : s.at("pattern").at("String").get<std::string>();
      } else if (type == "Digits" && s.value("individual_digits", false)) {
        split_digits_ = true;
      } else {
        throw std::runtime_error("unsupported pre_tokenizer " + type);
      }
    }
    if (!byte_level) throw std::runtime_error("only byte-level BPE tokenizers are supported");
    const auto& normalizer = j.at("normalizer");
    if (!normalizer.is_null()) {
      std::string type = normalizer.value("type", "");
      if (type != "NFC") throw std::runtime_error("unsupported normalizer " + type + " (only NFC is)");
      nfc_ = true;  // Qwen2's: the identity on ASCII, which is all encode accepts then
    }
    if (!pattern.empty()) split_ = new Regex(pattern);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + " is not a tokenizer.json (" + std::string(e.what()) + ")");
  }
}

Tokenizer::~Tokenizer() { delete split_; }

const std::string& Tokenizer::token_bytes(int64_t id) const {
  static const std::string empty;
  return (id >= 0 && static_cast<size_t>(id) < id_bytes_.size()) ? id_bytes_[id] : empty;
}

int64_t Tokenizer::added_token_id(const std::string& content) const {
  for (const auto& [c, id] : added_)
    if (c == content) return id;
  return -1;
}

void Tokenizer::bpe(const std::string& piece, std::vector<int64_t>& out) const {
  auto cached = cache_.find(piece);
  if (cached != cache_.end()) {
    out.insert(out.end(), cached->second.begin(), cached->second.end());
    return;
  }
  std::vector<std::string> symbols;
  for (unsigned char c : piece) symbols.push_back(byte_char_[c]);
  while (symbols.size() > 1) {
    int best = INT_MAX;
    size_t at = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = merge_rank_.find(symbols[i] + '\x01' + symbols[i + 1]);
      if (it != merge_rank_.end() && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == INT_MAX) break;
    const std::string left = symbols[at], right = symbols[at + 1];
    std::vector<std::string> merged;  // merge every occurrence of the best pair, left to right
    for (size_t i = 0; i < symbols.size();) {
      if (i + 1 < symbols.size() && symbols[i] == left && symbols[i + 1] == right) {
        merged.push_back(left + right);
        i += 2;
      } else {
        merged.push_back(symbols[i++]);
      }
    }
    symbols.swap(merged);
  }
  std::vector<int64_t> ids;
  for (const auto& s : symbols) {
    auto it = vocab_.find(s);
    if (it == vocab_.end()) throw std::runtime_error("token '" + s + "' is not in the vocabulary");
    ids.push_back(it->second);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  if (cache_.size() < 100000) cache_.emplace(piece, std::move(ids));
}

void Tokenizer::encode_ordinary(const std::string& text, std::vector<int64_t>& out) const {
  std::vector<std::string> chunks;
  if (split_digits_) {  // each digit is its own piece
    size_t last = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      if (text[i] >= '0' && text[i] <= '9') {
        if (i > last) chunks.push_back(text.substr(last, i - last));
        chunks.push_back(text.substr(i, 1));
        last = i + 1;
      }
    }
    if (last < text.size()) chunks.push_back(text.substr(last));
  } else {
    chunks.push_back(text);
  }
  for (const auto& chunk : chunks) {
    if (!split_) {
      bpe(chunk, out);
      continue;
    }
    for (const auto& piece : split_->split(chunk)) bpe(piece, out);
  }
}

std::vector<int64_t> Tokenizer::encode(const std::string& text) const {
  // Unicode NFC needs composition tables we do not carry; on ASCII it changes nothing.
  if (nfc_ && std::any_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x80; }))
    throw std::runtime_error("this tokenizer normalizes text to Unicode NFC, which the C++ runner does only for "
                             "ASCII text; pass ASCII, or use `spinquant-et generate` (Python)");
  std::vector<int64_t> out;
  size_t last = 0;
  for (size_t i = 0; i < text.size();) {
    bool matched = false;
    for (const auto& [content, id] : added_) {
      if (!content.empty() && text.compare(i, content.size(), content) == 0) {
        if (i > last) encode_ordinary(text.substr(last, i - last), out);
        out.push_back(id);
        i += content.size();
        last = i;
        matched = true;
        break;
      }
    }
    if (!matched) ++i;
  }
  if (last < text.size()) encode_ordinary(text.substr(last), out);
  return out;
}

// Valid UTF-8 only, as Python's bytes.decode(errors="replace") gives it: a byte that cannot start or
// continue a character becomes U+FFFD; a sequence cut off by the end of the bytes so far waits for
// the next token (push) or becomes U+FFFD (flush).
std::string Utf8Streamer::push(const std::string& bytes) {
  static const std::string kReplacement = "\xEF\xBF\xBD";
  pending_ += bytes;
  std::string ready;
  size_t i = 0;
  while (i < pending_.size()) {
    unsigned char c = static_cast<unsigned char>(pending_[i]);
    if (c < 0x80) {
      ready += pending_[i++];
      continue;
    }
    size_t len = utf8_len(c);
    if (len == 1 || c >= 0xF8) {  // a stray continuation byte, or no UTF-8 lead byte at all
      ready += kReplacement;
      ++i;
      continue;
    }
    size_t have = 1;
    while (have < len && i + have < pending_.size() && (static_cast<unsigned char>(pending_[i + have]) & 0xC0) == 0x80)
      ++have;
    if (have == len) {
      ready.append(pending_, i, len);
      i += len;
    } else if (i + have == pending_.size()) {
      break;  // incomplete so far: keep it for the next push
    } else {
      ready += kReplacement;  // a lead byte whose sequence is broken by a non-continuation byte
      i += have;
    }
  }
  pending_.erase(0, i);
  return ready;
}

std::string Utf8Streamer::flush() {
  std::string rest = pending_.empty() ? "" : "\xEF\xBF\xBD";
  pending_.clear();
  return rest;
}

}  // namespace spinquant
