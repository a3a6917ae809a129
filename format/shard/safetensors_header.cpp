#include "fsdp_ema/format/safetensors_header.h"

#include <algorithm>
#include <charconv>
#include <cstring>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/json_strict.h"

namespace fsdp_ema::format {
namespace {

using detail::JsonReader;

std::string entry_context(const std::string& file, const std::string& name) {
  return file + ": tensor " + detail::json_quote(name);
}

// One tensor entry, the reader at its value. Each field is read as it comes (any order, unknown
// keys skipped); problems are reported afterwards in a fixed order: dtype, shape, data_offsets.
HeaderTensor parse_entry(const std::string& file, const std::string& name, JsonReader& r,
                         uint64_t data_bytes) {
  // Error contexts are built only on error: a header holds 100,000+ entries.
  auto ctx = [&] { return entry_context(file, name); };
  if (name.empty()) throw FormatError(file + ": a tensor has an empty name");
  if (const auto kind = r.peek(); kind != JsonReader::Kind::kObject) {
    throw FormatError(ctx() + ": entry is a JSON " + JsonReader::kind_name(kind) +
                      ", expected an object with dtype, shape and data_offsets");
  }
  HeaderTensor t;
  t.name = name;
  std::optional<std::string> dtype_text;
  std::optional<Shape> shape, offsets;
  bool has_shape = false, has_offsets = false;
  r.begin_object();
  std::string key;
  while (r.next_key(key)) {
    if (key == "dtype") {
      if (r.peek() == JsonReader::Kind::kString) {
        dtype_text = r.read_string();
      } else {
        r.skip_value();
      }
    } else if (key == "shape") {
      has_shape = true;
      shape = r.read_shape();
    } else if (key == "data_offsets") {
      has_offsets = true;
      offsets = r.read_shape();
    } else {
      r.skip_value();
    }
  }
  if (!dtype_text) throw FormatError(ctx() + ": missing or non-string \"dtype\"");
  auto dtype = parse_dtype(*dtype_text);
  if (!dtype) {
    throw FormatError(ctx() + ": unknown dtype " + detail::json_quote(*dtype_text) +
                      " (known: " + dtype_names() + ")");
  }
  t.dtype = *dtype;
  if (!has_shape) throw FormatError(ctx() + ": missing \"shape\"");
  if (!shape) {
    throw FormatError(ctx() + ": \"shape\" must be an array of non-negative integers");
  }
  t.shape = std::move(*shape);
  if (!has_offsets) throw FormatError(ctx() + ": missing \"data_offsets\"");
  if (!offsets || offsets->size() != 2) {
    throw FormatError(ctx() + ": \"data_offsets\" must be [begin, end] with non-negative integers");
  }
  t.begin = static_cast<uint64_t>((*offsets)[0]);
  t.end = static_cast<uint64_t>((*offsets)[1]);
  auto range = [&] {
    return "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "]";
  };
  if (t.end < t.begin) throw FormatError(ctx() + ": " + range() + " end before begin");
  if (t.end > data_bytes) {
    throw FormatError(ctx() + ": " + range() + " past the end of the data section (" +
                      std::to_string(data_bytes) + " bytes): file truncated?");
  }
  auto need = nbytes(t.shape, t.dtype);
  if (!need) {
    throw FormatError(ctx() + ": shape " + shape_to_string(t.shape) + " of " +
                      std::string(dtype_name(t.dtype)) + " overflows a 64-bit byte count");
  }
  if (*need != t.end - t.begin) {
    throw FormatError(ctx() + ": " + range() + " hold " + std::to_string(t.end - t.begin) +
                      " bytes but shape " + shape_to_string(t.shape) + " of " +
                      std::string(dtype_name(t.dtype)) + " needs " + std::to_string(*need));
  }
  return t;
}

}  // namespace

