#include "fsdp_ema/format/shard_writer.h"

#include <cstdio>
#include <limits>
#include <set>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/name_hash.h"
#include "fsdp_ema/format/paths.h"
#include "fsdp_ema/format/recent_shards.h"
#include "fsdp_ema/format/safetensors_writer.h"
#include "fsdp_ema/format/shard_file.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

bool is_reserved_metadata_key(const std::string& key) {
  return key == kMetaFormat || key == kMetaDcpVersion || key == kMetaDcpShardingInfo ||
         key.starts_with("fsdp_ema_");
}

uint64_t validate(const std::string& path, size_t i, const TensorToWrite& t) {
  // Built only on error: a shard file holds 100,000+ tensors.
  auto ctx = [&] {
    return "write_shard_file(" + path + "): tensor #" + std::to_string(i) + " " +
           json_quote(t.name);
  };
  if (t.name.empty()) {
    throw FormatError("write_shard_file(" + path + "): tensor #" + std::to_string(i) +
                      " has an empty name");
  }
  if (!detail::is_valid_utf8(t.name)) throw FormatError(ctx() + ": name is not valid UTF-8");
  if (t.name == "__metadata__") throw FormatError(ctx() + ": name is reserved by safetensors");
  const size_t ndim = t.shape.size();
  if (t.offsets.size() != ndim || t.global_shape.size() != ndim) {
    throw FormatError(ctx() + ": shape " + shape_to_string(t.shape) + ", offsets " +
                      shape_to_string(t.offsets) + " and global shape " +
                      shape_to_string(t.global_shape) + " must have one entry per dimension each");
  }
  for (size_t d = 0; d < ndim; ++d) {
    if (t.shape[d] < 0 || t.offsets[d] < 0 || t.global_shape[d] < 0) {
      throw FormatError(ctx() + ": negative size or offset in dimension " + std::to_string(d));
    }
    if (t.offsets[d] > t.global_shape[d] || t.shape[d] > t.global_shape[d] - t.offsets[d]) {
      throw FormatError(ctx() + ": offsets " + shape_to_string(t.offsets) + " + shape " +
                        shape_to_string(t.shape) + " exceed global shape " +
                        shape_to_string(t.global_shape) + " in dimension " + std::to_string(d));
    }
  }
  if (!numel(t.global_shape)) {
    throw FormatError(ctx() + ": global shape " + shape_to_string(t.global_shape) + " overflows");
  }
  auto bytes = nbytes(t.shape, t.dtype);
  if (!bytes) {
    throw FormatError(ctx() + ": shape " + shape_to_string(t.shape) + " of " +
                      std::string(dtype_name(t.dtype)) + " overflows a 64-bit byte count");
  }
  if (t.host_data != nullptr && t.fill) {
    throw FormatError(ctx() + ": has both host_data and a fill callback; give one");
  }
  if (*bytes > 0 && t.host_data == nullptr && !t.fill) {
    throw FormatError(ctx() + ": has " + std::to_string(*bytes) +
                      " bytes but neither host_data nor a fill callback");
  }
  return *bytes;
}

}  // namespace

TensorToWrite TensorToWrite::full(std::string name, DType dtype, Shape shape, const void* data) {
  TensorToWrite t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.offsets.assign(shape.size(), 0);
  t.global_shape = shape;
  t.shape = std::move(shape);
  t.host_data = data;
  return t;
}

namespace {

// The options' rank and world size, and the caller's metadata (not our keys, valid UTF-8).
void check_write_options(const std::string& path, const WriteOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    throw FormatError("write_shard_file(" + path + "): rank " + std::to_string(options.rank) +
                      " is not in [0, world_size " + std::to_string(options.world_size) + ")");
  }
  for (const auto& [key, value] : options.metadata) {
    if (is_reserved_metadata_key(key)) {
      throw FormatError("write_shard_file(" + path + "): metadata key " + json_quote(key) +
                        " is reserved");
    }
    if (!detail::is_valid_utf8(key) || !detail::is_valid_utf8(value)) {
      throw FormatError("write_shard_file(" + path + "): metadata entry " + json_quote(key) +
                        " is not valid UTF-8");
    }
  }
}

