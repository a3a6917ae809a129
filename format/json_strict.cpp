#include "format/json_strict.h"

#include <limits>
#include <set>
#include <vector>

#include "format/error.h"

namespace fsdp_ema::format::detail {

Json parse_json_strict(std::string_view text, const std::string& what, int max_depth) {
  // One key set per open container (arrays get an unused one, which keeps push/pop symmetric).
  std::vector<std::set<std::string>> keys;
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) -> bool {
    if (depth > max_depth) {
      throw FormatError(what + ": JSON nested deeper than " + std::to_string(max_depth) +
                        " levels");
    }
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        keys.emplace_back();
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case Json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!keys.empty() && !keys.back().insert(key).second) {
          throw FormatError(what + ": duplicate key " + json_quote(key) + " in one JSON object");
        }
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const Json::exception& e) {
    // The parser's message quotes the offending input ("last read: '...'"), which may be any
    // bytes: escape them so that the message is valid UTF-8 (Python turns a C++ error whose
    // message is not UTF-8 into a UnicodeDecodeError instead of a RuntimeError).
    std::string msg;
    for (const char ch : std::string_view(e.what())) {
      const auto c = static_cast<unsigned char>(ch);
      if (c >= 0x20 && c < 0x7F) {
        msg += ch;
      } else {
        static constexpr char kHex[] = "0123456789abcdef";
        msg += "\\x";
        msg += kHex[c >> 4];
        msg += kHex[c & 0xF];
      }
    }
    throw FormatError(what + ": invalid JSON: " + msg);
  }
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
