// The index's JSON text read back (parse_index_json): a strict parse, the format and version
// checked before any tensor is read, then validate_index.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/json_strict.h"
#include "index_impl.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;
using detail::JsonReader;

// A string field's value, or the raw text of whatever else stands there (for messages).
struct StringOrRaw {
  std::optional<std::string> value;
  std::string raw;
};

StringOrRaw read_string_or_raw(JsonReader& r) {
  StringOrRaw out;
  if (r.peek() == JsonReader::Kind::kString) {
    out.value = r.read_string();
    out.raw = json_quote(*out.value);
  } else {
    out.raw = std::string(r.skip_value());
  }
  return out;
}

// `ctx` names the tensor in messages; `checked_file` is the last file name that passed
// check_piece_file_name (pieces name a handful of files, one per rank).
template <typename Ctx>
IndexPiece parse_piece(JsonReader& r, const Ctx& ctx, std::string& checked_file) {
  if (r.peek() != JsonReader::Kind::kObject)
    throw FormatError(ctx() + ": every piece must be an object");
  std::optional<StringOrRaw> file, checksum;
  std::optional<std::optional<Shape>> offsets, shape;
  r.begin_object();
  std::string key;
  while (r.next_key(key)) {
    if (key == "file") {
      file = read_string_or_raw(r);
    } else if (key == "offsets") {
      offsets = r.read_shape();
    } else if (key == "shape") {
      shape = r.read_shape();
    } else if (key == "checksum") {
      checksum = read_string_or_raw(r);
    } else {
      r.skip_value();
    }
  }
  if (!file) throw FormatError(ctx() + ": piece: missing \"file\"");
  if (!file->value) throw FormatError(ctx() + ": piece \"file\" must be a string");
  IndexPiece p;
  p.file = std::move(*file->value);
  if (p.file != checked_file) {
    check_piece_file_name(p.file, ctx());
    checked_file = p.file;
  }
  auto pctx = [&] { return ctx() + ": piece in " + p.file; };
  if (!offsets) throw FormatError(pctx() + ": missing \"offsets\"");
  if (!shape) throw FormatError(pctx() + ": missing \"shape\"");
  if (!*offsets || !*shape) {
    throw FormatError(pctx() +
                      ": \"offsets\" and \"shape\" must be arrays of non-negative integers");
  }
  p.offsets = std::move(**offsets);
  p.shape = std::move(**shape);
  if (!checksum) throw FormatError(pctx() + ": missing \"checksum\"");
  if (checksum->value) p.checksum = parse_checksum(*checksum->value);
  if (!p.checksum) {
    throw FormatError(pctx() + ": checksum " + checksum->raw + " is not " + checksum_form_text());
  }
  return p;
}

IndexTensor parse_tensor(JsonReader& r, const std::string& where, std::string name,
                         std::string& checked_file) {
  auto ctx = [&] { return tensor_ctx(where, name); };
  if (r.peek() != JsonReader::Kind::kObject) throw FormatError(ctx() + ": entry must be an object");
  IndexTensor t;
  std::optional<StringOrRaw> dtype;
  std::optional<std::optional<Shape>> shape;
  bool has_pieces = false;
  r.begin_object();
  std::string key;
  while (r.next_key(key)) {
    if (key == "dtype") {
      dtype = read_string_or_raw(r);
    } else if (key == "shape") {
      shape = r.read_shape();
    } else if (key == "pieces") {
      has_pieces = true;
      if (r.peek() != JsonReader::Kind::kArray)
        throw FormatError(ctx() + ": \"pieces\" must be an array");
      r.begin_array();
      while (r.next_element()) t.pieces.push_back(parse_piece(r, ctx, checked_file));
    } else {
      r.skip_value();
    }
  }
  if (!dtype) throw FormatError(ctx() + ": missing \"dtype\"");
  std::optional<DType> dt;
  if (dtype->value) dt = parse_dtype(*dtype->value);
  if (!dt) throw FormatError(ctx() + ": unknown dtype " + dtype->raw);
  t.dtype = *dt;
  if (!shape) throw FormatError(ctx() + ": missing \"shape\"");
  if (!*shape) throw FormatError(ctx() + ": \"shape\" must be an array of non-negative integers");
  t.shape = std::move(**shape);
  if (!has_pieces) throw FormatError(ctx() + ": missing \"pieces\"");
  std::sort(t.pieces.begin(), t.pieces.end(), offsets_less);
  t.name = std::move(name);
  return t;
}

