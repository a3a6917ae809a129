#include "ops/queries/queries.h"

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/json_writer.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/rows.h"
#include "fsdp_ema/ops.h"
#include "kernels/update_cpu.h"
#include "ops/common/dispatch.h"
#include "ops/common/format_bridge.h"

namespace fsdp_ema::ops {

std::string index_file_name() { return std::string(format::kIndexFileName); }

std::string shard_file_name(int64_t rank, int64_t world_size) {
  check_rank("fsdp_ema::shard_file_name: ", rank, world_size);
  return format::shard_file_name(rank, world_size);
}

std::vector<std::string> training_state_names() {
  return {std::string(format::kTrainingStateDocTensor),
          std::string(format::kTrainingStateEmaPrefix),
          std::string(format::kTrainingStateModelPrefix)};
}

std::vector<int64_t> chunk_rows(int64_t rows, int64_t rank, int64_t world_size) {
  constexpr const char* kOp = "fsdp_ema::chunk_rows: ";
  check_rank(kOp, rank, world_size);
  TORCH_CHECK(rows >= 0, kOp, "rows must be >= 0, got ", rows);
  const format::RowRange r = format::chunk_rows(rows, rank, world_size);
  return {r.begin, r.end};
}

std::string dtypes() {
  format::JsonWriter j;
  j.begin_array();
  for (const format::DType d : format::all_dtypes()) {
    j.begin_object().key("name").value(format::dtype_name(d));
    j.key("torch").value(format::python_dtype_name(d));
    j.key("size").value(static_cast<int64_t>(format::dtype_size(d)));
    j.key("floating").value(format::is_floating(d)).key("roles").begin_array();
    if (format::has_role(d, format::kRoleEma)) j.value("ema");
    if (format::has_role(d, format::kRoleModel)) j.value("model");
    if (format::has_role(d, format::kRoleCast)) j.value("cast");
    j.end_array().end_object();
  }
  return j.end_array().str();
}

std::string cpu_capability() { return kernels::update_cpu_capability(); }

}  // namespace fsdp_ema::ops

// --- the public C++ API (include/fsdp_ema/ops.h)
// ---------------------------------------------------
namespace fsdp_ema {

std::pair<int64_t, int64_t> chunk_rows(int64_t rows, int64_t rank, int64_t world_size) {
  static const auto op =
      ops::typed_op<std::vector<int64_t>(int64_t, int64_t, int64_t)>("fsdp_ema::chunk_rows");
  const std::vector<int64_t> r = op.call(rows, rank, world_size);
  return {r[0], r[1]};
}

bool built_with_cuda() {
#if defined(FSDP_EMA_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

}  // namespace fsdp_ema
