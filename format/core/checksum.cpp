#include "fsdp_ema/format/checksum.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
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

// The XXH3 state is allocated by the first update (a TensorHasher in one-pass mode never needs it).
Checksummer::Checksummer() : state_(nullptr) {}

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
  if (state_ != nullptr) ops().reset(state_);
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

// The one-pass state: the lanes of the whole tensor and of its current block, fed whole units
// (kXxh3UnitBytes) straight from the caller's memory; a unit split across updates is gathered
// in `carry` first. The tensor's last unit (1 to 1024 bytes) closes both hashes.
struct TensorHasher::OnePass {
  static constexpr size_t kUnit = detail::kXxh3UnitBytes;
  static constexpr size_t kStripe = 64;

  OnePass(uint64_t n, uint64_t block) : nbytes(n), block_bytes(block), last_unit((n - 1) / kUnit) {
    ops().lanes_init(whole);
    ops().lanes_init(block_lanes);
  }

  // `n` units at p, all before the last one.
  void units(const std::byte* p, uint64_t n, std::vector<uint64_t>& blocks) {
    const uint64_t per_block = block_bytes / kUnit;
    const std::byte* end = p + n * kUnit;
    while (n > 0) {
      const uint64_t to_block_end = per_block - units_done % per_block;
      const uint64_t k = std::min(n, to_block_end);
      ops().lanes_units(whole, block_lanes, p, static_cast<size_t>(k), k == to_block_end);
      if (k == to_block_end) {
        blocks.push_back(ops().lanes_merge(block_lanes, block_bytes));
        ops().lanes_init(block_lanes);
      }
      units_done += k;
      p += k * kUnit;
      n -= k;
    }
    std::memcpy(prev_tail, end - kStripe, kStripe);
  }

  // The last unit (`rem` bytes at p): both digests.
  void finish(const std::byte* p, std::vector<uint64_t>& blocks) {
    const size_t rem = static_cast<size_t>(nbytes - last_unit * kUnit);
    std::byte joined[kStripe];  // the last stripe, when it begins in the unit before
    const std::byte* last_stripe = p + rem - kStripe;
    if (rem < kStripe) {
      std::memcpy(joined, prev_tail + rem, kStripe - rem);
      std::memcpy(joined + (kStripe - rem), p, rem);
      last_stripe = joined;
    }
    ops().lanes_tail(whole, p, rem, last_stripe);
    digest = ops().lanes_merge(whole, nbytes);
    const uint64_t block_len = nbytes - (nbytes - 1) / block_bytes * block_bytes;
    if (block_len <= 240) {
      // XXH3's short-input rule; such a block begins with the last unit (blocks begin at
      // multiples of the unit, and only the last unit can hold fewer than 241 bytes of one).
      blocks.push_back(checksum_of(p, rem));
    } else {
      ops().lanes_tail(block_lanes, p, rem, last_stripe);
      blocks.push_back(ops().lanes_merge(block_lanes, block_len));
    }
    done = true;
  }

  void update(const std::byte* p, size_t size, std::vector<uint64_t>& blocks) {
    while (size > 0 && !done) {
      const bool last = units_done == last_unit;
      const size_t want = last ? static_cast<size_t>(nbytes - last_unit * kUnit) : kUnit;
      size_t take = 0;
      if (carry_n == 0 && size >= want) {  // straight from the caller's bytes
        if (last) {
          finish(p, blocks);
          take = want;
        } else {
          const uint64_t n = std::min<uint64_t>(size / kUnit, last_unit - units_done);
          units(p, n, blocks);
          take = static_cast<size_t>(n * kUnit);
        }
      } else {
        take = std::min(want - carry_n, size);
        std::memcpy(carry + carry_n, p, take);
        carry_n += take;
        if (carry_n == want) {
          carry_n = 0;
          if (last) {
            finish(carry, blocks);
          } else {
            units(carry, 1, blocks);
          }
        }
      }
      p += take;
      size -= take;
    }
  }

  alignas(64) uint64_t whole[8];
  alignas(64) uint64_t block_lanes[8];
  const uint64_t nbytes;
  const uint64_t block_bytes;
  const uint64_t last_unit;  // index of the tensor's last unit
  uint64_t units_done = 0;   // units fed before the last one
  size_t carry_n = 0;
  std::byte carry[kUnit];
  std::byte prev_tail[kStripe];  // the last 64 bytes of the last unit fed
  uint64_t digest = 0;
  bool done = false;
};

TensorHasher::TensorHasher(uint64_t nbytes, uint64_t block_bytes)
    : block_bytes_(block_bytes > 0 && nbytes > block_bytes ? block_bytes : 0) {
  if (block_bytes_ == 0) return;
  blocks_.reserve(checksum_blocks(nbytes, block_bytes_));
  if (block_bytes_ % detail::kXxh3UnitBytes == 0) {
    one_pass_ = std::make_unique<OnePass>(nbytes, block_bytes_);
  }
}

TensorHasher::~TensorHasher() = default;
TensorHasher::TensorHasher(TensorHasher&&) noexcept = default;
TensorHasher& TensorHasher::operator=(TensorHasher&&) noexcept = default;

void TensorHasher::update(const void* data, size_t size) {
  if (one_pass_) {
    one_pass_->update(static_cast<const std::byte*>(data), size, blocks_);
    return;
  }
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

uint64_t TensorHasher::digest() const { return one_pass_ ? one_pass_->digest : whole_.digest(); }

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
  if (!one_pass_ && in_block_ > 0) {  // the last, shorter block
    blocks_.push_back(block_.digest());
    block_.reset();
    in_block_ = 0;
  }
  return blocks_;
}

}  // namespace fsdp_ema::format
