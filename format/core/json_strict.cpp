#include "fsdp_ema/format/json_strict.h"

#include <charconv>
#include <cstring>
#include <limits>
#include <memory>

#include "fsdp_ema/format/error.h"

namespace fsdp_ema::format::detail {
namespace {

constexpr char kHex[] = "0123456789abcdef";

// Up to 24 bytes of `text` from `pos`, printable ASCII only (messages must be valid UTF-8:
// Python turns a C++ error whose message is not into a UnicodeDecodeError).
std::string excerpt(std::string_view text, size_t pos) {
  if (pos >= text.size()) return "end of input";
  std::string out = "'";
  for (size_t i = pos; i < text.size() && i < pos + 24; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7F && c != '\'') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    }
  }
  return out + "'";
}

// Length of the valid UTF-8 sequence at s[i], 0 if there is none.
size_t utf8_length_at(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  size_t len = 0;
  uint32_t cp = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (s.size() - i < len) return 0;
  for (size_t k = 1; k < len; ++k) {
    const auto cc = static_cast<unsigned char>(s[i + k]);
    if ((cc & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (cc & 0x3F);
  }
  // Overlong forms, surrogates and code points past U+10FFFF.
  if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
      (cp >= 0xD800 && cp <= 0xDFFF)) {
    return 0;
  }
  return len;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace

JsonReader::JsonReader(std::string_view text, std::string what, int max_depth)
    : text_(text), what_(std::move(what)), max_depth_(max_depth) {}

const char* JsonReader::kind_name(Kind kind) {
  switch (kind) {
    case Kind::kObject:
      return "object";
    case Kind::kArray:
      return "array";
    case Kind::kString:
      return "string";
    case Kind::kNumber:
      return "number";
    case Kind::kBool:
      return "boolean";
    case Kind::kNull:
      return "null";
  }
  return "value";
}

void JsonReader::fail(const std::string& message) const {
  throw FormatError(what_ + ": " + message);
}

void JsonReader::syntax_error(const std::string& expected) const {
  fail("invalid JSON: expected " + expected + " at byte " + std::to_string(pos_) + ", found " +
       excerpt(text_, pos_));
}

void JsonReader::skip_ws() {
  while (pos_ < text_.size()) {
    const char c = text_[pos_];
    if (c != ' ' && c != '\n' && c != '\r' && c != '\t') return;
    ++pos_;
  }
}

JsonReader::Kind JsonReader::peek() {
  skip_ws();
  if (pos_ >= text_.size()) syntax_error("a value");
  switch (text_[pos_]) {
    case '{':
      return Kind::kObject;
    case '[':
      return Kind::kArray;
    case '"':
      return Kind::kString;
    case 't':
    case 'f':
      return Kind::kBool;
    case 'n':
      return Kind::kNull;
    default:
      if (text_[pos_] == '-' || (text_[pos_] >= '0' && text_[pos_] <= '9')) return Kind::kNumber;
      syntax_error("a value");
  }
}

void JsonReader::enter() {
  if (++depth_ > max_depth_) {
    fail("JSON nested deeper than " + std::to_string(max_depth_) + " levels");
  }
}

void JsonReader::begin_object(bool caller_checks_keys) {
  skip_ws();
  if (pos_ >= text_.size() || text_[pos_] != '{') syntax_error("'{'");
  ++pos_;
  enter();
  objects_.push_back({key_pool_.size(), caller_checks_keys, nullptr});
  first_.push_back(true);
}

bool JsonReader::key_seen_before(std::string_view key) {
  OpenObject& o = objects_.back();
  if (o.caller_checks_keys) return false;
  if (o.big) return o.big->insert(key, 0).has_value();
  for (size_t i = o.pool_begin; i < key_pool_.size(); ++i) {
    if (key_pool_[i] == key) return true;
  }
  key_pool_.push_back(key);
  if (key_pool_.size() - o.pool_begin > kSmallObject) {
    o.big = std::make_unique<NameIndex>();
    for (size_t i = o.pool_begin; i < key_pool_.size(); ++i) o.big->insert(key_pool_[i], 0);
    key_pool_.resize(o.pool_begin);
  }
  return false;
}

bool JsonReader::next_key(std::string& key) {
  skip_ws();
  if (pos_ < text_.size() && text_[pos_] == '}') {
    ++pos_;
    key_pool_.resize(objects_.back().pool_begin);
    objects_.pop_back();
    first_.pop_back();
    --depth_;
    return false;
  }
  if (!first_.back()) {
    if (pos_ >= text_.size() || text_[pos_] != ',') syntax_error("',' or '}'");
    ++pos_;
    skip_ws();
  }
  if (pos_ >= text_.size() || text_[pos_] != '"') syntax_error("a string key");
  const size_t start = pos_;
  read_string_into(key);
  std::string_view stable = text_.substr(start + 1, pos_ - start - 2);
  if (stable.size() != key.size()) stable = escaped_keys_.emplace_back(key);
  skip_ws();
  if (pos_ >= text_.size() || text_[pos_] != ':') syntax_error("':'");
  ++pos_;
  first_.back() = false;
  if (key_seen_before(stable)) duplicate_key(key);
  return true;
}

void JsonReader::duplicate_key(std::string_view key) const {
  fail("duplicate key " + json_quote(key) + " in one JSON object");
}

void JsonReader::begin_array() {
  skip_ws();
  if (pos_ >= text_.size() || text_[pos_] != '[') syntax_error("'['");
  ++pos_;
  enter();
  first_.push_back(true);
}

bool JsonReader::next_element() {
  skip_ws();
  if (pos_ < text_.size() && text_[pos_] == ']') {
    ++pos_;
    first_.pop_back();
    --depth_;
    return false;
  }
  if (!first_.back()) {
    if (pos_ >= text_.size() || text_[pos_] != ',') syntax_error("',' or ']'");
    ++pos_;
  }
  first_.back() = false;
  return true;
}

uint32_t JsonReader::read_hex4() {
  if (text_.size() - pos_ < 4) syntax_error("4 hex digits after \\u");
  uint32_t v = 0;
  for (int k = 0; k < 4; ++k) {
    const char h = text_[pos_ + static_cast<size_t>(k)];
    v <<= 4;
    if (h >= '0' && h <= '9') {
      v |= static_cast<uint32_t>(h - '0');
    } else if (h >= 'a' && h <= 'f') {
      v |= static_cast<uint32_t>(h - 'a' + 10);
    } else if (h >= 'A' && h <= 'F') {
      v |= static_cast<uint32_t>(h - 'A' + 10);
    } else {
      syntax_error("4 hex digits after \\u");
    }
  }
  pos_ += 4;
  return v;
}

void JsonReader::read_unicode_escape(std::string& out) {
  const size_t n = text_.size();
  uint32_t cp = read_hex4();
  if (cp >= 0xDC00 && cp <= 0xDFFF) syntax_error("a high surrogate before a low one");
  if (cp >= 0xD800 && cp <= 0xDBFF) {
    if (n - pos_ < 2 || text_[pos_] != '\\' || text_[pos_ + 1] != 'u') {
      syntax_error("a low surrogate after a high one");
    }
    pos_ += 2;
    const uint32_t lo = read_hex4();
    if (lo < 0xDC00 || lo > 0xDFFF) syntax_error("a low surrogate after a high one");
    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
  }
  append_utf8(out, cp);
}

void JsonReader::read_string_into(std::string& out) {
  // At the opening quote.
  ++pos_;
  out.clear();
  const size_t n = text_.size();
  while (true) {
    size_t j = pos_;
    while (j < n) {
      const auto c = static_cast<unsigned char>(text_[j]);
      if (c == '"' || c == '\\' || c < 0x20) break;
      ++j;
    }
    // Segments end at ASCII bytes, so a valid multi-byte sequence never spans two of them.
    const std::string_view segment = text_.substr(pos_, j - pos_);
    if (!is_valid_utf8(segment)) {
      size_t bad = 0;
      while (utf8_length_at(segment, bad) != 0) bad += utf8_length_at(segment, bad);
      pos_ += bad;
      syntax_error("valid UTF-8 in a string");
    }
    out.append(segment);
    pos_ = j;
    if (j >= n) syntax_error("'\"' to end the string");
    const char c = text_[j];
    if (c == '"') {
      ++pos_;
      return;
    }
    if (c != '\\') syntax_error("an escaped control character in a string");
    if (j + 1 >= n) syntax_error("an escape sequence");
    const char e = text_[j + 1];
    pos_ = j + 2;
    switch (e) {
      case '"':
      case '\\':
      case '/':
        out += e;
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'u':
        read_unicode_escape(out);
        break;
      default:
        pos_ = j;
        syntax_error("a valid escape sequence");
    }
  }
}

std::string JsonReader::read_string() {
  skip_ws();
  if (pos_ >= text_.size() || text_[pos_] != '"') syntax_error("a string");
  std::string out;
  read_string_into(out);
  return out;
}

void JsonReader::scan_number() {
  const size_t n = text_.size();
  auto digits = [&] {
    const size_t start = pos_;
    while (pos_ < n && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
    return pos_ > start;
  };
  if (pos_ < n && text_[pos_] == '-') ++pos_;
  if (pos_ < n && text_[pos_] == '0') {
    ++pos_;
  } else if (!digits()) {
    syntax_error("a digit");
  }
  if (pos_ < n && text_[pos_] == '.') {
    ++pos_;
    if (!digits()) syntax_error("a digit after '.'");
  }
  if (pos_ < n && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
    ++pos_;
    if (pos_ < n && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
    if (!digits()) syntax_error("a digit in the exponent");
  }
}

std::optional<int64_t> JsonReader::read_nonneg_int() {
  if (peek() != Kind::kNumber) syntax_error("a number");
  const size_t start = pos_;
  scan_number();
  const std::string_view token = text_.substr(start, pos_ - start);
  if (token.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(token.data(), token.data() + token.size(), v);
  if (ec != std::errc() || ptr != token.data() + token.size()) return std::nullopt;
  return v;
}

std::optional<Shape> JsonReader::read_shape() {
  if (peek() != Kind::kArray) {
    skip_value();
    return std::nullopt;
  }
  begin_array();
  Shape out;
  bool ok = true;
  while (next_element()) {
    if (peek() == Kind::kNumber) {
      const auto v = read_nonneg_int();
      if (v) {
        out.push_back(*v);
      } else {
        ok = false;
      }
    } else {
      skip_value();
      ok = false;
    }
  }
  if (!ok) return std::nullopt;
  return out;
}

std::string_view JsonReader::skip_value() {
  const Kind kind = peek();
  const size_t start = pos_;
  auto literal = [&](std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) syntax_error("a value");
    pos_ += word.size();
  };
  switch (kind) {
    case Kind::kObject: {
      begin_object();
      std::string key;
      while (next_key(key)) skip_value();
      break;
    }
    case Kind::kArray:
      begin_array();
      while (next_element()) skip_value();
      break;
    case Kind::kString: {
      std::string ignored;
      read_string_into(ignored);
      break;
    }
    case Kind::kNumber:
      scan_number();
      break;
    case Kind::kBool:
      literal(text_[pos_] == 't' ? "true" : "false");
      break;
    case Kind::kNull:
      literal("null");
      break;
  }
  return text_.substr(start, pos_ - start);
}

void JsonReader::expect_end() {
  skip_ws();
  if (pos_ != text_.size()) syntax_error("the end of the JSON text");
}

void check_syntax(std::string_view text, const std::string& what, int max_depth) {
  JsonReader r(text, what, max_depth);
  r.skip_value();
  r.expect_end();
}

namespace {

// Bytes that a JSON string holds as they are: printable ASCII other than '"' and '\\'.
bool is_plain_ascii(unsigned char c) { return c >= 0x20 && c < 0x80 && c != '"' && c != '\\'; }

// The length of the run of plain ASCII at the start of s (headers are mostly such runs: appending
// a run at once rather than byte by byte is what makes quoting 100,000 names cheap).
size_t plain_run(std::string_view s, size_t i) {
  const size_t start = i;
  while (i < s.size() && is_plain_ascii(static_cast<unsigned char>(s[i]))) ++i;
  return i - start;
}

}  // namespace

void append_json_quoted(std::string& out, std::string_view s) {
  out += '"';
  size_t i = 0;
  while (i < s.size()) {
    if (const size_t run = plain_run(s, i); run > 0) {
      out.append(s.data() + i, run);
      i += run;
      if (i == s.size()) break;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t len = utf8_length_at(s, i);
      if (len == 0) {
        out += "\xEF\xBF\xBD";  // U+FFFD for a byte that is not UTF-8
        ++i;
      } else {
        out.append(s.substr(i, len));
        i += len;
      }
      continue;
    }
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:  // the other control characters
        out += "\\u00";
        out += kHex[c >> 4];
        out += kHex[c & 0xF];
    }
    ++i;
  }
  out += '"';
}

std::string json_quote(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  append_json_quoted(out, s);
  return out;
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII eight bytes at a time: no byte with its high bit set.
    while (s.size() - i >= 8) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if ((w & 0x8080808080808080ull) != 0) break;
      i += 8;
    }
    if (i >= s.size()) break;
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t len = utf8_length_at(s, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

}  // namespace fsdp_ema::format::detail
