#include "ops/save/save_shard.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <string_view>
#include <unordered_set>

#include "fsdp_ema/format/layout.h"
#include "fsdp_ema/format/name_hash.h"
#include "fsdp_ema/format/shard_writer.h"
#include "fsdp_ema/ops.h"
#include "ops/common/dispatch.h"
#include "ops/common/format_bridge.h"
#include "ops/common/tracing.h"

namespace fsdp_ema::ops {
namespace {

format::Shape to_shape(at::IntArrayRef s) { return format::Shape(s.begin(), s.end()); }

// The validated request of one save_shard call.
struct SaveRequest {
  std::vector<format::TensorToWrite> tensors;
  std::vector<at::Tensor> keep_alive;  // contiguous versions of the shards
};

// Every check of a save_shard call; `tracing` (the Meta kernel): those that need no data, and no
// real meta tensor (it has no data to save).
SaveRequest validate_save(const char* op, int64_t rank, int64_t world_size,
                          const std::vector<std::string>& names, at::TensorList shards,
                          at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool tracing) {
  check_rank(op, rank, world_size);
  TORCH_CHECK(names.size() == shards.size(), op, "names has ", names.size(),
              " entries but shards has ", shards.size());
  int64_t dims = 0;
  for (const auto i : c10::irange(shards.size())) {
    TORCH_CHECK(!tracing || !is_real_meta(shards[i]), op, "shards[", i, "] ('", names[i],
                "') is a meta tensor, which has no data to save");
    dims += shards[i].dim();
  }
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == dims, op, "offsets has ", offsets.size(),
              " entries but the shards have ", dims, " dimensions in total (one offset per dim)");
  TORCH_CHECK(static_cast<int64_t>(global_shapes.size()) == dims, op, "global_shapes has ",
              global_shapes.size(), " entries but the shards have ", dims,
              " dimensions in total (one size per dim)");
  SaveRequest req;
  if (tracing) return req;  // sizes may be symbolic: the rest is checked when the call runs
  req.tensors.reserve(shards.size());
  req.keep_alive.reserve(shards.size());
  std::unordered_set<std::string_view, format::detail::NameHash> seen;
  seen.reserve(shards.size());
  int64_t pos = 0;
  for (const auto i : c10::irange(shards.size())) {
    const at::Tensor& t = shards[i];
    TORCH_CHECK(t.defined(), op, "shards[", i, "] is an undefined tensor");
    TORCH_CHECK(!names[i].empty(), op, "names[", i, "] is empty");
    TORCH_CHECK(seen.insert(names[i]).second, op, "names[", i, "] '", names[i], "' appears twice");
    // Built only on error: a save holds 100,000+ tensors.
    auto what = [&] { return "shards[" + std::to_string(i) + "] ('" + names[i] + "')"; };
    format::TensorToWrite w;
    w.name = names[i];
    const auto dtype = format_dtype_of(t.scalar_type());
    TORCH_CHECK(dtype, op, what(), " has dtype ", t.scalar_type(),
                ", which safetensors cannot store");
    w.dtype = *dtype;
    w.shape = to_shape(t.sizes());
    w.offsets = to_shape(offsets.slice(pos, t.dim()));
    w.global_shape = to_shape(global_shapes.slice(pos, t.dim()));
    pos += t.dim();
    for (const auto d : c10::irange(t.dim())) {
      TORCH_CHECK(w.offsets[d] >= 0 && w.offsets[d] + w.shape[d] <= w.global_shape[d], op, what(),
                  ": offset ", w.offsets[d], " + size ", w.shape[d], " exceeds global size ",
                  w.global_shape[d], " in dim ", d);
    }
    // contiguous() is a dispatcher call even for a contiguous tensor: 100,000+ of them add up.
    req.keep_alive.push_back(t.is_contiguous() ? t : t.contiguous());
    req.tensors.push_back(std::move(w));
  }
  return req;
}

constexpr const char* kOp = "fsdp_ema::save_shard: ";

}  // namespace

