#include "ops/load_tensors.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <utility>

#include "fsdp_ema/format/rows.h"
#include "ops/format_bridge.h"
#include "ops/reads.h"
#include "ops/staged_reads.h"
#include "ops/tracing.h"

namespace fsdp_ema::ops {

namespace {

constexpr const char* kOp = "fsdp_ema::load_tensors: ";

using Plan = RowsPlan;

// The one validation of a load, which the Meta kernel runs too: every name looked up and every
// slice sized before anything is read (format::tensor_rows: the rows of rank `rank`).
Plan plan_load(const format::CheckpointDir& dir, const std::vector<std::string>& names,
               int64_t rank, int64_t world_size) {
  Plan plan;
  plan.reserve(names.size());
  for (const auto& name : names) {
    const format::IndexTensor& info = dir.tensor(name);
    plan.emplace_back(&info, format::tensor_rows(info.shape, rank, world_size));
  }
  return plan;
}

std::shared_ptr<const format::CheckpointDir> open_dir(c10::string_view directory) {
  return std::make_shared<const format::CheckpointDir>(
      format::CheckpointDir::open(std::string(directory)));
}

}  // namespace

std::vector<at::Tensor> load_tensors_from(const std::shared_ptr<const format::CheckpointDir>& dir,
                                          const std::vector<std::string>& names, int64_t rank,
                                          int64_t world_size, bool verify,
                                          std::optional<at::Device> device, bool mmap) {
  return load_plan(dir, plan_load(*dir, names, rank, world_size), verify, device, mmap);
}

std::vector<at::Tensor> load_plan(const std::shared_ptr<const format::CheckpointDir>& dir,
                                  const RowsPlan& plan, bool verify,
                                  std::optional<at::Device> device, bool mmap) {
  const bool to_device = device.has_value() && !device->is_cpu();
  const bool zero_copy = mmap && !to_device;
  // Zero-copy views skip the read, so their pieces are hashed up front (in parallel); owned
  // reads hash each piece while reading it.
  if (verify && zero_copy) verify_pieces(*dir, plan, /*mapped=*/true);
  if (to_device && device->is_cuda()) {
    // Straight to the device through two pinned buffers (staged_reads.h), each piece verified
    // first so that the pipeline's reads need not hash.
    if (verify) verify_pieces(*dir, plan);
    std::vector<at::Tensor> out;
    out.reserve(plan.size());
    for (const auto& [info, rows] : plan) {
      out.push_back(
          at::empty(rows_shape(*info, rows),
                    at::TensorOptions().dtype(to_scalar_type(info->dtype)).device(*device)));
    }
    read_rows_to_device(*dir, plan, out);
    // The pieces were hashed before they were staged: a file rewritten in place since the open
    // could have handed the device other bytes than the hashed ones. Refused, as load_into_ does.
    if (verify) dir->check_unchanged();
    return out;
  }
  std::vector<at::Tensor> out = read_rows(dir, plan, verify, zero_copy);
  if (to_device) {
    for (at::Tensor& t : out) t = t.to(*device);
  }
  return out;
}

std::vector<at::Tensor> load_tensors(c10::string_view directory,
                                     const std::vector<std::string>& names, int64_t rank,
                                     int64_t world_size, bool verify,
                                     std::optional<at::Device> device, bool mmap) {
  check_rank(kOp, rank, world_size);
  return translate_errors(kOp, [&] {
    return load_tensors_from(open_dir(directory), names, rank, world_size, verify, device, mmap);
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
  check_rank(kOp, rank, world_size);
  return translate_errors(kOp, [&] {
    // Opening validates the index and the shard headers; no tensor data is read.
    const auto dir = open_dir(directory);
    const Plan plan = plan_load(*dir, names, rank, world_size);
    std::vector<at::Tensor> out;
    out.reserve(plan.size());
    for (const auto& [info, rows] : plan) {
      out.push_back(at::empty(rows_shape(*info, rows), meta_options(to_scalar_type(info->dtype))));
    }
    return out;
  });
}

}  // namespace fsdp_ema::ops
