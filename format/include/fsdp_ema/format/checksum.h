// Per-tensor checksums: XXH3-64 of the tensor's bytes, written as "xxh3-64:<16 lowercase hex>".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp_ema::format {

// The text form of a checksum, the one place it is written and read: kChecksumPrefix followed by
// kChecksumDigits lowercase hex digits (a block checksum is the digits alone).
inline constexpr std::string_view kChecksumPrefix = "xxh3-64:";
inline constexpr size_t kChecksumDigits = 16;

// "xxh3-64:" followed by 16 lowercase hex digits (always 24 characters).
std::string format_checksum(uint64_t value);

// The 16 hex digits of format_checksum(value), written to out[0..16).
void write_checksum_digits(char* out, uint64_t value);

// The value of a string format_checksum wrote; nullopt for anything else (upper-case hex, other
// lengths, other algorithms).
std::optional<uint64_t> parse_checksum(std::string_view text);
// The value of 16 digits write_checksum_digits wrote; nullopt for anything else.
std::optional<uint64_t> parse_checksum_digits(std::string_view digits);

// How messages name the text form: "16 lowercase hex digits", and the whole form
// "\"xxh3-64:<16 lowercase hex digits>\"".
std::string checksum_digits_text();
std::string checksum_form_text();

// Block checksums (an optional extension of the shard header, FORMAT.md): the bytes of a tensor
// larger than one block are also hashed per block of kChecksumBlockBytes (the last block may be
// shorter), so that a read of part of the tensor verifies only the blocks it touches. A tensor of
// at most one block has one block, whose checksum is the tensor's own.
// 256 KiB: a rank reading its rows of another world size's piece reads at most this much beyond
// its own bytes at each edge (bench/bench_reshard.py), for 64 header bytes per MiB of data.
inline constexpr uint64_t kChecksumBlockBytes = uint64_t{256} << 10;
// Block sizes a reader accepts: powers of two in [kMinChecksumBlockBytes, kMaxChecksumBlockBytes].
inline constexpr uint64_t kMinChecksumBlockBytes = 64;
inline constexpr uint64_t kMaxChecksumBlockBytes = uint64_t{16} << 20;
// Number of blocks of `nbytes` (at least one).
inline uint64_t checksum_blocks(uint64_t nbytes, uint64_t block_bytes) {
  return nbytes <= block_bytes ? 1 : (nbytes + block_bytes - 1) / block_bytes;
}

// XXH3_64bits (seed 0) of the bytes; AVX2 code where the CPU has it, same result everywhere.
uint64_t checksum_of(const void* data, size_t size);
inline uint64_t checksum_of(std::span<const std::byte> bytes) {
  return checksum_of(bytes.data(), bytes.size());
}

// Streaming form: the digest of all updates equals checksum_of of their concatenation.
class Checksummer {
 public:
  Checksummer();
  ~Checksummer();
  Checksummer(Checksummer&& other) noexcept;
  Checksummer& operator=(Checksummer&& other) noexcept;
  Checksummer(const Checksummer&) = delete;
  Checksummer& operator=(const Checksummer&) = delete;

  void reset();
  void update(const void* data, size_t size);
  uint64_t digest() const;

 private:
  void* state_;  // XXH3_state_t, kept out of this header so xxhash stays a private dependency
};

// A tensor's checksum and, when it has more than one block, its block checksums, from the bytes
// in order (any split): what a writer computes on the way to the file, and what a verify checks.
// With blocks of a multiple of 1024 bytes (the writer's 256 KiB) both come from one pass over
// each byte (xxh3_blocks_impl.h); smaller blocks hash each byte twice.
class TensorHasher {
 public:
  // `block_bytes` 0: no block checksums. `nbytes`: exactly the bytes update() will be given.
  TensorHasher(uint64_t nbytes, uint64_t block_bytes);
  ~TensorHasher();
  TensorHasher(TensorHasher&&) noexcept;
  TensorHasher& operator=(TensorHasher&&) noexcept;
  void update(const void* data, size_t size);
  // Call once every byte was fed.
  uint64_t digest() const;
  // Empty unless the tensor has more than one block; call once every byte was fed (it closes
  // the last, shorter block).
  std::vector<uint64_t>& blocks();

 private:
  struct OnePass;  // the one-pass state (nbytes above one block of a multiple of 1024 bytes)

  Checksummer whole_;
  Checksummer block_;
  uint64_t block_bytes_ = 0;  // 0: whole checksum only
  uint64_t in_block_ = 0;     // bytes fed into block_
  std::vector<uint64_t> blocks_;
  std::unique_ptr<OnePass> one_pass_;
};

// The seal of a shard file's block checksums (FORMAT.md §1.2), which binds them to the tensors'
// checksums: XXH3-64 of, for every tensor of more than one block in file order, its checksum then
// its block checksums, each as 8 bytes little-endian. The one place the rule is computed: the
// writer seals, the header parse checks.
class ChecksumSeal {
 public:
  // The next tensor of more than one block, in file order.
  void add(uint64_t checksum, std::span<const uint64_t> blocks);
  uint64_t digest() const { return hash_.digest(); }

 private:
  Checksummer hash_;
};

}  // namespace fsdp_ema::format
