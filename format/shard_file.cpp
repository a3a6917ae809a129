#include "format/shard_file.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <utility>

#include "format/checksum.h"
#include "format/error.h"
#include "format/file_util.h"
#include "format/json_strict.h"

namespace fsdp_ema::format {
namespace {

using detail::Json;
using detail::json_quote;

std::optional<int64_t> parse_decimal(std::string_view s) {
  int64_t v = 0;
  if (s.empty()) return std::nullopt;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

// Parses a metadata value holding a JSON object keyed by tensor name, and checks that its keys
// are exactly the file's tensors.
Json parse_per_tensor_object(const std::map<std::string, std::string>& metadata,
                             std::string_view key, const std::vector<TensorInfo>& tensors,
                             const std::unordered_map<std::string, size_t>& by_name,
                             const std::string& file) {
  const std::string what = file + ": metadata " + std::string(key);
  Json j = detail::parse_json_strict(metadata.at(std::string(key)), what);
  if (!j.is_object()) {
    throw FormatError(what + ": is a JSON " + detail::json_type_name(j) +
                      ", expected an object keyed by tensor name");
  }
  for (const auto& [name, value] : j.items()) {
    if (!by_name.contains(name)) {
      throw FormatError(what + ": names tensor " + json_quote(name) + " that is not in the file");
    }
  }
  for (const TensorInfo& t : tensors) {
    if (!j.contains(t.name)) {
      throw FormatError(what + ": has no entry for tensor " + json_quote(t.name));
    }
  }
  return j;
}

}  // namespace

ShardHeader interpret_shard_header(SafetensorsHeader raw, const std::string& file) {
  ShardHeader h;
  h.tensors.reserve(raw.tensors.size());
  std::unordered_map<std::string, size_t> by_name;
  for (const HeaderTensor& e : raw.tensors) {
    TensorInfo t;
    t.name = e.name;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.offsets.assign(e.shape.size(), 0);
    t.data_offset = raw.data_start + e.begin;
    t.nbytes = e.end - e.begin;
    by_name.emplace(t.name, h.tensors.size());
    h.tensors.push_back(std::move(t));
  }
  const auto& md = raw.metadata;
  auto has = [&](std::string_view k) { return md.contains(std::string(k)); };

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

  if (has(kMetaDcpShardingInfo)) {
    const Json info = parse_per_tensor_object(md, kMetaDcpShardingInfo, h.tensors, by_name, file);
    for (TensorInfo& t : h.tensors) {
      const Json& entry = info.at(t.name);
      const std::string ctx = file + ": tensor " + json_quote(t.name) + ": DCP_SHARDING_INFO";
      if (!entry.is_object() || !entry.contains("saved_offsets")) {
        throw FormatError(ctx + " entry must be an object with \"saved_offsets\"");
      }
      auto offsets = detail::as_shape(entry.at("saved_offsets"));
      if (!offsets || offsets->size() != t.shape.size()) {
        throw FormatError(ctx + " saved_offsets must be " + std::to_string(t.shape.size()) +
                          " non-negative integers (one per dimension of shape " +
                          shape_to_string(t.shape) + ")");
      }
      for (size_t d = 0; d < offsets->size(); ++d) {
        if ((*offsets)[d] > std::numeric_limits<int64_t>::max() - t.shape[d]) {
          throw FormatError(ctx + " saved_offsets " + shape_to_string(*offsets) +
                            " + shape overflow");
        }
      }
      t.offsets = std::move(*offsets);
    }
  }

  for (TensorInfo& t : h.tensors) {
    t.global_shape.resize(t.shape.size());
    for (size_t d = 0; d < t.shape.size(); ++d) t.global_shape[d] = t.offsets[d] + t.shape[d];
  }

  if (has(kMetaGlobalShapes)) {
    const Json shapes = parse_per_tensor_object(md, kMetaGlobalShapes, h.tensors, by_name, file);
    for (TensorInfo& t : h.tensors) {
      const std::string ctx =
          file + ": tensor " + json_quote(t.name) + ": " + std::string(kMetaGlobalShapes);
      auto g = detail::as_shape(shapes.at(t.name));
      if (!g || g->size() != t.shape.size()) {
        throw FormatError(ctx + " entry must be " + std::to_string(t.shape.size()) +
                          " non-negative integers (one per dimension of shape " +
                          shape_to_string(t.shape) + ")");
      }
      for (size_t d = 0; d < g->size(); ++d) {
        if (t.offsets[d] + t.shape[d] > (*g)[d]) {
          throw FormatError(ctx + ": offsets " + shape_to_string(t.offsets) + " + shape " +
                            shape_to_string(t.shape) + " exceed global shape " +
                            shape_to_string(*g) + " in dimension " + std::to_string(d));
        }
      }
      if (!numel(*g)) {
        throw FormatError(ctx + ": global shape " + shape_to_string(*g) + " overflows");
      }
      t.global_shape = std::move(*g);
    }
  }

  if (has(kMetaChecksums)) {
    const Json sums = parse_per_tensor_object(md, kMetaChecksums, h.tensors, by_name, file);
    for (TensorInfo& t : h.tensors) {
      const Json& v = sums.at(t.name);
      std::optional<uint64_t> c;
      if (v.is_string()) c = parse_checksum(v.get_ref<const std::string&>());
      if (!c) {
        throw FormatError(file + ": tensor " + json_quote(t.name) + ": checksum " +
                          v.dump(-1, ' ', false, Json::error_handler_t::replace) +
                          " is not \"xxh3-64:<16 lowercase hex digits>\"");
      }
      t.checksum = *c;
    }
  }

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
  h.raw = std::move(raw);
  return h;
}

struct ShardFile::Impl {
  std::string path;
  detail::MappedFile map;  // the descriptor is closed once mapped: thousands of files stay open
  ShardHeader header;
  std::unordered_map<std::string, size_t> by_name;
};

ShardFile::ShardFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardFile::ShardFile(ShardFile&&) noexcept = default;
ShardFile& ShardFile::operator=(ShardFile&&) noexcept = default;
ShardFile::~ShardFile() = default;

ShardFile ShardFile::open(const std::string& path, bool verify_checksums) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  {
    const detail::UniqueFd fd = detail::open_read_only(path);
    const uint64_t size = detail::fd_size(fd.get(), path);
    std::byte first8[8] = {};
    if (size >= 8) detail::pread_all(fd.get(), first8, 8, 0, path);
    const uint64_t n = parse_header_length(std::span<const std::byte>(first8, 8), size, path);
    std::string json(n, '\0');
    detail::pread_all(fd.get(), json.data(), n, 8, path);
    impl->header = interpret_shard_header(parse_safetensors_header(json, size, path), path);
    impl->map = detail::MappedFile(fd.get(), size, path);
  }
  for (size_t i = 0; i < impl->header.tensors.size(); ++i) {
    impl->by_name.emplace(impl->header.tensors[i].name, i);
  }
  ShardFile file(std::move(impl));
  if (verify_checksums) file.verify_all();
  return file;
}

const std::string& ShardFile::path() const { return impl_->path; }
uint64_t ShardFile::file_bytes() const { return impl_->header.raw.file_bytes; }
const ShardHeader& ShardFile::header() const { return impl_->header; }
const std::vector<TensorInfo>& ShardFile::tensors() const { return impl_->header.tensors; }
const std::map<std::string, std::string>& ShardFile::metadata() const {
  return impl_->header.raw.metadata;
}
bool ShardFile::is_fsdp_ema() const { return impl_->header.fsdp_ema; }

const TensorInfo* ShardFile::find(std::string_view name) const {
  auto it = impl_->by_name.find(std::string(name));
  return it == impl_->by_name.end() ? nullptr : &impl_->header.tensors[it->second];
}

const TensorInfo& ShardFile::tensor(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) {
    throw FormatError(impl_->path + ": no tensor " + json_quote(name) + " in this file");
  }
  return *t;
}

