// The memory rules of the ops that write into tensors the caller owns (update_, update_multi_,
// load_into_): which tensors may be written, exact overlap between them, and autograd's version
// counter. One place for what update_ and load_into_ each checked their own way.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp_ema::ops {

using TensorList = c10::ArrayRef<at::Tensor>;
// Names tensor i of a list in an error message ("ema[3]", "out[2] ('w')"); called on errors only.
using Label = std::function<std::string(size_t)>;

// t is a dense (strided) tensor, not sparse or mkldnn. Safe on tracers' fake tensors.
void check_strided(const char* op, const at::Tensor& t, const Label& label, size_t index);

// Every element of the (real, strided) tensor t lies inside its storage (a storage shrunk under
// the tensor with untyped_storage().resize_() would have us run past its end and corrupt the
// heap) and, when `written`, no two of its elements share memory: exact, for expanded tensors and
// for views torch calls too hard to decide (as_strided((100, 8), (1, 1))); a view whose strides
// interleave over more than 2^31 elements is refused as undecidable. Throws "<op><label> ..."
// otherwise.
void check_in_storage(const char* op, const at::Tensor& t, const Label& label, size_t index,
                      bool written);

// No tensor of `written` shares a byte of memory with any other tensor of either list; tensors
// of `read` may share with each other. Exact for strided views (interleaved disjoint views such
// as x[0::2] and x[1::2] are fine): sorted extents, and for the tensors whose extents meet, ATen's
// overlap status or, for strided views it cannot decide, a byte map of the memory they span.
// Throws "<op><a> overlaps <b> in memory<why>".
void check_no_overlap(const char* op, TensorList written, const Label& written_label,
                      TensorList read, const Label& read_label, const std::string& why);

// Indices of the tensors of `tensors` that share memory with another of them (tied weights), in
// increasing order: the same exact rule, reported instead of thrown.
std::vector<int64_t> overlapping(TensorList tensors);
// The overlapping op: the destinations of a load, each first checked as memory the load will
// write (check_strided, check_in_storage with `written`; errors name "tensors[i] ('names[i]')"),
// then overlapping(tensors). `names` empty, or one per tensor.
std::vector<int64_t> overlapping_destinations(TensorList tensors,
                                              const std::vector<std::string>& names);

// Bumps the autograd version counter of every tensor, as torch's in-place ops do, so that a
// tensor saved for backward and then written by us makes backward raise instead of computing
// with the new values. Called once a call is validated, before its first write.
void bump_versions(TensorList tensors);

}  // namespace fsdp_ema::ops
