#include "ops/checkpoint.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <c10/util/irange.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/layout.h"
#include "fsdp_ema/format/name_hash.h"
#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/format/shard_writer.h"

namespace fsdp_ema::ops {
namespace {

format::Shape to_shape(at::IntArrayRef s) { return format::Shape(s.begin(), s.end()); }

// The validated request of one save_shard call.
struct SaveRequest {
  std::vector<format::TensorToWrite> tensors;
  std::vector<at::Tensor> keep_alive;  // contiguous versions of the shards
};

SaveRequest validate_save(const char* op, int64_t rank, int64_t world_size,
                          const std::vector<std::string>& names, at::TensorList shards,
                          at::IntArrayRef offsets, at::IntArrayRef global_shapes) {
  check_rank(op, rank, world_size);
  TORCH_CHECK(names.size() == shards.size(), op, "names has ", names.size(),
              " entries but shards has ", shards.size());
  int64_t dims = 0;
  for (const auto& t : shards) dims += t.dim();
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == dims, op, "offsets has ", offsets.size(),
              " entries but the shards have ", dims, " dimensions in total (one offset per dim)");
  TORCH_CHECK(static_cast<int64_t>(global_shapes.size()) == dims, op, "global_shapes has ",
              global_shapes.size(), " entries but the shards have ", dims,
              " dimensions in total (one size per dim)");
  SaveRequest req;
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

}  // namespace

at::Tensor save_shard(c10::string_view directory, int64_t rank, int64_t world_size,
                      const std::vector<std::string>& names, at::TensorList shards,
                      at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                      bool overwrite) {
  constexpr const char* kOp = "fsdp_ema::save_shard: ";
  SaveRequest req = validate_save(kOp, rank, world_size, names, shards, offsets, global_shapes);
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

int64_t commit_checkpoint(c10::string_view directory, int64_t world_size, bool overwrite,
                          bool fsync) {
  constexpr const char* kOp = "fsdp_ema::commit_checkpoint: ";
  TORCH_CHECK(world_size >= 1, kOp, "world_size must be >= 1, got ", world_size);
  return translate_errors(kOp, [&] {
    return static_cast<int64_t>(
        format::commit_directory(std::string(directory), world_size, overwrite, fsync)
            .tensors.size());
  });
}

std::tuple<std::vector<std::string>, std::vector<at::Tensor>, std::vector<int64_t>,
           std::vector<int64_t>>
load_shard(c10::string_view path, bool verify, std::optional<at::Device> device, bool mmap) {
  constexpr const char* kOp = "fsdp_ema::load_shard: ";
  return translate_errors(kOp, [&] {
    const at::Device target = device.value_or(at::Device(at::kCPU));
    const bool zero_copy = mmap && target.is_cpu();
    // Owned reads verify each tensor while reading it; zero-copy verifies the file up front.
    auto file = std::make_shared<format::ShardFile>(
        format::ShardFile::open(std::string(path), verify && zero_copy));
    std::vector<std::string> names;
    std::vector<at::Tensor> tensors;
    std::vector<int64_t> offsets;
    std::vector<int64_t> global_shapes;
    for (const format::TensorInfo& info : file->tensors()) {
      names.push_back(info.name);
      offsets.insert(offsets.end(), info.offsets.begin(), info.offsets.end());
      global_shapes.insert(global_shapes.end(), info.global_shape.begin(), info.global_shape.end());
      const auto options = at::TensorOptions().dtype(to_scalar_type(info.dtype));
      at::Tensor t;
      if (zero_copy && info.nbytes > 0) {
        const auto bytes = file->data(info);
        const auto element = static_cast<uintptr_t>(format::dtype_size(info.dtype));
        if (reinterpret_cast<uintptr_t>(bytes.data()) % element == 0) {
          // A view of the private (copy-on-write) mapping; the tensor keeps the file mapped.
          t = at::from_blob(
              const_cast<std::byte*>(bytes.data()), info.shape, [file](void*) {}, options);
        }
      }
      if (!t.defined()) {
        t = at::empty(info.shape, options);
        file->read_verified(info, t.data_ptr(), verify && !zero_copy);
        if (!target.is_cpu()) t = t.to(target);
      }
      tensors.push_back(std::move(t));
    }
    return std::make_tuple(std::move(names), std::move(tensors), std::move(offsets),
                           std::move(global_shapes));
  });
}

std::vector<at::Tensor> load_tensors_from(const std::shared_ptr<const format::CheckpointDir>& dir,
                                          const std::vector<std::string>& names, int64_t rank,
                                          int64_t world_size, bool verify,
                                          std::optional<at::Device> device, bool mmap) {
  // Look every name up (and size every slice) before reading anything.
  std::vector<std::pair<const format::IndexTensor*, format::RowRange>> plan;
  for (const auto& name : names) {
    const format::IndexTensor& info = dir->tensor(name);
    plan.emplace_back(&info, rank_rows(info, rank, world_size));
  }
  const bool to_device = device.has_value() && !device->is_cpu();
  const bool zero_copy = mmap && !to_device;
  // Zero-copy views skip the read, so their pieces are hashed up front (in parallel); owned
  // reads hash each piece while reading it.
  if (verify && zero_copy) verify_pieces(*dir, plan);
  std::vector<at::Tensor> out(plan.size());
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[i] = read_rows(dir, *plan[i].first, plan[i].second, verify, zero_copy);
    }
  });
  if (to_device) {
    for (at::Tensor& t : out) t = t.to(*device);
  }
  return out;
}