// The container's view of every tensor, each validated, no name twice.
std::vector<RawTensor> raw_tensors(const std::string& path,
                                   const std::vector<TensorToWrite>& tensors) {
  std::vector<RawTensor> raw(tensors.size());
  std::unordered_set<std::string_view, detail::NameHash> names;
  names.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorToWrite& t = tensors[i];
    raw[i].nbytes = validate(path, i, t);
    if (!names.insert(t.name).second) {
      throw FormatError("write_shard_file(" + path + "): tensor name " + json_quote(t.name) +
                        " appears twice");
    }
    raw[i].name = t.name;
    raw[i].dtype = t.dtype;
    raw[i].shape = t.shape;
    raw[i].host_data = t.host_data;
    raw[i].fill = t.fill;
  }
  return raw;
}

// DCP_SHARDING_INFO and our global shapes, in file order (they do not depend on checksums).
std::pair<std::string, std::string> sharding_documents(const std::vector<TensorToWrite>& tensors,
                                                       const std::vector<size_t>& order,
                                                       size_t names_bytes) {
  std::string sharding = "{", global_shapes = "{";
  sharding.reserve(names_bytes + 40 * order.size());
  global_shapes.reserve(names_bytes + 24 * order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorToWrite& t = tensors[order[k]];
    if (k > 0) {
      sharding += ',';
      global_shapes += ',';
    }
    detail::append_json_quoted(sharding, t.name);
    sharding += ":{\"saved_offsets\":";
    append_shape_json(sharding, t.offsets);
    sharding += '}';
    detail::append_json_quoted(global_shapes, t.name);
    global_shapes += ':';
    append_shape_json(global_shapes, t.global_shape);
  }
  sharding += '}';
  global_shapes += '}';
  return {std::move(sharding), std::move(global_shapes)};
}

// A checksums document, written once with zero digits: `digits[k]` is where the k-th entry's
// digits land once the document is quoted into the header (each '"' or '\\' before them gains a
// backslash there), so they are patched in after the data without serializing the header again.
// One entry per tensor in file order for the checksums; for the block checksums (checksum.h),
// one per tensor of more than one block, its blocks' digits in a row.
struct DigitsDoc {
  std::string text = "{";
  std::vector<size_t> digits;      // per entry
  std::vector<size_t> entry;       // per entry: its index in `order`
  size_t quoted = 1, scanned = 1;  // quoted size of text[0, scanned)
  void add(std::string_view name, std::string_view prefix, uint64_t num_digits, size_t k) {
    if (!digits.empty()) text += ',';
    detail::append_json_quoted(text, name);
    text += ":\"";
    text += prefix;
    for (; scanned < text.size(); ++scanned) {
      quoted += text[scanned] == '"' || text[scanned] == '\\' ? 2 : 1;
    }
    digits.push_back(quoted);
    entry.push_back(k);
    text.append(num_digits, '0');
    text += '"';
  }
};

// What the header says, for the caller and for a commit in this process
// (fsdp_ema/format/recent_shards.h), which then need not parse the file back.
ShardDescription describe_written(const std::string& path, std::vector<TensorToWrite>& tensors,
                                  const std::vector<RawTensor>& raw, const RawWriteResult& r,
                                  const WriteOptions& options) {
  ShardDescription d;
  d.file = detail::base_name(path);
  d.rank = options.rank;
  d.world_size = options.world_size;
  d.file_bytes = r.file_bytes;
  d.tensors.reserve(tensors.size());
  for (const size_t idx : r.order) {
    TensorToWrite& t = tensors[idx];
    TensorInfo info;
    info.name = std::move(t.name);
    info.dtype = t.dtype;
    info.shape = std::move(t.shape);
    info.offsets = std::move(t.offsets);
    info.global_shape = std::move(t.global_shape);
    info.checksum = r.checksums[idx];
    info.block_checksums = r.block_checksums[idx];
    info.data_offset = r.data_offset[idx];
    info.nbytes = raw[idx].nbytes;
    d.tensors.push_back(std::move(info));
  }
  return d;
}

}  // namespace

