// The ops that tell the Python front (and C++ callers) the rules that live in C++, so that Python
// never keeps a copy of one: file names (fsdp_ema/format/names.h), the rows of a rank
// (fsdp_ema/format/rows.h), the dtype table (fsdp_ema/format/dtype_table.h), and the CPU kernel's
// instruction set.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_ema::ops {

// "fsdp_ema.index.json": the commit marker.
std::string index_file_name();
// The name rank `rank` of `world_size` writes its shard file under.
std::string shard_file_name(int64_t rank, int64_t world_size);
// A training-state checkpoint's tensor names: its JSON document's tensor, the EMA's prefix and
// the model's prefix ("meta.training_state", "ema.", "model.").
std::vector<std::string> training_state_names();
// [begin, end): the dim-0 rows torch.chunk(tensor, world_size)[rank] holds of `rows` rows.
std::vector<int64_t> chunk_rows(int64_t rows, int64_t rank, int64_t world_size);
// JSON: [{"name": "F32", "torch": "float32", "size": 4, "floating": true,
// "roles": ["ema", "model", "cast"]}, ...], every dtype of the table in its order.
std::string dtypes();
// "avx512", "avx2" or "default": the CPU update kernel in use (capped by ATEN_CPU_CAPABILITY).
std::string cpu_capability();

}  // namespace fsdp_ema::ops
