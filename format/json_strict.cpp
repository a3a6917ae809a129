#include "format/json_strict.h"

#include <limits>
#include <vector>

#include "format/error.h"

namespace fsdp_ema::format::detail {

namespace {

// Makes `msg` printable ASCII: a parser message quotes the offending input, which may be any bytes,
// and Python turns a C++ error whose message is not UTF-8 into a UnicodeDecodeError instead of a
// RuntimeError.
std::string escape_bytes(std::string_view msg) {
  std::string out;
  out.reserve(msg.size());
  for (const char ch : msg) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F) {
      out += ch;
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    }
  }
  return out;
}

// Builds the DOM from SAX events with its own stack, so every event costs O(1) plus one map
// lookup: linear in the text (nlohmann's callback parser rescans the parent container after each
// closed value, which made a 200k-entry header quadratic). Duplicate keys are found by looking the
// key up in the object being built, so no separate key set is kept.
class StrictDomBuilder {
 public:
  StrictDomBuilder(const std::string& what, int max_depth) : what_(what), max_depth_(max_depth) {}

  bool null() { return put(Json(nullptr)); }
  bool boolean(bool v) { return put(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return put(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return put(Json(v)); }
  bool number_float(Json::number_float_t v, const Json::string_t&) { return put(Json(v)); }
  bool string(Json::string_t& v) { return put(Json(std::move(v))); }
  bool binary(Json::binary_t& v) { return put(Json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(Json::object()); }
  bool start_array(std::size_t) { return open(Json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(Json::string_t& k) {
    if (stack_.back()->contains(k)) {
      throw FormatError(what_ + ": duplicate key " + json_quote(k) + " in one JSON object");
    }
    key_ = std::move(k);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    throw FormatError(what_ + ": invalid JSON: " + escape_bytes(e.what()));
  }

  Json take() { return std::move(root_); }

 private:
  // Places a value where the parser is: the root, the next array element or the pending key.
  Json* place(Json&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    return &(parent[std::move(key_)] = std::move(v));
  }
  bool put(Json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(Json&& container) {
    // The root container is at depth 0 and a value inside a container at depth d is at d + 1, so
    // a container's contents sit one level below the container itself.
    if (static_cast<int>(stack_.size()) + 1 > max_depth_) {
      throw FormatError(what_ + ": JSON nested deeper than " + std::to_string(max_depth_) +
                        " levels");
    }
    stack_.push_back(place(std::move(container)));
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }

  const std::string& what_;
  const int max_depth_;
  Json root_;
  std::vector<Json*> stack_;  // open containers; pointers stay valid (std::map / vector back())
  std::string key_;
};

}  // namespace

Json parse_json_strict(std::string_view text, const std::string& what, int max_depth) {
  StrictDomBuilder builder(what, max_depth);
  Json::sax_parse(text.begin(), text.end(), &builder, nlohmann::detail::input_format_t::json,
                  /*strict=*/true, /*ignore_comments=*/false);
  return builder.take();
}

std::optional<int64_t> as_nonneg_int(const Json& j) {
  if (j.is_number_unsigned()) {
    const auto v = j.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(v);
  }
  if (j.is_number_integer()) {
    const auto v = j.get<int64_t>();
    if (v < 0) return std::nullopt;
    return v;
  }
  return std::nullopt;
}

std::optional<Shape> as_shape(const Json& j) {
  if (!j.is_array()) return std::nullopt;
  Shape out;
  out.reserve(j.size());
  for (const Json& e : j) {
    auto v = as_nonneg_int(e);
    if (!v) return std::nullopt;
    out.push_back(*v);
  }
  return out;
}

std::string json_type_name(const Json& j) { return j.type_name(); }

std::string json_quote(std::string_view s) {
  // Json's dump escapes quotes, backslashes and control characters; invalid UTF-8 is replaced so
  // that this never throws while building an error message.
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
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
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF.
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

}  // namespace fsdp_ema::format::detail
