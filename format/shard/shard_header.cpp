// interpret_shard_header (fsdp_ema/format/shard_file.h): what a safetensors header's metadata says
// about each tensor (DCP's sharding info, our global shapes, checksums and block checksums, the
// rank and world size), each document read by a pass of its own, checked against the tensors.
#include <charconv>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/name_index.h"
#include "fsdp_ema/format/parallel.h"
#include "fsdp_ema/format/shard_file.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;
using detail::JsonReader;

std::optional<int64_t> parse_decimal(std::string_view s) {
  int64_t v = 0;
  if (s.empty()) return std::nullopt;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

using TensorsByName = detail::NameIndex;

// Reads a metadata value holding a JSON object keyed by tensor name, whose keys must be exactly
// the file's tensors, in one pass: on_entry(tensor, reader) reads each entry's value.
// `required(tensor)`: whether the tensor must have an entry (and may: an entry for a tensor
// that is not required is refused too); every tensor by default.
template <typename F, typename R>
void for_each_tensor_entry(const std::map<std::string, std::string>& metadata, std::string_view key,
                           std::vector<TensorInfo>& tensors, const TensorsByName& by_name,
                           const std::string& file, F&& on_entry, R&& required) {
  const std::string what = file + ": metadata " + std::string(key);
  const std::string& text = metadata.at(std::string(key));
  std::vector<char> seen(tensors.size(), 0);
  detail::interpret_json(text, what, [&] {
    JsonReader r(text, what);
    if (const auto kind = r.peek(); kind != JsonReader::Kind::kObject) {
      throw FormatError(what + ": is a JSON " + JsonReader::kind_name(kind) +
                        ", expected an object keyed by tensor name");
    }
    r.begin_object(/*caller_checks_keys=*/true);
    std::string name;
    size_t next = 0;  // writers list the entries in file order: try that slot before hashing
    while (r.next_key(name)) {
      const auto found = next < tensors.size() && tensors[next].name == name
                             ? std::optional<size_t>(next)
                             : by_name.find(name);
      if (!found) {
        throw FormatError(what + ": names tensor " + json_quote(name) + " that is not in the file");
      }
      if (seen[*found]) r.duplicate_key(name);
      if (!required(tensors[*found])) {
        throw FormatError(what + ": has an entry for tensor " + json_quote(name) +
                          ", which must have none");
      }
      seen[*found] = 1;
      next = *found + 1;
      on_entry(tensors[*found], r);
    }
    r.expect_end();
  });
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!seen[i] && required(tensors[i])) {
      throw FormatError(what + ": has no entry for tensor " + json_quote(tensors[i].name));
    }
  }
}

template <typename F>
void for_each_tensor_entry(const std::map<std::string, std::string>& metadata, std::string_view key,
                           std::vector<TensorInfo>& tensors, const TensorsByName& by_name,
                           const std::string& file, F&& on_entry) {
  for_each_tensor_entry(metadata, key, tensors, by_name, file, std::forward<F>(on_entry),
                        [](const TensorInfo&) { return true; });
}

// The block size of the extension: a power of two in the accepted range.
uint64_t parse_block_bytes(const std::string& value, const std::string& file) {
  const auto v = parse_decimal(value);
  const auto b = v ? static_cast<uint64_t>(*v) : 0;
  if (!v || b < kMinChecksumBlockBytes || b > kMaxChecksumBlockBytes || (b & (b - 1)) != 0) {
    throw FormatError(file + ": metadata " + std::string(kMetaBlockBytes) + " " +
                      json_quote(value) + " is not a power of two in [" +
                      std::to_string(kMinChecksumBlockBytes) + ", " +
                      std::to_string(kMaxChecksumBlockBytes) + "]");
  }
  return b;
}

// A checksum's digits per block, concatenated.
std::optional<std::vector<uint64_t>> parse_block_digits(std::string_view text, uint64_t blocks) {
  if (text.size() != blocks * kChecksumDigits) return std::nullopt;
  std::vector<uint64_t> out(blocks);
  for (uint64_t b = 0; b < blocks; ++b) {
    const auto v = parse_checksum_digits(text.substr(b * kChecksumDigits, kChecksumDigits));
    if (!v) return std::nullopt;
    out[b] = *v;
  }
  return out;
}

