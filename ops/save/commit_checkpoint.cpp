#include "ops/save/commit_checkpoint.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <map>
#include <string>
#include <vector>

#include "fsdp_ema/format/layout.h"
#include "fsdp_ema/ops.h"
#include "ops/common/dispatch.h"
#include "ops/common/format_bridge.h"
#include "ops/common/tracing.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::commit_checkpoint: ";

// Every check of a commit that needs no file; `tracing` (the Meta kernel): also that `after`
// holds no real meta tensor (a call on those outside tracing would commit nothing).
void validate_commit(int64_t world_size, at::TensorList after, bool tracing) {
  TORCH_CHECK(world_size >= 1, kOp, "world_size must be >= 1, got ", world_size);
  for (const auto i : c10::irange(after.size())) {
    TORCH_CHECK(!tracing || !is_real_meta(after[i]), kOp, "after[", i,
                "] is a meta tensor: a call on meta tensors outside tracing would commit nothing");
  }
}

// The index's "metadata" from key, value pairs: an odd count or a repeated key is refused.
std::map<std::string, std::string> metadata_map(const std::vector<std::string>& pairs) {
  TORCH_CHECK(pairs.size() % 2 == 0, kOp, "metadata must hold key, value pairs, got ", pairs.size(),
              " strings");
  std::map<std::string, std::string> out;
  for (size_t i = 0; i < pairs.size(); i += 2) {
    TORCH_CHECK(out.emplace(pairs[i], pairs[i + 1]).second, kOp, "metadata[", i, "]: the key \"",
                pairs[i], "\" is given twice");
  }
  return out;
}

}  // namespace

int64_t commit_with_metadata(c10::string_view directory, int64_t world_size,
                             const std::vector<std::string>& metadata, bool overwrite, bool fsync) {
  validate_commit(world_size, {}, false);
  auto entries = metadata_map(metadata);
  return translate_errors(kOp, [&] {
    return static_cast<int64_t>(format::commit_directory(std::string(directory), world_size,
                                                         overwrite, fsync, std::move(entries))
                                    .tensors.size());
  });
}

int64_t commit_checkpoint(c10::string_view directory, int64_t world_size, bool overwrite,
                          bool fsync) {
  return commit_with_metadata(directory, world_size, {}, overwrite, fsync);
}

at::Tensor commit_after(c10::string_view directory, int64_t world_size, at::TensorList after,
                        bool overwrite, bool fsync) {
  validate_commit(world_size, after, false);
  // Each save_shard in `after` wrote its file before it returned: nothing to wait for.
  const int64_t n = commit_checkpoint(directory, world_size, overwrite, fsync);
  return at::scalar_tensor(n, at::TensorOptions().dtype(at::kLong).device(result_device(after)));
}

at::Tensor commit_after_meta(c10::string_view directory, int64_t world_size, at::TensorList after,
                             bool overwrite, bool fsync) {
  validate_commit(world_size, after, true);
  return at::empty({}, meta_options(at::kLong));
}

}  // namespace fsdp_ema::ops

// --- the public C++ API (include/fsdp_ema/ops.h): through the dispatcher ------------------------
namespace fsdp_ema {

int64_t commit_checkpoint(const std::string& directory, int64_t world_size, bool overwrite,
                          bool fsync, const std::vector<std::string>& metadata) {
  if (metadata.empty()) {
    static const auto op = ops::typed_op<int64_t(c10::string_view, int64_t, bool, bool)>(
        "fsdp_ema::commit_checkpoint");
    return op.call(directory, world_size, overwrite, fsync);
  }
  static const auto with_metadata =
      ops::typed_op<int64_t(c10::string_view, int64_t, const std::vector<std::string>&, bool,
                            bool)>("fsdp_ema::commit_checkpoint", "with_metadata");
  return with_metadata.call(directory, world_size, metadata, overwrite, fsync);
}

at::Tensor commit_checkpoint(const std::string& directory, int64_t world_size, at::TensorList after,
                             bool overwrite, bool fsync) {
  static const auto op =
      ops::typed_op<at::Tensor(c10::string_view, int64_t, at::TensorList, bool, bool)>(
          "fsdp_ema::commit_checkpoint", "after");
  return op.call(directory, world_size, after, overwrite, fsync);
}

}  // namespace fsdp_ema
