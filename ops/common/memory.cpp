#include "ops/common/memory.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <utility>
#include <vector>

namespace fsdp_ema::ops {
namespace {

// Element offsets [lo, hi] (inclusive) a tensor's elements can reach from its data pointer.
std::pair<int64_t, int64_t> element_span(const at::Tensor& t) {
  int64_t lo = 0, hi = 0;
  for (const auto d : c10::irange(t.dim())) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d);
    (reach < 0 ? lo : hi) += reach;
  }
  return {lo, hi};
}

// One tensor of a call: the bytes [lo, hi) its elements can touch.
struct Extent {
  uintptr_t lo = 0, hi = 0;
  uint32_t device = 0;
  bool written = false;
  bool dense = false;  // its elements cover [lo, hi) exactly: meeting extents mean shared bytes
  size_t index = 0;    // in its list
  const at::Tensor* tensor = nullptr;
};

uint32_t device_key(const at::Device& d) {
  return (static_cast<uint32_t>(d.type()) << 16) | static_cast<uint32_t>(d.index() + 1);
}

Extent extent_of(const at::Tensor& t, bool written, size_t index) {
  const auto [lo, hi] = element_span(t);
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto size = static_cast<uintptr_t>(t.element_size());
  return {base + static_cast<uintptr_t>(lo) * size,
          base + static_cast<uintptr_t>(hi + 1) * size,
          device_key(t.device()),
          written,
          t.is_non_overlapping_and_dense(),
          index,
          &t};
}

// Calls f(address) for the first byte of every element of t.
template <typename F>
void for_each_element(const at::Tensor& t, F&& f) {
  const int64_t dims = t.dim();
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto size = static_cast<intptr_t>(t.element_size());
  std::vector<int64_t> index(dims, 0);
  int64_t offset = 0;
  for (int64_t n = 0; n < t.numel(); ++n) {
    f(base + static_cast<uintptr_t>(offset * size));
    for (int64_t d = dims - 1; d >= 0; --d) {
      offset += t.stride(d);
      if (++index[d] < t.size(d)) break;
      offset -= index[d] * t.stride(d);
      index[d] = 0;
    }
  }
}

// Pairs a component (extents whose spans chain together) may check one by one before the byte
// map is cheaper: many views interleaved over one buffer would make the pairs quadratic.
constexpr size_t kPairBudgetPerExtent = 8;
constexpr size_t kPairBudgetBase = 4096;
// The byte map of one component: 2 GiB of span, 256 MiB of bits.
constexpr uintptr_t kMaxMappedBytes = uintptr_t{1} << 31;

using Conflict = std::function<bool(const Extent&, const Extent&)>;  // false: stop
// Extents [first, last) interleave over more memory than the byte map takes. False: stop.
using Undecided = std::function<bool(const Extent* first, const Extent* last)>;

class OverlapFinder {
 public:
  OverlapFinder(Conflict on_conflict, Undecided on_undecided)
      : on_conflict_(std::move(on_conflict)), on_undecided_(std::move(on_undecided)) {}

  void add(const at::Tensor& t, bool written, size_t index) {
    if (t.numel() > 0) extents_.push_back(extent_of(t, written, index));
  }

  void run() {
    std::sort(extents_.begin(), extents_.end(), [](const Extent& a, const Extent& b) {
      return a.device != b.device ? a.device < b.device : a.lo < b.lo;
    });
    size_t first = 0;
    while (first < extents_.size()) {
      size_t last = first + 1;
      uintptr_t hi = extents_[first].hi;
      bool any_written = extents_[first].written;
      while (last < extents_.size() && extents_[last].device == extents_[first].device &&
             extents_[last].lo < hi) {
        hi = std::max(hi, extents_[last].hi);
        any_written = any_written || extents_[last].written;
        ++last;
      }
      if (last - first > 1 && any_written && !component(first, last)) return;
      first = last;
    }
  }