// One header being interpreted: what every pass over its metadata reads.
struct Metadata {
  ShardHeader& h;
  const std::map<std::string, std::string>& md;
  const TensorsByName& by_name;  // views of h.tensors' names
  const std::string& file;
  bool has(std::string_view key) const { return md.contains(std::string(key)); }
  const std::string& text(std::string_view key) const { return md.at(std::string(key)); }
  // for_each_tensor_entry over the document under `key`.
  template <typename... F>
  void for_each_entry(std::string_view key, F&&... f) const {
    for_each_tensor_entry(md, key, h.tensors, by_name, file, std::forward<F>(f)...);
  }
};

// The tensors of the container, moved out of it (the raw entries would only hold a second copy of
// every name), each at offsets 0 until DCP_SHARDING_INFO says otherwise.
std::vector<TensorInfo> take_tensors(SafetensorsHeader& raw) {
  std::vector<TensorInfo> tensors;
  tensors.reserve(raw.tensors.size());
  for (HeaderTensor& e : raw.tensors) {
    TensorInfo t;
    t.name = std::move(e.name);
    t.dtype = e.dtype;
    t.offsets.assign(e.shape.size(), 0);
    t.shape = std::move(e.shape);
    t.data_offset = raw.data_start + e.begin;
    t.nbytes = e.end - e.begin;
    tensors.push_back(std::move(t));
  }
  raw.tensors.clear();
  raw.tensors.shrink_to_fit();
  return tensors;
}

// Our format version: required with any of our keys, and then with all of them.
void check_version(const Metadata& m) {
  const auto& md = m.md;
  const std::string& file = m.file;
  auto has = [&](std::string_view k) { return m.has(k); };
  ShardHeader& h = m.h;
  if (!has(kMetaFormatVersion)) {
    // Our keys are reserved: a file that carries some of them claims our layout, and without the
    // version nothing says which rules it follows.
    for (const auto& [key, value] : md) {
      if (key.starts_with("fsdp_ema_")) {
        throw FormatError(file + ": metadata key " + json_quote(key) + " without " +
                          std::string(kMetaFormatVersion) +
                          ": a file that claims the fsdp_ema layout must say its version");
      }
    }
  }
  if (has(kMetaFormatVersion)) {
    const std::string& v = md.at(std::string(kMetaFormatVersion));
    if (parse_decimal(v) != kShardFormatVersion) {
      throw FormatError(file + ": unsupported " + std::string(kMetaFormatVersion) + " " +
                        json_quote(v) + " (this build reads " +
                        std::to_string(kShardFormatVersion) + ")");
    }
    h.fsdp_ema = true;
    for (std::string_view k :
         {kMetaDcpShardingInfo, kMetaGlobalShapes, kMetaChecksums, kMetaRank, kMetaWorldSize}) {
      if (!has(k)) {
        throw FormatError(file + ": fsdp_ema shard file lacks metadata key " + std::string(k));
      }
    }
  }
}

// DCP_SHARDING_INFO: each tensor's offsets in the global tensor.
void read_sharding_info(const Metadata& m) {
  const std::string& file = m.file;
  m.for_each_entry(kMetaDcpShardingInfo, [&](TensorInfo& t, JsonReader& r) {
    auto ctx = [&] { return file + ": tensor " + json_quote(t.name) + ": DCP_SHARDING_INFO"; };
    std::optional<Shape> offsets;
    bool present = false;
    if (r.peek() == JsonReader::Kind::kObject) {
      r.begin_object();
      std::string k;
      while (r.next_key(k)) {
        if (k == "saved_offsets") {
          present = true;
          offsets = r.read_shape();
        } else {
          r.skip_value();
        }
      }
    }
    if (!present) throw FormatError(ctx() + " entry must be an object with \"saved_offsets\"");
    if (!offsets || offsets->size() != t.shape.size()) {
      throw FormatError(ctx() + " saved_offsets must be " + std::to_string(t.shape.size()) +
                        " non-negative integers (one per dimension of shape " +
                        shape_to_string(t.shape) + ")");
    }
    for (size_t d = 0; d < offsets->size(); ++d) {
      if ((*offsets)[d] > std::numeric_limits<int64_t>::max() - t.shape[d]) {
        throw FormatError(ctx() + " saved_offsets " + shape_to_string(*offsets) +
                          " + shape overflow");
      }
    }
    t.offsets = std::move(*offsets);
  });
}

// Our global shapes, into globals[i] for tensor i (checked against the offsets afterwards).
void read_global_shapes(const Metadata& m, std::vector<Shape>& globals) {
  const std::string& file = m.file;
  ShardHeader& h = m.h;
  m.for_each_entry(kMetaGlobalShapes, [&](TensorInfo& t, JsonReader& r) {
    auto g = r.read_shape();
    if (!g || g->size() != t.shape.size()) {
      throw FormatError(
          file + ": tensor " + json_quote(t.name) + ": " + std::string(kMetaGlobalShapes) +
          " entry must be " + std::to_string(t.shape.size()) +
          " non-negative integers (one per dimension of shape " + shape_to_string(t.shape) + ")");
    }
    globals[static_cast<size_t>(&t - h.tensors.data())] = std::move(*g);
  });
}

