// Internal: names -> positions, for the 100,000+ tensor names of one header or index. Open
// addressing over views of names the caller keeps alive: no allocation per entry (a node-based
// std::unordered_map cost a malloc and a free per name, a third of a 200k-tensor verify). Keyed
// by the seeded name_hash (name_hash.h), so names a file chose cannot collide on purpose.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/name_hash.h"

namespace fsdp_ema::format::detail {

class NameIndex {
 public:
  NameIndex() = default;
  // Never copied or moved (locals and a unique_ptr), so its probes are counted once, here.
  NameIndex(const NameIndex&) = delete;
  NameIndex& operator=(const NameIndex&) = delete;
  ~NameIndex() { thread_probes() += probes_; }

  // Adds name -> pos unless the name is there already; returns the position it had then.
  std::optional<size_t> insert(std::string_view name, size_t pos) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    const uint64_t h = hash(name);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      ++probes_;
      Slot& s = slots_[i];
      if (s.pos == kEmpty) {
        s = {h, name, pos};
        ++size_;
        return std::nullopt;
      }
      if (s.hash == h && s.name == name) return s.pos;
    }
  }

  std::optional<size_t> find(std::string_view name) const {
    if (size_ == 0) return std::nullopt;
    const uint64_t h = hash(name);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      ++probes_;
      const Slot& s = slots_[i];
      if (s.pos == kEmpty) return std::nullopt;
      if (s.hash == h && s.name == name) return s.pos;
    }
  }

  void reserve(size_t n) {
    while (slots_.size() < 2 * n) grow();
  }
  size_t size() const { return size_; }
  // Slots visited by every insert and find so far: the work a file's names cost (tests bound it).
  size_t probes() const { return probes_; }
  // The probes of every NameIndex this thread has destroyed: lets a test bound the work a whole
  // parse did on crafted names by counting, not by a clock.
  static size_t& thread_probes() {
    static thread_local size_t total = 0;
    return total;
  }

 private:
  static constexpr size_t kEmpty = static_cast<size_t>(-1);
  struct Slot {
    uint64_t hash = 0;
    std::string_view name;
    size_t pos = kEmpty;
  };
  static uint64_t hash(std::string_view s) { return name_hash(s); }

  void grow() {
    std::vector<Slot> old(std::max<size_t>(16, slots_.size() * 2));
    old.swap(slots_);
    mask_ = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.pos == kEmpty) continue;
      size_t i = s.hash & mask_;
      while (slots_[i].pos != kEmpty) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
  mutable size_t probes_ = 0;
};

}  // namespace fsdp_ema::format::detail