std::vector<at::Tensor> load_tensors(c10::string_view directory,
                                     const std::vector<std::string>& names, int64_t rank,
                                     int64_t world_size, bool verify,
                                     std::optional<at::Device> device, bool mmap) {
  constexpr const char* kOp = "fsdp_ema::load_tensors: ";
  check_rank(kOp, rank, world_size);
  return translate_errors(kOp, [&] {
    const auto dir = std::make_shared<const format::CheckpointDir>(
        format::CheckpointDir::open(std::string(directory)));
    return load_tensors_from(dir, names, rank, world_size, verify, device, mmap);
  });
}

std::string info_json(const format::CheckpointDir& dir) {
  nlohmann::json j;
  j["layout"] = std::string(format::layout_name(dir.layout()));
  j["world_size"] = dir.world_size();
  j["tensors"] = nlohmann::json::object();
  for (const auto& t : dir.tensors()) {
    j["tensors"][t.name] = {{"dtype", std::string(format::dtype_name(t.dtype))},
                            {"torch_dtype", std::string(format::python_dtype_name(t.dtype))},
                            {"shape", t.shape}};
  }
  j["metadata"] = dir.index().metadata;
  return j.dump();
}

std::string checkpoint_info(c10::string_view directory) {
  constexpr const char* kOp = "fsdp_ema::checkpoint_info: ";
  return translate_errors(
      kOp, [&] { return info_json(format::CheckpointDir::open(std::string(directory))); });
}

}  // namespace fsdp_ema::ops

namespace fsdp_ema::ops {

bool is_committed(c10::string_view directory) {
  return translate_errors("fsdp_ema::is_committed: ",
                          [&] { return format::is_committed(std::string(directory)); });
}

bool prepare_checkpoint(c10::string_view directory) {
  return translate_errors("fsdp_ema::prepare_checkpoint: ",
                          [&] { return format::prepare_checkpoint_dir(std::string(directory)); });
}

void write_sidecar(c10::string_view directory, c10::string_view name, c10::string_view content,
                   bool fsync) {
  translate_errors("fsdp_ema::write_sidecar: ", [&] {
    format::write_sidecar(std::string(directory), std::string_view(name.data(), name.size()),
                          std::string_view(content.data(), content.size()), fsync);
  });
}

std::vector<std::string> committed_checkpoints(c10::string_view root, bool follow_links) {
  return translate_errors("fsdp_ema::committed_checkpoints: ", [&] {
    return format::committed_checkpoints(std::string(root), follow_links);
  });
}

void remove_checkpoint(c10::string_view directory) {
  translate_errors("fsdp_ema::remove_checkpoint: ",
                   [&] { format::remove_checkpoint(std::string(directory)); });
}

}  // namespace fsdp_ema::ops
