#include "ops/checkpoint/checkpoint_info.h"

#include <span>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/json_writer.h"
#include "fsdp_ema/ops.h"
#include "ops/common/dispatch.h"
#include "ops/common/format_bridge.h"

namespace fsdp_ema::ops {

std::string info_json(const format::CheckpointDir& dir) {
  format::JsonWriter j;
  j.begin_object().key("layout").value(format::layout_name(dir.layout()));
  j.key("world_size").value(dir.world_size()).key("tensors").begin_object();
  for (const auto& t : dir.tensors()) {
    j.key(t.name).begin_object();
    j.key("dtype").value(format::dtype_name(t.dtype));
    j.key("torch_dtype").value(format::python_dtype_name(t.dtype));
    j.key("shape").array(std::span<const int64_t>(t.shape));
    j.end_object();
  }
  j.end_object().key("metadata").begin_object();
  for (const auto& [k, v] : dir.index().metadata) j.key(k).value(v);
  return j.end_object().end_object().str();
}

std::string checkpoint_info(c10::string_view directory) {
  constexpr const char* kOp = "fsdp_ema::checkpoint_info: ";
  return translate_errors(
      kOp, [&] { return info_json(format::CheckpointDir::open(std::string(directory))); });
}

}  // namespace fsdp_ema::ops

// --- the public C++ API (include/fsdp_ema/ops.h): through the dispatcher ------------------------
namespace fsdp_ema {

std::string checkpoint_info(const std::string& directory) {
  static const auto op = ops::typed_op<std::string(c10::string_view)>("fsdp_ema::checkpoint_info");
  return op.call(directory);
}

}  // namespace fsdp_ema