at::Tensor save_shard(c10::string_view directory, int64_t rank, int64_t world_size,
                      const std::vector<std::string>& names, at::TensorList shards,
                      at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                      bool overwrite) {
  SaveRequest req =
      validate_save(kOp, rank, world_size, names, shards, offsets, global_shapes, false);
  format::WriteOptions options;
  options.fsync = fsync;
  options.rank = rank;
  options.world_size = world_size;
  bool any_device_tensor = false;
  for (const auto i : c10::irange(req.tensors.size())) {
    const at::Tensor& t = req.keep_alive[i];
    if (t.numel() == 0) continue;
    if (t.device().is_cpu()) {
      req.tensors[i].host_data = t.const_data_ptr();
      continue;
    }
    any_device_tensor = true;
    // Device memory is staged chunk by chunk into the writer's (pinned) buffers: the copy of the
    // next chunk overlaps the write of the previous one (see format::FillFn).
    const at::Tensor bytes = t.reshape({-1}).view(at::kByte);
    req.tensors[i].fill = [bytes](uint64_t offset, uint64_t length, void* dst) {
      at::Tensor host =
          at::from_blob(dst, {static_cast<int64_t>(length)}, at::TensorOptions().dtype(at::kByte));
      host.copy_(bytes.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(length)));
    };
  }
  std::vector<at::Tensor> staging;
  if (any_device_tensor) {
    options.allocate_buffer = [&staging](size_t n) -> void* {
      staging.push_back(at::empty({static_cast<int64_t>(n)},
                                  at::TensorOptions().dtype(at::kByte).pinned_memory(true)));
      return staging.back().data_ptr();
    };
    options.free_buffer = [](void*) {};  // the tensors in `staging` own the memory
  }
  const auto bytes = translate_errors(kOp, [&] {
    return static_cast<int64_t>(format::save_shard_to_dir(
        std::string(directory), std::move(req.tensors), options, overwrite));
  });
  return at::scalar_tensor(bytes, at::TensorOptions().dtype(at::kLong));
}

at::Tensor save_shard_cuda(c10::string_view directory, int64_t rank, int64_t world_size,
                           const std::vector<std::string>& names, at::TensorList shards,
                           at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                           bool overwrite) {
  const int64_t bytes = save_shard(directory, rank, world_size, names, shards, offsets,
                                   global_shapes, fsync, overwrite)
                            .item<int64_t>();
  // A fill on the device, not a copy from pageable memory.
  return at::scalar_tensor(bytes,
                           at::TensorOptions().dtype(at::kLong).device(result_device(shards)));
}

at::Tensor save_shard_meta(c10::string_view directory, int64_t rank, int64_t world_size,
                           const std::vector<std::string>& names, at::TensorList shards,
                           at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                           bool overwrite) {
  validate_save(kOp, rank, world_size, names, shards, offsets, global_shapes, true);
  return at::empty({}, meta_options(at::kLong));
}

}  // namespace fsdp_ema::ops

// --- the public C++ API (include/fsdp_ema/ops.h): through the dispatcher ------------------------
namespace fsdp_ema {

int64_t save_shard(const std::string& directory, int64_t rank, int64_t world_size,
                   const std::vector<std::string>& names, at::TensorList shards,
                   c10::ArrayRef<int64_t> offsets, c10::ArrayRef<int64_t> global_shapes, bool fsync,
                   bool overwrite) {
  static const auto op = ops::typed_op<at::Tensor(
      c10::string_view, int64_t, int64_t, const std::vector<std::string>&, at::TensorList,
      c10::ArrayRef<int64_t>, c10::ArrayRef<int64_t>, bool, bool)>("fsdp_ema::save_shard");
  return op
      .call(directory, rank, world_size, names, shards, offsets, global_shapes, fsync, overwrite)
      .item<int64_t>();
}

}  // namespace fsdp_ema