void parse_tensors(JsonReader& r, const std::string& where, CheckpointIndex& index) {
  if (r.peek() != JsonReader::Kind::kObject)
    throw FormatError(where + ": \"tensors\" must be an object");
  r.begin_object(/*caller_checks_keys=*/true);
  std::string name;
  std::string checked_file;
  while (r.next_key(name)) index.tensors.push_back(parse_tensor(r, where, name, checked_file));
  // Sorted by name, as validate_index wants (our writer already sorts); a repeat is then adjacent.
  auto by_name = [](const IndexTensor& a, const IndexTensor& b) { return a.name < b.name; };
  if (!std::is_sorted(index.tensors.begin(), index.tensors.end(), by_name)) {
    std::stable_sort(index.tensors.begin(), index.tensors.end(), by_name);
  }
  for (size_t i = 1; i < index.tensors.size(); ++i) {
    if (index.tensors[i].name == index.tensors[i - 1].name) r.duplicate_key(index.tensors[i].name);
  }
}

CheckpointIndex parse_index_object(std::string_view text, const std::string& where) {
  JsonReader r(text, where);
  if (const auto kind = r.peek(); kind != JsonReader::Kind::kObject) {
    throw FormatError(where + ": index is a JSON " + JsonReader::kind_name(kind) +
                      ", expected an object");
  }
  CheckpointIndex index;
  std::optional<StringOrRaw> fmt;
  std::optional<std::optional<int64_t>> version, world;
  bool has_tensors = false;
  std::string_view deferred_tensors;  // "tensors" met before the format was known
  // The format and its version are checked before any tensor is interpreted (a later version
  // may lay tensors out differently). Our writer puts them first; otherwise the tensors' text is
  // set aside and read after the loop.
  auto check_format = [&] {
    if (!fmt) throw FormatError(where + ": missing \"format\"");
    if (!fmt->value || *fmt->value != kIndexFormatName) {
      throw FormatError(where + ": \"format\" is " + fmt->raw + ", expected \"fsdp_ema\"");
    }
    if (!version) throw FormatError(where + ": missing \"format_version\"");
    if (!*version) throw FormatError(where + ": \"format_version\" must be a non-negative integer");
    index.format_version = **version;
    if (index.format_version != kIndexFormatVersion) {
      throw FormatError(where + ": unsupported format_version " + std::to_string(**version) +
                        " (this build reads " + std::to_string(kIndexFormatVersion) + ")");
    }
  };
  auto read_int = [&]() -> std::optional<int64_t> {
    if (r.peek() == JsonReader::Kind::kNumber) return r.read_nonneg_int();
    r.skip_value();
    return std::nullopt;
  };
  r.begin_object();
  std::string key;
  while (r.next_key(key)) {
    if (key == "format") {
      fmt = read_string_or_raw(r);
    } else if (key == "format_version") {
      version = read_int();
    } else if (key == "world_size") {
      world = read_int();
    } else if (key == "metadata") {
      if (r.peek() != JsonReader::Kind::kObject) {
        throw FormatError(where + ": \"metadata\" must be an object of strings");
      }
      r.begin_object();
      std::string k;
      while (r.next_key(k)) {
        if (r.peek() != JsonReader::Kind::kString) {
          throw FormatError(where + ": metadata entry " + json_quote(k) + " must be a string");
        }
        index.metadata.emplace(k, r.read_string());
      }
    } else if (key == "tensors") {
      has_tensors = true;
      if (fmt && version) {
        check_format();
        parse_tensors(r, where, index);
      } else {
        deferred_tensors = r.skip_value();
      }
    } else {
      r.skip_value();
    }
  }
  r.expect_end();
  check_format();
  if (!world) throw FormatError(where + ": missing \"world_size\"");
  if (!*world || **world < 1) throw FormatError(where + ": \"world_size\" must be an integer >= 1");
  index.world_size = **world;
  if (!has_tensors) throw FormatError(where + ": missing \"tensors\"");
  if (!deferred_tensors.empty()) {
    JsonReader tr(deferred_tensors, where);
    parse_tensors(tr, where, index);
  }
  validate_index(index, where);
  return index;
}

}  // namespace

CheckpointIndex parse_index_json(std::string_view text, const std::string& where) {
  return detail::interpret_json(text, where, [&] { return parse_index_object(text, where); });
}

}  // namespace fsdp_ema::format
