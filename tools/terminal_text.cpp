#include "tools/terminal_text.h"

#include <cstdint>
#include <cstdio>

namespace fsdp_ema::tools {
namespace {

// Length of the valid UTF-8 sequence at s[i] (1..4) and its code point; 0 if invalid.
size_t utf8_sequence(std::string_view s, size_t i, uint32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  size_t n = 0;
  uint32_t v = 0;
  if (c < 0x80) {
    *cp = c;
    return 1;
  } else if ((c & 0xE0) == 0xC0) {
    n = 2, v = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3, v = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4, v = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(k) & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[n] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;  // overlong etc.
  *cp = v;
  return n;
}

bool must_escape(uint32_t cp) {
  return cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0x9F) || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  char buf[16];
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    const size_t n = utf8_sequence(text, i, &cp);
    if (n == 0) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned char>(text[i]));
      out += buf;
      ++i;
      continue;
    }
    if (cp == '\\') {
      out += "\\\\";
    } else if (!must_escape(cp)) {
      out.append(text.substr(i, n));
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == 0x1B) {
      out += "\\e";
    } else if (cp < 0x80) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(cp));
      out += buf;
    } else {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(cp));
      out += buf;
    }
    i += n;
  }
  return out;
}

}  // namespace fsdp_ema::tools
