// fsdp_ema::checkpoint_info: a JSON description of a checkpoint directory.
#pragma once

#include <c10/util/string_view.h>

#include <string>

#include "fsdp_ema/format/checkpoint_dir.h"

namespace fsdp_ema::ops {

// JSON: {"layout", "world_size", "tensors": {name: {"dtype", "torch_dtype", "shape"}},
// "metadata"}; "torch_dtype" is the torch attribute name ("float32").
std::string checkpoint_info(c10::string_view directory);
// The same of a directory opened already.
std::string info_json(const format::CheckpointDir& dir);

}  // namespace fsdp_ema::ops