// Our per-tensor checksums.
void read_checksums(const Metadata& m) {
  const std::string& file = m.file;
  m.for_each_entry(kMetaChecksums, [&](TensorInfo& t, JsonReader& r) {
    std::optional<uint64_t> c;
    std::string text;
    if (r.peek() == JsonReader::Kind::kString) {
      text = r.read_string();
      c = parse_checksum(text);
      if (!c) text = json_quote(text);
    } else {
      text = std::string(r.skip_value());
    }
    if (!c) {
      throw FormatError(file + ": tensor " + json_quote(t.name) + ": checksum " + text +
                        " is not " + checksum_form_text());
    }
    t.checksum = *c;
  });
}

// The block checksums of every tensor of more than one block (h.block_bytes set already).
void read_block_checksums(const Metadata& m) {
  const std::string& file = m.file;
  const uint64_t block = m.h.block_bytes;
  m.for_each_entry(
      kMetaBlockChecksums,
      [&](TensorInfo& t, JsonReader& r) {
        const uint64_t blocks = checksum_blocks(t.nbytes, block);
        std::optional<std::vector<uint64_t>> sums;
        if (r.peek() == JsonReader::Kind::kString) {
          sums = parse_block_digits(r.read_string(), blocks);
        } else {
          r.skip_value();
        }
        if (!sums) {
          throw FormatError(file + ": tensor " + json_quote(t.name) + ": " +
                            std::string(kMetaBlockChecksums) + " entry must be a string of " +
                            std::to_string(blocks) + " x " + checksum_digits_text() + " (" +
                            std::to_string(t.nbytes) + " bytes in blocks of " +
                            std::to_string(block) + ")");
        }
        t.block_checksums = std::move(*sums);
      },
      [block](const TensorInfo& t) { return t.nbytes > block; });
}

// The seal of the block checksums (h.block_bytes set, every pass read): the block checksums are
// used only with a seal that binds them to the checksums (ChecksumSeal); without one (a file
// written before the seal) they are dropped, and readers verify the tensors by their checksums.
void check_seal(const Metadata& m) {
  ShardHeader& h = m.h;
  if (!m.has(kMetaChecksumSeal)) {
    h.block_bytes = 0;
    for (TensorInfo& t : h.tensors) t.block_checksums.clear();
    return;
  }
  const std::string& text = m.text(kMetaChecksumSeal);
  const std::optional<uint64_t> stored = parse_checksum(text);
  if (!stored) {
    throw FormatError(m.file + ": metadata " + std::string(kMetaChecksumSeal) + " " +
                      json_quote(text) + " is not " + checksum_form_text());
  }
  ChecksumSeal seal;
  for (const TensorInfo& t : h.tensors) {
    if (!t.block_checksums.empty()) seal.add(*t.checksum, t.block_checksums);
  }
  if (seal.digest() != *stored) {
    throw FormatError(m.file + ": the block checksums (" + std::string(kMetaBlockChecksums) +
                      ") and the checksums (" + std::string(kMetaChecksums) +
                      ") disagree with each other: they seal to " + format_checksum(seal.digest()) +
                      " but " + std::string(kMetaChecksumSeal) + " is " + text +
                      " (one kind was changed without the other)");
  }
}

// Each tensor's global shape: ours, inside which offsets + shape must lie, or (no global shapes
// in the file) offsets + shape.
void set_global_shapes(ShardHeader& h, std::vector<Shape>& globals, bool has_globals,
                       const std::string& file) {
  for (TensorInfo& t : h.tensors) {
    if (!has_globals) {
      t.global_shape.resize(t.shape.size());
      for (size_t d = 0; d < t.shape.size(); ++d) t.global_shape[d] = t.offsets[d] + t.shape[d];
      continue;
    }
    Shape& g = globals[static_cast<size_t>(&t - h.tensors.data())];
    for (size_t d = 0; d < g.size(); ++d) {
      if (t.offsets[d] + t.shape[d] > g[d]) {
        throw FormatError(
            file + ": tensor " + json_quote(t.name) + ": " + std::string(kMetaGlobalShapes) +
            ": offsets " + shape_to_string(t.offsets) + " + shape " + shape_to_string(t.shape) +
            " exceed global shape " + shape_to_string(g) + " in dimension " + std::to_string(d));
      }
    }
    if (!numel(g)) {
      throw FormatError(file + ": tensor " + json_quote(t.name) + ": " +
                        std::string(kMetaGlobalShapes) + ": global shape " + shape_to_string(g) +
                        " overflows");
    }
    t.global_shape = std::move(g);
  }
}

