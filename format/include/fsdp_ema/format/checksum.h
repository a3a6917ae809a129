// Per-tensor checksums: XXH3-64 of the tensor's bytes, written as "xxh3-64:<16 lowercase hex>".
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace fsdp_ema::format {

inline constexpr std::string_view kChecksumPrefix = "xxh3-64:";

// "xxh3-64:" followed by 16 lowercase hex digits (always 24 characters).
std::string format_checksum(uint64_t value);

// The 16 hex digits of format_checksum(value), written to out[0..16).
void write_checksum_digits(char* out, uint64_t value);

// The value of a string format_checksum wrote; nullopt for anything else (upper-case hex, other
// lengths, other algorithms).
std::optional<uint64_t> parse_checksum(std::string_view text);

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

}  // namespace fsdp_ema::format
