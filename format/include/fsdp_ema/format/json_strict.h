// Internal: a strict pull parser for the format's JSON (safetensors headers, our metadata
// strings, the index), and JSON string quoting. Only .cpp files include this header.
//
// Why a pull parser and not a DOM: headers and indexes of real training states hold 100,000+
// tensors. The reader walks the text once, the caller copies out only what it keeps, and nothing
// is allocated per value (a DOM of std::map nodes cost several seconds at 200k tensors). It is
// strict where JSON libraries are lenient: a key repeated in one object is refused (a second "w"
// entry could hide the first), nesting is bounded, strings must be valid UTF-8 and nothing may
// follow the value.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/name_index.h"
#include "fsdp_ema/format/shape.h"

namespace fsdp_ema::format::detail {

class JsonReader {
 public:
  enum class Kind { kObject, kArray, kString, kNumber, kBool, kNull };

  // `what` prefixes every error ("<file>: header"); the reader keeps a reference to `text`.
  JsonReader(std::string_view text, std::string what, int max_depth = 16);

  // The kind of the next value (skipping white space). Throws on anything that starts no value.
  Kind peek();
  // "object", "array", "string", "number", "boolean", "null".
  static const char* kind_name(Kind kind);

  // Objects: begin_object() consumes '{'; each next_key() reads the next key and its ':' (and
  // refuses a key already seen in this object) or consumes '}' and returns false. The caller
  // then reads or skips the value.
  // A caller that maps every key of an object anyway (tensor names to positions) passes
  // caller_checks_keys and reports a repeat itself with duplicate_key(), saving a second index.
  void begin_object(bool caller_checks_keys = false);
  bool next_key(std::string& key);
  [[noreturn]] void duplicate_key(std::string_view key) const;
  // Arrays: begin_array() consumes '['; next_element() is true while another element follows.
  void begin_array();
  bool next_element();

  std::string read_string();
  // Consumes a number; its value when it is an integer in [0, INT64_MAX], else nullopt.
  std::optional<int64_t> read_nonneg_int();
  // An array of integers in [0, INT64_MAX] (consumed in any case); nullopt for anything else.
  std::optional<Shape> read_shape();
  // Consumes one value of any kind (checked as strictly as the rest) and returns its text.
  std::string_view skip_value();
  // Only white space may remain.
  void expect_end();

  // Throws FormatError("<what>: <message>").
  [[noreturn]] void fail(const std::string& message) const;

 private:
  [[noreturn]] void syntax_error(const std::string& expected) const;
  void skip_ws();
  void enter();
  void read_string_into(std::string& out);
  // After "\u": the code point of the escape (a surrogate pair joined), its UTF-8 onto `out`.
  void read_unicode_escape(std::string& out);
  uint32_t read_hex4();
  void scan_number();
  bool key_seen_before(std::string_view key);

  std::string_view text_;
  size_t pos_ = 0;
  std::string what_;
  int max_depth_;
  // Keys of the open objects, as views (no copy per key): of the text itself when a key has no
  // escape (decoding only ever shortens, so equal lengths mean equal bytes), else of its decoded
  // form kept in escaped_keys_. Small objects check a shared pool linearly; an object past
  // kSmallObject keys moves to a hash set of its own.
  struct OpenObject {
    size_t pool_begin;
    bool caller_checks_keys;
    std::unique_ptr<NameIndex> big;
  };
  static constexpr size_t kSmallObject = 8;
  std::vector<OpenObject> objects_;
  std::vector<std::string_view> key_pool_;
  std::deque<std::string> escaped_keys_;
  int depth_ = 0;
  std::vector<bool> first_;  // per open container: no member read yet
};

// Throws the first syntax error of `text` (invalid JSON, a repeated key, nesting past max_depth).
void check_syntax(std::string_view text, const std::string& what, int max_depth = 16);

// Runs `interpret` (which reads `text` with a JsonReader); if it throws, a syntax error anywhere
// in `text` is reported instead: what a document means is only discussed once it is valid JSON,
// as when the whole text was parsed before being interpreted.
template <typename F>
auto interpret_json(std::string_view text, const std::string& what, F&& interpret)
    -> decltype(interpret()) {
  try {
    return interpret();
  } catch (const std::exception&) {
    check_syntax(text, what);
    throw;
  }
}

// `s` as a quoted JSON string literal: quotes, backslashes and control characters escaped, and
// bytes that are not valid UTF-8 replaced (so that building a message never throws).
std::string json_quote(std::string_view s);
void append_json_quoted(std::string& out, std::string_view s);

// Whether `s` is valid UTF-8 (JSON strings must be).
bool is_valid_utf8(std::string_view s);

}  // namespace fsdp_ema::format::detail
