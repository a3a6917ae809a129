#include "ops/load/load_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <utility>

#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/ops.h"
#include "ops/checkpoint/checkpoint_info.h"
#include "ops/common/dispatch.h"
#include "ops/common/format_bridge.h"
#include "ops/common/tracing.h"
#include "ops/load/pipeline.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kLoadTensors = "fsdp_ema::load_tensors: ";
constexpr const char* kLoadShard = "fsdp_ema::load_shard: ";
constexpr const char* kLoadInto = "fsdp_ema::load_into_: ";

}  // namespace

// --- load_tensors --------------------------------------------------------------------------------

std::vector<at::Tensor> load_tensors(c10::string_view directory,
                                     const std::vector<std::string>& names, int64_t rank,
                                     int64_t world_size, bool verify,
                                     std::optional<at::Device> device, bool mmap) {
  check_rank(kLoadTensors, rank, world_size);
  const auto dir = open_dir(kLoadTensors, directory);
  return translate_errors(kLoadTensors, [&] {
    return read_fresh(dir, plan_rows(*dir, names, rank, world_size), verify, device, mmap);
  });
}

std::vector<at::Tensor> load_tensors_entry(c10::string_view directory,
                                           const std::vector<std::string>& names, int64_t rank,
                                           int64_t world_size, bool verify,
                                           std::optional<at::Device> device, bool mmap) {
  return load_tensors_after_entry(directory, names, {}, rank, world_size, verify, device, mmap);
}

std::vector<at::Tensor> load_tensors_after_entry(c10::string_view directory,
                                                 const std::vector<std::string>& names,
                                                 at::TensorList after, int64_t rank,
                                                 int64_t world_size, bool verify,
                                                 std::optional<at::Device> device, bool mmap) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fsdp_ema::_load_tensors", "")
                             .typed<std::vector<at::Tensor>(
                                 const at::Tensor&, at::TensorList, c10::string_view,
                                 const std::vector<std::string>&, int64_t, int64_t, bool, bool)>();
  const at::Tensor target = target_on(device);
  // On the target's device, so that the private op has one device to dispatch (and trace) on.
  std::vector<at::Tensor> moved;
  moved.reserve(after.size());
  for (const at::Tensor& t : after) moved.push_back(t.to(target.device()));
  return op.call(target, moved, directory, names, rank, world_size, verify, mmap);
}

std::vector<at::Tensor> load_tensors_to(const at::Tensor& target, at::TensorList after,
                                        c10::string_view directory,
                                        const std::vector<std::string>& names, int64_t rank,
                                        int64_t world_size, bool verify, bool mmap) {
  return load_tensors(directory, names, rank, world_size, verify, target.device(), mmap);
}

std::vector<at::Tensor> load_tensors_meta(const at::Tensor& target, at::TensorList after,
                                          c10::string_view directory,
                                          const std::vector<std::string>& names, int64_t rank,
                                          int64_t world_size, bool verify, bool mmap) {
  check_rank(kLoadTensors, rank, world_size);
  // Opening validates the index and the shard headers; no tensor data is read.
  const auto dir = open_dir(kLoadTensors, directory);
  return translate_errors(kLoadTensors, [&] {
    const LoadPlan plan = plan_rows(*dir, names, rank, world_size);
    std::vector<at::Tensor> out;
    out.reserve(plan.size());
    for (const LoadItem& item : plan) {
      out.push_back(at::empty(item_shape(*dir, item), meta_options(item_dtype(*dir, item))));
    }
    return out;
  });
}

// --- load_shard ----------------------------------------------------------------------------------

namespace {

// What a load_shard returns besides the tensors: names, offsets, global shapes.
ShardContents header_of(const format::ShardFile& file) {
  ShardContents out;
  auto& [names, tensors, offsets, global_shapes] = out;
  for (const format::TensorInfo& info : file.tensors()) {
    names.push_back(info.name);
    offsets.insert(offsets.end(), info.offsets.begin(), info.offsets.end());
    global_shapes.insert(global_shapes.end(), info.global_shape.begin(), info.global_shape.end());
  }
  return out;
}

}  // namespace