uint64_t parse_header_length(std::span<const std::byte> first8, uint64_t file_bytes,
                             const std::string& file) {
  if (first8.size() < 8 || file_bytes < 8) {
    throw FormatError(file + ": file is " + std::to_string(file_bytes) +
                      " bytes, shorter than the 8-byte header length: truncated or not a "
                      "safetensors file");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint64_t>(first8[static_cast<size_t>(i)]);
  if (n > kMaxHeaderBytes) {
    throw FormatError(file + ": header length " + std::to_string(n) + " exceeds the " +
                      std::to_string(kMaxHeaderBytes) +
                      "-byte limit: corrupt or not a safetensors file");
  }
  if (n > file_bytes - 8) {
    throw FormatError(file + ": header length " + std::to_string(n) +
                      " runs past the end of the file (" + std::to_string(file_bytes) +
                      " bytes): truncated or not a safetensors file");
  }
  if (n < 2) {
    throw FormatError(file + ": header length " + std::to_string(n) +
                      " is too small for a JSON object");
  }
  return n;
}

SafetensorsHeader parse_safetensors_header(std::string_view header_json, uint64_t file_bytes,
                                           const std::string& file) {
  SafetensorsHeader h;
  h.header_bytes = header_json.size();
  h.data_start = 8 + h.header_bytes;
  h.file_bytes = file_bytes;
  if (file_bytes < h.data_start) {
    throw FormatError(file + ": header runs past the end of the file: truncated");
  }
  const uint64_t data_bytes = file_bytes - h.data_start;

  // As the safetensors package: the JSON starts at the first byte (no UTF-8 byte order mark or
  // padding before it; JSON libraries commonly skip a BOM) and only spaces pad it (no NUL bytes).
  if (header_json.empty() || header_json.front() != '{') {
    const bool bom = header_json.starts_with("\xEF\xBB\xBF");
    throw FormatError(file + ": header does not start with '{'" +
                      (bom ? std::string(" (it starts with a UTF-8 byte order mark)") : "") +
                      ": not a safetensors header");
  }
  if (const auto nul = header_json.find('\0'); nul != std::string_view::npos) {
    throw FormatError(file + ": header holds a NUL byte at offset " + std::to_string(8 + nul) +
                      " (only spaces may pad a safetensors header)");
  }
  const std::string what = file + ": header";
  detail::interpret_json(header_json, what, [&] {
    JsonReader r(header_json, what);
    r.begin_object();
    h.tensors.reserve(header_json.size() / 64);
    std::string key;
    while (r.next_key(key)) {
      if (key == "__metadata__") {
        if (const auto kind = r.peek(); kind != JsonReader::Kind::kObject) {
          throw FormatError(file + ": \"__metadata__\" is a JSON " + JsonReader::kind_name(kind) +
                            ", expected an object of strings");
        }
        h.has_metadata = true;
        r.begin_object();
        std::string mkey;
        while (r.next_key(mkey)) {
          if (const auto kind = r.peek(); kind != JsonReader::Kind::kString) {
            throw FormatError(file + ": \"__metadata__\" entry " + detail::json_quote(mkey) +
                              " is a JSON " + JsonReader::kind_name(kind) +
                              ", but metadata values must be strings");
          }
          h.metadata.emplace(mkey, r.read_string());
        }
        continue;
      }
      h.tensors.push_back(parse_entry(file, key, r, data_bytes));
    }
    r.expect_end();
  });

  std::sort(h.tensors.begin(), h.tensors.end(), [](const HeaderTensor& a, const HeaderTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  const HeaderTensor* prev = nullptr;
  for (const HeaderTensor& t : h.tensors) {
    if (t.begin < expected) {
      throw FormatError(entry_context(file, t.name) + ": data_offsets [" + std::to_string(t.begin) +
                        ", " + std::to_string(t.end) + "] overlap tensor " +
                        detail::json_quote(prev->name) + " ending at " + std::to_string(expected));
    }
    if (t.begin > expected) {
      throw FormatError(entry_context(file, t.name) + ": data_offsets [" + std::to_string(t.begin) +
                        ", " + std::to_string(t.end) + "] leave a gap of " +
                        std::to_string(t.begin - expected) + " bytes after offset " +
                        std::to_string(expected) + " (tensors must be contiguous)");
    }
    expected = t.end;
    prev = &t;
  }
  if (expected != data_bytes) {
    throw FormatError(file + ": " + std::to_string(data_bytes - expected) +
                      " trailing bytes after the last tensor (data section is " +
                      std::to_string(data_bytes) + " bytes, tensors end at " +
                      std::to_string(expected) + ")");
  }
  return h;
}

std::string serialize_safetensors_header(
    std::span<const HeaderEntry> tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata, bool include_metadata,
    uint64_t alignment, std::vector<size_t>* value_offsets) {
  // Built in place after the 8 length bytes, with a size estimate reserved up front: headers of
  // 100,000+ tensors are tens of MB, and every temporary or regrowth copies all of it.
  size_t estimate = 16;
  for (const auto& [k, v] : metadata) estimate += k.size() + v.size() + v.size() / 4 + 8;
  for (const HeaderEntry& t : tensors) estimate += t.name.size() + 64 + 21 * t.shape.size();
  std::string out(8, '\0');
  out.reserve(8 + estimate + alignment);
  out += '{';
  bool first = true;
  auto append_number = [&out](uint64_t v) {
    char buf[24];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
    out.append(buf, end);
  };
  if (include_metadata) {
    out += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i > 0) out += ',';
      detail::append_json_quoted(out, metadata[i].first);
      out += ':';
      if (value_offsets != nullptr) value_offsets->push_back(out.size() + 1);
      detail::append_json_quoted(out, metadata[i].second);
    }
    out += '}';
    first = false;
  }
  for (const HeaderEntry& t : tensors) {
    if (!first) out += ',';
    first = false;
    detail::append_json_quoted(out, t.name);
    out += ":{\"dtype\":\"";
    out += dtype_name(t.dtype);
    out += "\",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d > 0) out += ',';
      append_number(static_cast<uint64_t>(t.shape[d]));
    }
    out += "],\"data_offsets\":[";
    append_number(t.begin);
    out += ',';
    append_number(t.end);
    out += "]}";
  }
  out += '}';
  if (alignment == 0) alignment = 1;
  const uint64_t padded = (out.size() + alignment - 1) / alignment * alignment;
  out.append(padded - out.size(), ' ');
  uint64_t n = out.size() - 8;
  for (size_t i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(n & 0xff);
    n >>= 8;
  }
  return out;
}

}  // namespace fsdp_ema::format