std::span<const std::byte> ShardFile::data(const TensorInfo& t) const {
  if (t.nbytes == 0) return {};
  return {impl_->map.data() + t.data_offset, t.nbytes};
}

std::span<const std::byte> ShardFile::data(std::string_view name) const {
  return data(tensor(name));
}

void ShardFile::read(const TensorInfo& t, uint64_t offset, uint64_t length, void* dst) const {
  auto end = checked_add(offset, length);
  if (!end || *end > t.nbytes) {
    throw FormatError(impl_->path + ": tensor " + json_quote(t.name) + ": read of " +
                      std::to_string(length) + " bytes at " + std::to_string(offset) +
                      " is outside its " + std::to_string(t.nbytes) + " bytes");
  }
  if (length == 0) return;
  const std::byte* src = impl_->map.data() + t.data_offset + offset;
  detail::advise_willneed(src, length);
  std::memcpy(dst, src, length);
}

uint64_t ShardFile::compute_checksum(const TensorInfo& t) const {
  const auto bytes = data(t);
  detail::advise_willneed(bytes.data(), bytes.size());
  return checksum_of(bytes);
}

bool ShardFile::verify(const TensorInfo& t) const {
  if (!t.checksum) return false;
  const uint64_t actual = compute_checksum(t);
  if (actual != *t.checksum) {
    throw FormatError(impl_->path + ": tensor " + json_quote(t.name) +
                      ": checksum mismatch: stored " + format_checksum(*t.checksum) +
                      ", data hashes to " + format_checksum(actual) + " (corrupted data)");
  }
  return true;
}

bool ShardFile::verify(std::string_view name) const { return verify(tensor(name)); }

size_t ShardFile::verify_all() const {
  size_t n = 0;
  for (const TensorInfo& t : impl_->header.tensors) n += verify(t) ? 1 : 0;
  return n;
}

}  // namespace fsdp_ema::format