ShardContents load_shard(c10::string_view path, bool verify, std::optional<at::Device> device,
                         bool mmap) {
  return translate_errors(kLoadShard, [&] {
    const at::Device target = device.value_or(at::Device(at::kCPU));
    auto file = std::make_shared<const format::ShardFile>(
        format::ShardFile::open(std::string(path), /*verify_checksums=*/false));
    ShardContents out = header_of(*file);
    std::get<1>(out) = read_file(file, verify, target, mmap && target.is_cpu());
    return out;
  });
}

ShardContents load_shard_entry(c10::string_view path, bool verify, std::optional<at::Device> device,
                               bool mmap) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_ema::_load_shard", "")
          .typed<ShardContents(const at::Tensor&, c10::string_view, bool, bool)>();
  return op.call(target_on(device), path, verify, mmap);
}

ShardContents load_shard_to(const at::Tensor& target, c10::string_view path, bool verify,
                            bool mmap) {
  return load_shard(path, verify, target.device(), mmap);
}

ShardContents load_shard_meta(const at::Tensor& target, c10::string_view path, bool verify,
                              bool mmap) {
  return translate_errors(kLoadShard, [&] {
    // Header only: the checksums are not checked (that would read the data).
    const format::ShardFile file = format::ShardFile::open(std::string(path), false);
    ShardContents out = header_of(file);
    for (const format::TensorInfo& info : file.tensors()) {
      std::get<1>(out).push_back(at::empty(info.shape, meta_options(to_scalar_type(info.dtype))));
    }
    return out;
  });
}

// --- load_into_ ----------------------------------------------------------------------------------

namespace {

// The plan of a load into `out`, every destination checked; reads nothing.
LoadPlan plan_into(const char* op, const format::CheckpointDir& dir,
                   const std::vector<std::string>& names, at::TensorList out, int64_t rank,
                   int64_t world_size, bool meta) {
  check_rank(op, rank, world_size);
  TORCH_CHECK(names.size() == out.size(), op, "names has ", names.size(), " entries but out has ",
              out.size());
  LoadPlan plan;
  for (size_t i = 0; i < names.size(); ++i) {
    TORCH_CHECK(dir.find(names[i]) != nullptr, op, "names[", i, "] '", names[i],
                "' is not in checkpoint '", dir.path(), "'");
  }
  translate_errors(op, [&] { plan = plan_rows(dir, names, rank, world_size); });
  check_destinations(op, dir, plan, names, out, rank, world_size, meta);
  return plan;
}

// The write pass, after the check pass: fstat first (an early refusal of a file rewritten since
// the open), then every byte hashed again as it is read into place.
void write_pass(const char* op, const format::CheckpointDir& dir, const LoadPlan& plan,
                at::TensorList out, bool verify) {
  translate_errors(op, [&] {
    dir.check_unchanged();
    read_into(dir, plan, out, verify);
  });
}

}  // namespace

void load_into_(c10::string_view directory, const std::vector<std::string>& names,
                at::TensorList out, int64_t rank, int64_t world_size, bool verify) {
  const auto dir = open_dir(kLoadInto, directory);
  const LoadPlan plan = plan_into(kLoadInto, *dir, names, out, rank, world_size, false);
  // The check pass: a corrupted file is refused with every destination untouched.
  if (verify) translate_errors(kLoadInto, [&] { check_reads(*dir, plan, true); });
  write_pass(kLoadInto, *dir, plan, out, verify);
}

void load_into_meta(c10::string_view directory, const std::vector<std::string>& names,
                    at::TensorList out, int64_t rank, int64_t world_size, bool verify) {
  const auto dir = open_dir(kLoadInto, directory);
  plan_into(kLoadInto, *dir, names, out, rank, world_size, true);
}

