#include "fsdp_ema/format/checksum.h"

#include <algorithm>
#include <cstddef>
#include <random>
#include <utility>

#include "fsdp_ema/format/name_hash.h"
#include "fsdp_ema/format/xxh3_ops.h"

namespace fsdp_ema::format {
namespace {

const detail::Xxh3Ops& ops() {
  static const detail::Xxh3Ops& chosen = []() -> const detail::Xxh3Ops& {
#if defined(FSDP_EMA_FORMAT_HAVE_AVX2)
    if (__builtin_cpu_supports("avx2")) return detail::kXxh3Avx2;
#endif
    return detail::kXxh3Default;
  }();
  return chosen;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

}  // namespace

void write_checksum_digits(char* out, uint64_t value) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (int i = static_cast<int>(kChecksumDigits) - 1; i >= 0; --i) {
    out[i] = kHex[value & 0xf];
    value >>= 4;
  }
}

std::string format_checksum(uint64_t value) {
  std::string out(kChecksumPrefix);
  out.resize(kChecksumPrefix.size() + kChecksumDigits);
  write_checksum_digits(out.data() + kChecksumPrefix.size(), value);
  return out;
}

std::optional<uint64_t> parse_checksum_digits(std::string_view digits) {
  if (digits.size() != kChecksumDigits) return std::nullopt;
  uint64_t value = 0;
  for (char c : digits) {
    const int v = hex_value(c);
    if (v < 0) return std::nullopt;
    value = (value << 4) | static_cast<uint64_t>(v);
  }
  return value;
}

std::optional<uint64_t> parse_checksum(std::string_view text) {
  if (!text.starts_with(kChecksumPrefix)) return std::nullopt;
  return parse_checksum_digits(text.substr(kChecksumPrefix.size()));
}

std::string checksum_digits_text() {
  return std::to_string(kChecksumDigits) + " lowercase hex digits";
}

std::string checksum_form_text() {
  return "\"" + std::string(kChecksumPrefix) + "<" + checksum_digits_text() + ">\"";
}

uint64_t checksum_of(const void* data, size_t size) { return ops().oneshot(data, size); }

uint64_t detail::name_hash(std::string_view s) {
  // Drawn once, before the first table is filled; never written to a file or shown.
  static const uint64_t seed = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  // Names are short: the baseline code is as fast as the AVX2 one for them.
  return detail::kXxh3Default.seeded(s.data(), s.size(), seed);
}

Checksummer::Checksummer() : state_(ops().create()) {}

Checksummer::~Checksummer() {
  if (state_ != nullptr) ops().destroy(state_);
}

Checksummer::Checksummer(Checksummer&& other) noexcept
    : state_(std::exchange(other.state_, nullptr)) {}

Checksummer& Checksummer::operator=(Checksummer&& other) noexcept {
  if (this != &other) {
    if (state_ != nullptr) ops().destroy(state_);
    state_ = std::exchange(other.state_, nullptr);
  }
  return *this;
}

void Checksummer::reset() {
  if (state_ == nullptr) state_ = ops().create();
  ops().reset(state_);
}

void Checksummer::update(const void* data, size_t size) {
  if (size == 0) return;
  if (state_ == nullptr) state_ = ops().create();
  ops().update(state_, data, size);
}

uint64_t Checksummer::digest() const {
  if (state_ == nullptr) return checksum_of(nullptr, 0);
  return ops().digest(state_);
}

TensorHasher::TensorHasher(uint64_t nbytes, uint64_t block_bytes)
    : block_bytes_(block_bytes > 0 && nbytes > block_bytes ? block_bytes : 0) {
  if (block_bytes_ > 0) blocks_.reserve(checksum_blocks(nbytes, block_bytes_));
}

void TensorHasher::update(const void* data, size_t size) {
  whole_.update(data, size);
  if (block_bytes_ == 0) return;
  const auto* p = static_cast<const std::byte*>(data);
  while (size > 0) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(size, block_bytes_ - in_block_));
    if (in_block_ == 0 && take == block_bytes_) {
      blocks_.push_back(checksum_of(p, take));  // a whole block at once: no streaming state
    } else {
      block_.update(p, take);
      in_block_ += take;
      if (in_block_ == block_bytes_) {
        blocks_.push_back(block_.digest());
        block_.reset();
        in_block_ = 0;
      }
    }
    p += take;
    size -= take;
  }
}

void ChecksumSeal::add(uint64_t checksum, std::span<const uint64_t> blocks) {
  auto feed = [this](uint64_t v) {
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(v >> (8 * i));
    hash_.update(le, sizeof(le));
  };
  feed(checksum);
  for (const uint64_t b : blocks) feed(b);
}

std::vector<uint64_t>& TensorHasher::blocks() {
  if (in_block_ > 0) {  // the last, shorter block
    blocks_.push_back(block_.digest());
    block_.reset();
    in_block_ = 0;
  }
  return blocks_;
}

}  // namespace fsdp_ema::format
