// Reading one shard file (ours or any safetensors file): validated header, owned reads, checksums.
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

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/safetensors_header.h"
#include "fsdp_ema/format/tensor_info.h"

namespace fsdp_ema::format {

namespace detail {
class MappedFile;
}  // namespace detail

// Keys of our "__metadata__" (besides DCP's "format", "DCP_VERSION", "DCP_SHARDING_INFO").
inline constexpr std::string_view kMetaFormatVersion = "fsdp_ema_format_version";
inline constexpr std::string_view kMetaGlobalShapes = "fsdp_ema_global_shapes";
inline constexpr std::string_view kMetaChecksums = "fsdp_ema_checksums";
// The block-checksum extension (optional, both keys or neither): the block size, and an object
// keyed by the name of every tensor of more than one block, each value the 16 lowercase hex
// digits of every block's XXH3-64, concatenated.
inline constexpr std::string_view kMetaBlockBytes = "fsdp_ema_checksum_block_bytes";
inline constexpr std::string_view kMetaBlockChecksums = "fsdp_ema_block_checksums";
// With them, the seal that binds the block checksums to the checksums (ChecksumSeal, checksum.h),
// in the checksum text form. Block checksums without it (written before it) are not used.
inline constexpr std::string_view kMetaChecksumSeal = "fsdp_ema_checksum_seal";
inline constexpr std::string_view kMetaRank = "fsdp_ema_rank";
inline constexpr std::string_view kMetaWorldSize = "fsdp_ema_world_size";
inline constexpr std::string_view kMetaDcpShardingInfo = "DCP_SHARDING_INFO";
inline constexpr std::string_view kMetaDcpVersion = "DCP_VERSION";
inline constexpr std::string_view kMetaFormat = "format";
// The value of fsdp_ema_format_version this build writes and reads.
inline constexpr int64_t kShardFormatVersion = 1;

// A parsed header plus what its metadata says about each tensor.
struct ShardHeader {
  SafetensorsHeader raw;            // container fields; its entries moved into `tensors`
  std::vector<TensorInfo> tensors;  // file order
  bool fsdp_ema = false;            // has our metadata ("fsdp_ema_format_version")
  std::optional<int64_t> rank;
  std::optional<int64_t> world_size;
  // The block size of the block-checksum extension; 0 when the file has none, or has them
  // without their seal (they are then not used: its tensors are verified by their checksums).
  uint64_t block_bytes = 0;
};

// A private copy-on-write mapping of a whole shard file (ShardFile::map), valid while it lives:
// zero-copy tensors are views of it and keep it alive. Every map() is a mapping of its own, so a
// write through one mapping's bytes stays in it: it reaches neither the file, nor another
// mapping (another load's tensors), nor what a later load reads and verifies.
class ShardMapping {
 public:
  explicit ShardMapping(detail::MappedFile map);
  ~ShardMapping();
  ShardMapping(const ShardMapping&) = delete;
  ShardMapping& operator=(const ShardMapping&) = delete;
  // The tensor's bytes in this mapping (the tensor: one of the mapped file's).
  std::span<const std::byte> data(const TensorInfo& tensor) const;

 private:
  std::unique_ptr<detail::MappedFile> map_;
};

// Interprets the metadata of a parsed header. Our keys are optional (any safetensors file reads),
// but those present must parse and agree with the tensors: DCP_SHARDING_INFO and our global
// shapes and checksums must name exactly the file's tensors, with one offset / size per dimension
// and offsets + shape inside the global shape. With fsdp_ema_format_version present, all of our
// keys and DCP_SHARDING_INFO are required.
ShardHeader interpret_shard_header(SafetensorsHeader raw, const std::string& file);

// One safetensors file, validated at open. Reads go through pread(2) into memory the caller owns,
// hashed in the same pass where asked: a file truncated or rewritten afterwards cannot change
// or crash what was read, and a truncation during a read is a FormatError, never SIGBUS.
// Descriptors come from a small process-wide cache (a reader of thousands of shard files needs no
// descriptor headroom); a file reopened after eviction must still be the same inode, size and
// mtime as at open, or the read is refused. Zero-copy access (map()) maps the file: an explicit
// opt-in with the usual mapping risk (truncating the file then touching the bytes raises SIGBUS,
// as with torch.load(mmap=True) or safetensors' mapping), except in this class's own reads of
// mapped bytes (Bytes::kMapped below), where it is a FormatError. Move-only.
class ShardFile {
 public:
  // Opens and validates the file; with verify_checksums, also checks every stored checksum.
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