 private:
  // Extents [first, last) of one component, sorted by lo. False once on_conflict said stop.
  bool component(size_t first, size_t last) {
    const size_t budget = kPairBudgetPerExtent * (last - first) + kPairBudgetBase;
    size_t pairs = 0;
    std::vector<const Extent*> active;
    for (size_t k = first; k < last; ++k) {
      const Extent& e = extents_[k];
      std::erase_if(active, [&](const Extent* a) { return a->hi <= e.lo; });
      for (const Extent* a : active) {
        if (!a->written && !e.written) continue;
        if (++pairs > budget) return byte_map(first, last);
        if (a->dense && e.dense) {
          if (!on_conflict_(e, *a)) return false;
          continue;
        }
        const auto status = at::get_overlap_status(*a->tensor, *e.tensor);
        if (status == at::MemOverlapStatus::TooHard) return byte_map(first, last);
        if (status != at::MemOverlapStatus::No && !on_conflict_(e, *a)) return false;
      }
      active.push_back(&e);
    }
    return true;
  }

  // Every byte of the component's span: written tensors mark theirs (a byte marked twice is
  // shared), read tensors only look (a marked byte is one they share with a written tensor).
  bool byte_map(size_t first, size_t last) {
    uintptr_t lo = extents_[first].lo, hi = 0;
    for (size_t k = first; k < last; ++k) hi = std::max(hi, extents_[k].hi);
    if (hi - lo > kMaxMappedBytes) {
      return on_undecided_(extents_.data() + first, extents_.data() + last);
    }
    std::vector<bool> used(hi - lo, false);
    for (const bool marking : {true, false}) {
      for (size_t k = first; k < last; ++k) {
        const Extent& e = extents_[k];
        if (e.written != marking) continue;
        const auto size = static_cast<uintptr_t>(e.tensor->element_size());
        std::optional<uintptr_t> hit;
        for_each_element(*e.tensor, [&](uintptr_t p) {
          for (uintptr_t b = p - lo; b < p - lo + size; ++b) {
            if (used[b] && !hit) hit = p;
            if (marking) used[b] = true;
          }
        });
        if (hit && !on_conflict_(e, partner(first, last, k, *hit, size))) return false;
      }
    }
    return true;
  }

  // Another tensor of the component that touches [p, p + size): the one `self` collided with.
  const Extent& partner(size_t first, size_t last, size_t self, uintptr_t p, uintptr_t size) {
    for (size_t k = first; k < last; ++k) {
      const Extent& e = extents_[k];
      if (k == self || (!e.written && !extents_[self].written) || e.hi <= p || e.lo >= p + size) {
        continue;
      }
      const auto esize = static_cast<uintptr_t>(e.tensor->element_size());
      bool touches = false;
      for_each_element(*e.tensor,
                       [&](uintptr_t q) { touches = touches || (q < p + size && p < q + esize); });
      if (touches) return e;
    }
    return extents_[self == first ? first + 1 : first];  // unreachable: the byte was marked
  }

  Conflict on_conflict_;
  Undecided on_undecided_;
  std::vector<Extent> extents_;
};

// Whether two elements of the strided tensor t share memory. torch answers where it can (a zero
// stride over more than one element: yes; non-overlapping and dense: no) and calls the rest "too
// hard" (a transposed slice, as_strided((100, 8), (1, 1))): then no when each dimension, by
// increasing stride, steps past everything the smaller ones reach (every slice and permutation of
// a dense tensor); else an element map of the memory it spans (exact; nullopt: more than
// kMaxMappedBytes elements to map). Called on tensors inside their storage.
std::optional<bool> self_overlap(const at::Tensor& t) {
  switch (at::has_internal_overlap(t)) {
    case at::MemOverlap::Yes:
      return true;
    case at::MemOverlap::No:
      return false;
    case at::MemOverlap::TooHard:
      break;
  }
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size) of dims of 2+ elements
  for (const auto d : c10::irange(t.dim())) {
    if (t.size(d) > 1) dims.emplace_back(std::abs(t.stride(d)), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // how far (in elements) the smaller dimensions reach
  bool separated = true;
  for (const auto& [stride, size] : dims) {
    separated = separated && stride > reach;
    reach += stride * (size - 1);
  }
  if (separated) return false;
  const auto [lo, hi] = element_span(t);
  if (static_cast<uint64_t>(hi - lo) >= kMaxMappedBytes) return std::nullopt;
  std::vector<bool> used(static_cast<size_t>(hi - lo + 1), false);
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto size = static_cast<intptr_t>(t.element_size());
  bool shared = false;
  for_each_element(t, [&](uintptr_t p) {
    const auto k = static_cast<size_t>((static_cast<intptr_t>(p - base)) / size - lo);
    shared = shared || used[k];
    used[k] = true;
  });
  return shared;
}

}  // namespace