// Our world size and rank (in [0, world size)).
void read_rank(const Metadata& m) {
  const auto& md = m.md;
  const std::string& file = m.file;
  auto has = [&](std::string_view k) { return m.has(k); };
  ShardHeader& h = m.h;
  if (has(kMetaWorldSize)) {
    const std::string& v = md.at(std::string(kMetaWorldSize));
    auto w = parse_decimal(v);
    if (!w || *w < 1) {
      throw FormatError(file + ": metadata " + std::string(kMetaWorldSize) + " " + json_quote(v) +
                        " is not a positive integer");
    }
    h.world_size = *w;
  }
  if (has(kMetaRank)) {
    const std::string& v = md.at(std::string(kMetaRank));
    auto r = parse_decimal(v);
    if (!r || (h.world_size && *r >= *h.world_size)) {
      throw FormatError(file + ": metadata " + std::string(kMetaRank) + " " + json_quote(v) +
                        " is not an integer in [0, world size)");
    }
    h.rank = *r;
  }
}

}  // namespace

ShardHeader interpret_shard_header(SafetensorsHeader raw, const std::string& file) {
  ShardHeader h;
  h.tensors = take_tensors(raw);
  // Views of the names in h.tensors, which is not resized after this.
  TensorsByName by_name;
  by_name.reserve(h.tensors.size());
  for (size_t i = 0; i < h.tensors.size(); ++i) by_name.insert(h.tensors[i].name, i);
  const Metadata m{h, raw.metadata, by_name, file};
  check_version(m);

  // The per-tensor metadata documents are parsed independently (in parallel when large): each
  // pass writes its own field of every TensorInfo, and the global shapes are checked against the
  // offsets once both are in. Errors are reported in the sequential order.
  std::vector<Shape> globals;
  std::vector<std::function<void()>> passes;
  size_t text_bytes = 0;
  auto add_pass = [&](std::string_view key, std::function<void()> pass) {
    text_bytes += m.text(key).size();
    passes.push_back(std::move(pass));
  };
  if (m.has(kMetaDcpShardingInfo)) add_pass(kMetaDcpShardingInfo, [&] { read_sharding_info(m); });
  if (m.has(kMetaGlobalShapes)) {
    globals.resize(h.tensors.size());
    add_pass(kMetaGlobalShapes, [&] { read_global_shapes(m, globals); });
  }
  if (m.has(kMetaChecksums)) add_pass(kMetaChecksums, [&] { read_checksums(m); });
  if (m.has(kMetaBlockBytes) != m.has(kMetaBlockChecksums)) {
    const bool bytes = m.has(kMetaBlockBytes);
    throw FormatError(file + ": metadata " +
                      std::string(bytes ? kMetaBlockBytes : kMetaBlockChecksums) + " without " +
                      std::string(bytes ? kMetaBlockChecksums : kMetaBlockBytes) +
                      ": the block-checksum extension needs both");
  }
  if (m.has(kMetaBlockChecksums)) {
    h.block_bytes = parse_block_bytes(m.text(kMetaBlockBytes), file);
    add_pass(kMetaBlockChecksums, [&] { read_block_checksums(m); });
  } else if (m.has(kMetaChecksumSeal)) {
    throw FormatError(file + ": metadata " + std::string(kMetaChecksumSeal) + " without " +
                      std::string(kMetaBlockChecksums) + ": a seal of no block checksums");
  }
  const auto errors = detail::run_jobs(
      passes.size(), [&](size_t i) { passes[i](); },
      text_bytes >= detail::kParallelParseBytes ? 0 : 1);
  // Sharding info, then global shapes (parse, then the check against the offsets), then checksums.
  const size_t globals_pass = m.has(kMetaDcpShardingInfo) ? 1 : 0;
  for (size_t i = 0; i <= globals_pass && i < errors.size(); ++i) {
    if (errors[i]) std::rethrow_exception(errors[i]);
  }
  set_global_shapes(h, globals, m.has(kMetaGlobalShapes), file);
  detail::rethrow_first(errors);
  if (m.has(kMetaBlockChecksums)) check_seal(m);
  read_rank(m);
  h.raw = std::move(raw);
  return h;
}

}  // namespace fsdp_ema::format