  // Zero-copy: a new private copy-on-write mapping of the whole file (ShardMapping), valid
  // while the returned object lives, this ShardFile or not. Opt-in only (see the class comment).
  std::shared_ptr<const ShardMapping> map() const;

  // Reads `length` bytes from byte `offset` of the tensor's data into dst (pread); with `hash`,
  // also feeds them to it, block by block while they are in cache.
  // If the byte at `offset` is not in the page cache (a one-byte RWF_NOWAIT read would wait),
  // asks the kernel to start reading bytes [offset, offset + length) of the file
  // (POSIX_FADV_WILLNEED) and returns without waiting. A hint: it raises nothing, and does
  // nothing where the bytes are cached (nothing to start; the probe is one cheap syscall) or
  // where the file cannot say (a file system without RWF_NOWAIT).
  void prefetch_if_cold(uint64_t offset, uint64_t length) const;
  void read(const TensorInfo& tensor, uint64_t offset, uint64_t length, void* dst,
            Checksummer* hash = nullptr) const;

  // Where the bytes given to the calls below lie: memory of the caller's, or a mapping of this
  // file (map()). Mapped bytes are read only through detail::touch_mapped (mapped_guard.h): when
  // the file shrank under the mapping (truncated after it was made) or a page of it could not be
  // read, the call throws FormatError "<file>: tensor '<name>': bytes A to B could not be read
  // through the file's mapping (SIGBUS): the file shrank ... during the load" instead of the
  // process dying of SIGBUS.
  enum class Bytes : uint8_t { kOwned, kMapped };

  // Throws FormatError "<file>: tensor '<name>': checksum mismatch" unless `digest` (of the
  // tensor's bytes as read) is its stored checksum; nothing to check when it stores none.
  void check_digest(const TensorInfo& tensor, uint64_t digest) const;
  // The checksum of `length` bytes of the tensor from byte `offset`, at `data`; and the same bytes
  // fed to a streaming hash.
  uint64_t digest_of(const TensorInfo& tensor, uint64_t offset, const std::byte* data,
                     uint64_t length, Bytes where = Bytes::kOwned) const;
  void hash_into(const TensorInfo& tensor, uint64_t offset, const std::byte* data, uint64_t length,
                 Checksummer& hash, Bytes where = Bytes::kOwned) const;
  // Checks `length` bytes of the tensor read from byte `offset` against its block checksums
  // (header().block_bytes; a tensor of one block against its checksum): `offset` on a block edge,
  // `length` whole blocks or up to the tensor's end. Throws FormatError naming the file, tensor,
  // block and byte range on a mismatch.
  void check_blocks(const TensorInfo& tensor, uint64_t offset, const std::byte* data,
                    uint64_t length, Bytes where = Bytes::kOwned) const;
  // The data checks of a read on bytes obtained otherwise (a mapping): BOOL bytes are 0 or 1.
  void check_data(const TensorInfo& tensor, uint64_t offset, const std::byte* data, uint64_t length,
                  Bytes where = Bytes::kOwned) const;

  // The verdict on one tensor's bytes, every check any read makes: its stored checksum (true when
  // it matches, false when the file stores none), its block checksums, and the data checks (BOOL
  // bytes are 0 or 1, checksum or not); throws FormatError("<file>: tensor '<name>': ...").
  bool verify(std::string_view name) const;
  bool verify(const TensorInfo& tensor) const;
  // verify() for every tensor in one pass over the data section; returns how many had a checksum.
  size_t verify_all() const;
  // fstat of the descriptor reads go through: throws FormatError "changed since it was opened"
  // when its size, mtime or ctime differ from when the header was validated (an in-place
  // rewrite, even with the same size and its mtime set back).
  void check_unchanged() const;

 private:
  struct Impl;
  explicit ShardFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What an index needs of the fsdp_ema shard file of rank `rank` of `world_size` at `path`, from
// its header (no data read, no checksum verified): rank, world size, file size and tensors; `file`
// is left empty (the caller names it). Throws FormatError unless its metadata says it is that
// rank's file. The commit's build_index_from_files reads every rank's file through it.
ShardDescription describe_shard_file(const std::string& path, int64_t rank, int64_t world_size);

}  // namespace fsdp_ema::format