void check_strided(const char* op, const at::Tensor& t, const Label& label, size_t index) {
  TORCH_CHECK(t.layout() == at::kStrided, op, label(index), " is a ", t.layout(),
              " tensor; pass a dense (strided) tensor");
}

void check_in_storage(const char* op, const at::Tensor& t, const Label& label, size_t index,
                      bool written) {
  if (t.numel() == 0) return;
  const auto [lo, hi] = element_span(t);
  const int64_t first = t.storage_offset() + lo;
  const uint64_t needed = static_cast<uint64_t>(t.storage_offset() + hi + 1) * t.element_size();
  const uint64_t held = t.storage().nbytes();
  TORCH_CHECK(first >= 0 && needed <= held, op, label(index), " reaches ", needed,
              " bytes into its storage, which holds ", held,
              " (was the storage resized under the tensor?); writing or reading it would run "
              "past the end");
  if (written) {
    const std::optional<bool> shared = self_overlap(t);
    TORCH_CHECK(shared.has_value(), op, "cannot check that no two elements of ", label(index),
                " share memory: its strides interleave over more than ", kMaxMappedBytes,
                " elements; pass a contiguous tensor");
    TORCH_CHECK(!*shared, op, label(index),
                " has internally overlapping memory (two of its elements share memory: an "
                "expanded or as_strided view?) and cannot be written in place");
  }
}

void check_no_overlap(const char* op, TensorList written, const Label& written_label,
                      TensorList read, const Label& read_label, const std::string& why) {
  auto name = [&](const Extent& e) {
    return e.written ? written_label(e.index) : read_label(e.index);
  };
  OverlapFinder finder(
      [&](const Extent& a, const Extent& b) -> bool {
        // The written one first; of two written ones, the later in the list.
        const bool a_first = a.written && (!b.written || a.index > b.index);
        const Extent& x = a_first ? a : b;
        const Extent& y = a_first ? b : a;
        TORCH_CHECK(false, op, name(x), " overlaps ", name(y), " in memory", why);
      },
      [&](const Extent* first, const Extent* last) -> bool {
        TORCH_CHECK(false, op, "cannot check that ", name(*first), " and ", last - first - 1,
                    " other tensor(s) share no memory: they are strided views interleaved over ",
                    "more than ", kMaxMappedBytes >> 30, " GiB; pass contiguous tensors");
      });
  for (const auto i : c10::irange(written.size())) finder.add(written[i], true, i);
  for (const auto i : c10::irange(read.size())) finder.add(read[i], false, i);
  finder.run();
}

std::vector<int64_t> overlapping(TensorList tensors) {
  std::vector<bool> hit(tensors.size(), false);
  OverlapFinder finder(
      [&](const Extent& a, const Extent& b) {
        hit[a.index] = hit[b.index] = true;
        return true;
      },
      [&](const Extent* first, const Extent* last) {  // counted as overlapping: the safe side
        for (; first != last; ++first) hit[first->index] = true;
        return true;
      });
  for (const auto i : c10::irange(tensors.size())) finder.add(tensors[i], true, i);
  finder.run();
  std::vector<int64_t> out;
  for (const auto i : c10::irange(tensors.size())) {
    if (hit[i]) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

std::vector<int64_t> overlapping_destinations(TensorList tensors,
                                              const std::vector<std::string>& names) {
  constexpr const char* kOp = "fsdp_ema::overlapping: ";
  TORCH_CHECK(names.empty() || names.size() == tensors.size(), kOp, "names has ", names.size(),
              " entries but tensors has ", tensors.size());
  const Label label = [&](size_t i) {
    return "tensors[" + std::to_string(i) + "]" + (names.empty() ? "" : " ('" + names[i] + "')");
  };
  for (const auto i : c10::irange(tensors.size())) {
    TORCH_CHECK(tensors[i].defined(), kOp, label(i), " is an undefined tensor");
    check_strided(kOp, tensors[i], label, i);
    check_in_storage(kOp, tensors[i], label, i, /*written=*/true);
  }
  return overlapping(tensors);
}

void bump_versions(TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined()) t.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace fsdp_ema::ops
