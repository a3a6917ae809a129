// Host side of load_into_: a committed checkpoint read into existing tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <string>
#include <vector>

namespace fsdp_ema::ops {

// Reads the named tensors of the committed checkpoint `directory` (ours, or a DCP HuggingFace
// directory) into `out`: whole for world_size == 1, else the dim-0 rows rank `rank` of
// `world_size` holds (torch.chunk semantics).
//   names: [N]  fully qualified names
//   out:   [N]  destinations (CPU or CUDA, any strides) of the stored dtype and of the shape of
//               the rows read; no two may share memory
// Validates every destination and (verify) hashes every stored piece it reads before writing
// any destination. A file modified while the call runs raises, and may leave destinations
// partly written.
void load_into_(c10::string_view directory, const std::vector<std::string>& names,
                at::TensorList out, int64_t rank, int64_t world_size, bool verify);

// Tracing: the same checks against the index (no tensor data read, nothing written).
void load_into_meta(c10::string_view directory, const std::vector<std::string>& names,
                    at::TensorList out, int64_t rank, int64_t world_size, bool verify);

}  // namespace fsdp_ema::ops