// --- OpenCheckpoint ------------------------------------------------------------------------------

OpenCheckpoint::OpenCheckpoint(const std::string& directory)
    : dir_(open_dir("fsdp_ema::open_checkpoint: ", directory)) {}

void OpenCheckpoint::check_into(const std::vector<std::string>& names,
                                const std::vector<at::Tensor>& out, int64_t rank,
                                int64_t world_size, bool verify) const {
  constexpr const char* kOp = "fsdp_ema::OpenCheckpoint.check_into: ";
  const LoadPlan plan = plan_into(kOp, *dir_, names, out, rank, world_size, false);
  if (verify) translate_errors(kOp, [&] { check_reads(*dir_, plan, true); });
}

void OpenCheckpoint::load_into_(const std::vector<std::string>& names,
                                const std::vector<at::Tensor>& out, int64_t rank,
                                int64_t world_size, bool verify, bool checked) const {
  constexpr const char* kOp = "fsdp_ema::OpenCheckpoint.load_into: ";
  const LoadPlan plan = plan_into(kOp, *dir_, names, out, rank, world_size, false);
  if (verify && !checked) {
    translate_errors(kOp, [&] {
      dir_->check_unchanged();  // the early refusal first: its message says what happened
      check_reads(*dir_, plan, true);
    });
  }
  write_pass(kOp, *dir_, plan, out, verify);
}

std::vector<at::Tensor> OpenCheckpoint::load(const std::vector<std::string>& names, int64_t rank,
                                             int64_t world_size, bool verify) const {
  constexpr const char* kOp = "fsdp_ema::OpenCheckpoint.load: ";
  check_rank(kOp, rank, world_size);
  return translate_errors(kOp, [&] {
    dir_->check_unchanged();
    return read_fresh(dir_, plan_rows(*dir_, names, rank, world_size), verify, std::nullopt, false);
  });
}

std::vector<at::Tensor> OpenCheckpoint::load_boxes(const std::vector<std::string>& names,
                                                   const std::vector<int64_t>& offsets,
                                                   const std::vector<int64_t>& shapes,
                                                   bool verify) const {
  constexpr const char* kOp = "fsdp_ema::OpenCheckpoint.load_boxes: ";
  return translate_errors(kOp, [&] {
    dir_->check_unchanged();
    return read_fresh(dir_, plan_boxes(*dir_, names, offsets, shapes), verify, std::nullopt, false);
  });
}

std::string OpenCheckpoint::info() const { return info_json(*dir_); }

void OpenCheckpoint::check_unchanged() const {
  translate_errors("fsdp_ema::OpenCheckpoint.check_unchanged: ", [&] { dir_->check_unchanged(); });
}

}  // namespace fsdp_ema::ops

// --- the public C++ API (include/fsdp_ema/ops.h): through the dispatcher ------------------------
namespace fsdp_ema {

std::vector<at::Tensor> load_tensors(const std::string& directory,
                                     const std::vector<std::string>& names, int64_t rank,
                                     int64_t world_size, bool verify,
                                     std::optional<at::Device> device, bool mmap) {
  static const auto op = ops::typed_op<std::vector<at::Tensor>(
      c10::string_view, const std::vector<std::string>&, int64_t, int64_t, bool,
      std::optional<at::Device>, bool)>("fsdp_ema::load_tensors");
  return op.call(directory, names, rank, world_size, verify, device, mmap);
}

ShardFileContents load_shard(const std::string& path, bool verify, std::optional<at::Device> device,
                             bool mmap) {
  static const auto op =
      ops::typed_op<ops::ShardContents(c10::string_view, bool, std::optional<at::Device>, bool)>(
          "fsdp_ema::load_shard");
  auto [names, shards, offsets, global_shapes] = op.call(path, verify, device, mmap);
  return {std::move(names), std::move(shards), std::move(offsets), std::move(global_shapes)};
}

}  // namespace fsdp_ema