uint64_t write_shard_file(const std::string& path, std::vector<TensorToWrite> tensors,
                          const WriteOptions& options, ShardDescription* written) {
  check_path(path, "shard file");
  check_write_options(path, options);
  const std::vector<RawTensor> raw = raw_tensors(path, tensors);
  const std::vector<size_t> order = file_order(raw);
  size_t names_bytes = 0;
  for (const TensorToWrite& t : tensors) names_bytes += t.name.size() + 4;
  auto [sharding, global_shapes] = sharding_documents(tensors, order, names_bytes);

  const uint64_t block = options.checksum_block_bytes;
  DigitsDoc sums, block_sums;
  sums.text.reserve(names_bytes + 30 * order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorToWrite& t = tensors[order[k]];
    sums.add(t.name, kChecksumPrefix, kChecksumDigits, k);
    const uint64_t n = raw[order[k]].nbytes;
    if (block > 0 && n > block) {
      block_sums.add(t.name, "", kChecksumDigits * checksum_blocks(n, block), k);
    }
  }
  sums.text += '}';
  block_sums.text += '}';
  std::vector<std::pair<std::string, std::string>> md = {
      {std::string(kMetaFormat), "pt"},
      {std::string(kMetaDcpVersion), "1.0"},
      {std::string(kMetaDcpShardingInfo), std::move(sharding)},
      {std::string(kMetaFormatVersion), std::to_string(kShardFormatVersion)},
      {std::string(kMetaRank), std::to_string(options.rank)},
      {std::string(kMetaWorldSize), std::to_string(options.world_size)},
      {std::string(kMetaGlobalShapes), std::move(global_shapes)},
      {std::string(kMetaChecksums), std::move(sums.text)},
  };
  constexpr size_t kChecksumsEntry = 7;
  constexpr size_t kBlockChecksumsEntry = 8;
  constexpr size_t kSealEntry = 10;
  if (block > 0) {
    md.emplace_back(std::string(kMetaBlockChecksums), std::move(block_sums.text));
    md.emplace_back(std::string(kMetaBlockBytes), std::to_string(block));
    md.emplace_back(std::string(kMetaChecksumSeal), format_checksum(0));  // patched below
  }
  for (const auto& [k, v] : options.metadata) md.emplace_back(k, v);
  auto metadata = [&](std::span<const uint64_t>) { return std::move(md); };
  auto patch = [&](std::string& header, std::span<const size_t> value_offsets,
                   const RawWriteResult& written) {
    char* base = header.data() + value_offsets[kChecksumsEntry];
    for (size_t k = 0; k < order.size(); ++k) {
      write_checksum_digits(base + sums.digits[k], written.checksums[order[k]]);
    }
    if (block == 0) return;
    base = header.data() + value_offsets[kBlockChecksumsEntry];
    ChecksumSeal seal;
    for (size_t e = 0; e < block_sums.entry.size(); ++e) {
      const size_t idx = order[block_sums.entry[e]];
      const std::vector<uint64_t>& blocks = written.block_checksums[idx];
      for (size_t b = 0; b < blocks.size(); ++b) {
        write_checksum_digits(base + block_sums.digits[e] + kChecksumDigits * b, blocks[b]);
      }
      seal.add(written.checksums[idx], blocks);
    }
    write_checksum_digits(header.data() + value_offsets[kSealEntry] + kChecksumPrefix.size(),
                          seal.digest());
  };

  const RawWriteResult r = write_safetensors_file(path, raw, metadata, options, order, patch);
  ShardDescription d = describe_written(path, tensors, raw, r, options);
  if (written != nullptr) *written = d;
  detail::remember_written_shard(path, std::move(d), r.header_checksum);
  return r.file_bytes;
}

}  // namespace fsdp_ema::format
