// Reading one shard file (ours or any safetensors file): mmap, validated header, checksums.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "format/safetensors_header.h"
#include "format/tensor_info.h"

namespace fsdp_ema::format {

// Keys of our "__metadata__" (besides DCP's "format", "DCP_VERSION", "DCP_SHARDING_INFO").
inline constexpr std::string_view kMetaFormatVersion = "fsdp_ema_format_version";
inline constexpr std::string_view kMetaGlobalShapes = "fsdp_ema_global_shapes";
inline constexpr std::string_view kMetaChecksums = "fsdp_ema_checksums";
inline constexpr std::string_view kMetaRank = "fsdp_ema_rank";
inline constexpr std::string_view kMetaWorldSize = "fsdp_ema_world_size";
inline constexpr std::string_view kMetaDcpShardingInfo = "DCP_SHARDING_INFO";
inline constexpr std::string_view kMetaDcpVersion = "DCP_VERSION";
inline constexpr std::string_view kMetaFormat = "format";
// The value of fsdp_ema_format_version this build writes and reads.
inline constexpr int64_t kShardFormatVersion = 1;

// A parsed header plus what its metadata says about each tensor.
struct ShardHeader {
  SafetensorsHeader raw;
  std::vector<TensorInfo> tensors;  // file order
  bool fsdp_ema = false;            // has our metadata ("fsdp_ema_format_version")
  std::optional<int64_t> rank;
  std::optional<int64_t> world_size;
};

// Interprets the metadata of a parsed header. Our keys are optional (any safetensors file reads),
// but those present must parse and agree with the tensors: DCP_SHARDING_INFO and our global
// shapes and checksums must name exactly the file's tensors, with one offset / size per dimension
// and offsets + shape inside the global shape. With fsdp_ema_format_version present, all of our
// keys and DCP_SHARDING_INFO are required.
ShardHeader interpret_shard_header(SafetensorsHeader raw, const std::string& file);

// One safetensors file, mapped read-only (the descriptor is closed right after mapping, so a
// reader of thousands of shard files needs no file-descriptor headroom). Move-only. The file must
// not be truncated in place while open (reading the lost pages would raise SIGBUS, as with any
// mapping, e.g. the safetensors package's); our writers never do that: they rename new files in,
// and a mapping keeps the old file's data.
class ShardFile {
 public:
  // Opens, maps and validates the file; with verify_checksums, also checks every stored checksum.
  static ShardFile open(const std::string& path, bool verify_checksums = true);

  ShardFile(ShardFile&&) noexcept;
  ShardFile& operator=(ShardFile&&) noexcept;
  ~ShardFile();

  const std::string& path() const;
  uint64_t file_bytes() const;
  const ShardHeader& header() const;
  // Tensors in file order.
  const std::vector<TensorInfo>& tensors() const;
  // nullptr when the file has no such tensor.
  const TensorInfo* find(std::string_view name) const;
  // Throws FormatError naming the file when it has no such tensor.
  const TensorInfo& tensor(std::string_view name) const;
  // "__metadata__" entries (empty when absent).
  const std::map<std::string, std::string>& metadata() const;
  bool is_fsdp_ema() const;

  // The tensor's bytes inside the mapping (valid while this object lives).
  std::span<const std::byte> data(const TensorInfo& tensor) const;
  std::span<const std::byte> data(std::string_view name) const;

  // Copies `length` bytes from byte `offset` of the tensor's data (from the mapping, with
  // read-ahead requested for large ranges).
  void read(const TensorInfo& tensor, uint64_t offset, uint64_t length, void* dst) const;

  // Checks the stored checksum of one tensor: true when it matches, false when the file stores
  // none; throws FormatError("<file>: tensor '<name>': checksum mismatch ...") otherwise.
  bool verify(std::string_view name) const;
  bool verify(const TensorInfo& tensor) const;
  // verify() for every tensor; returns how many had a checksum.
  size_t verify_all() const;

  // XXH3-64 of the tensor's bytes as they are in the file now.
  uint64_t compute_checksum(const TensorInfo& tensor) const;

 private:
  struct Impl;
  explicit ShardFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp_ema::format
