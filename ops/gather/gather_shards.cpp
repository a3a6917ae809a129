#include "ops/gather/gather_shards.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "fsdp_ema/format/rows.h"
#include "fsdp_ema/ops.h"
#include "kernels/batched_copy.h"
#include "ops/common/dispatch.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::gather_shards: ";
constexpr int64_t kAlign = 16;  // every packed piece starts 16-byte aligned (vector copies)

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

void validate_lists(at::TensorList shards, at::IntArrayRef rows) {
  TORCH_CHECK(shards.size() == rows.size(), kOp, "shards has ", shards.size(),
              " tensors but rows has ", rows.size(), " entries");
  for (const auto i : c10::irange(shards.size())) {
    TORCH_CHECK(shards[i].defined(), kOp, "shards[", i, "] is an undefined tensor");
    TORCH_CHECK(shards[i].dim() >= 1, kOp, "shards[", i,
                "] is 0-dim; only tensors with a dim 0 to shard can be gathered");
    TORCH_CHECK(rows[i] >= 0, kOp, "rows[", i, "] is negative: ", rows[i]);
    TORCH_CHECK(shards[i].device() == shards[0].device(), kOp, "shards[", i, "] is on ",
                shards[i].device(), " but shards[0] is on ", shards[0].device());
  }
}

void copy_on_cpu(std::vector<kernels::CopySegment>& segments, const at::Device& device) {
  kernels::batched_copy_cpu(segments.data(), static_cast<int64_t>(segments.size()));
}

// The CPU kernel keeps its buffers between calls (per thread): fresh pages cost a fault each,
// which for large gathers (bucketed exports) takes longer than the copies themselves.
std::pair<at::Tensor, at::Tensor> cached_workspace(const at::Device& device, int64_t send_bytes,
                                                   int64_t recv_bytes) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(device);
  thread_local at::Tensor send_cache;
  thread_local at::Tensor recv_cache;
  if (!send_cache.defined() || send_cache.numel() < send_bytes) {
    send_cache = at::empty({send_bytes}, options);
  }
  if (!recv_cache.defined() || recv_cache.numel() < recv_bytes) {
    recv_cache = at::empty({recv_bytes}, options);
  }
  return {send_cache.narrow(0, 0, send_bytes), recv_cache.narrow(0, 0, recv_bytes)};
}

}  // namespace

int64_t gather_alignment() { return kAlign; }

std::pair<at::Tensor, at::Tensor> fresh_workspace(const at::Device& device, int64_t send_bytes,
                                                  int64_t recv_bytes) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(device);
  return {at::empty({send_bytes}, options), at::empty({recv_bytes}, options)};
}

std::vector<at::Tensor> gather_shards_with(at::TensorList shards, at::IntArrayRef rows,
                                           c10::string_view group_name,
                                           const GatherDeviceFns& fns) {
  validate_lists(shards, rows);
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(std::string(group_name));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, kOp, "group_name '", group_name, "' names no process group (", e.what(),
                ")");
  }
  const int64_t world = group->getSize();
  const int64_t rank = group->getRank();
  const size_t n = shards.size();

  // Every rank's packed layout is known locally: rows and trailing shapes are the same
  // everywhere, so no size exchange is needed before the one all-gather.
  std::vector<int64_t> row_bytes(n);
  std::vector<at::Tensor> inputs(n);
  for (const auto i : c10::irange(n)) {
    const auto [b, e] = format::chunk_rows(rows[i], rank, world);
    TORCH_CHECK(shards[i].size(0) == e - b, kOp, "shards[", i, "] has ", shards[i].size(0),
                " rows but rank ", rank, " of ", world, " holds ", e - b, " of rows[", i,
                "] = ", rows[i], " (torch.chunk: rows [", b, ", ", e, "))");
    inputs[i] = shards[i].contiguous();
    row_bytes[i] = static_cast<int64_t>(inputs[i].element_size()) *
                   c10::multiply_integers(shards[i].sizes().slice(1));
  }
  // offset[r][i]: where rank r's piece of tensor i starts in rank r's packed buffer.
  std::vector<std::vector<int64_t>> offset(world, std::vector<int64_t>(n));
  int64_t max_bytes = kAlign;
  for (int64_t r = 0; r < world; ++r) {
    int64_t pos = 0;
    for (const auto i : c10::irange(n)) {
      const auto [b, e] = format::chunk_rows(rows[i], r, world);
      offset[r][i] = pos;
      pos = align_up(pos + (e - b) * row_bytes[i]);
    }
    max_bytes = std::max(max_bytes, pos);
  }

  const at::Device device = n > 0 ? shards[0].device() : at::Device(at::kCPU);
  auto [packed, gathered] = fns.workspace(device, max_bytes, world * max_bytes);

  std::vector<kernels::CopySegment> segments;
  for (const auto i : c10::irange(n)) {
    const int64_t bytes = inputs[i].nbytes();
    if (bytes == 0) continue;
    segments.push_back({inputs[i].const_data_ptr(),
                        static_cast<char*>(packed.data_ptr()) + offset[rank][i], bytes, 0});
  }
  fns.copy(segments, device);

  // One collective for all N tensors (gloo on CPU, NCCL on CUDA; the group's timeout applies).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  group->_allgather_base(gathered, packed)->wait();
#pragma GCC diagnostic pop

  std::vector<at::Tensor> outputs(n);
  segments.clear();
  for (const auto i : c10::irange(n)) {
    std::vector<int64_t> shape(shards[i].sizes().begin(), shards[i].sizes().end());
    shape[0] = rows[i];
    outputs[i] = at::empty(shape, shards[i].options().memory_format(at::MemoryFormat::Contiguous));
    for (int64_t r = 0; r < world; ++r) {
      const auto [b, e] = format::chunk_rows(rows[i], r, world);
      if (e == b || row_bytes[i] == 0) continue;
      segments.push_back(
          {static_cast<const char*>(gathered.const_data_ptr()) + r * max_bytes + offset[r][i],
           static_cast<char*>(outputs[i].data_ptr()) + b * row_bytes[i], (e - b) * row_bytes[i],
           0});
    }
  }
  fns.copy(segments, device);
  return outputs;
}

std::vector<at::Tensor> gather_shards_cpu(at::TensorList shards, at::IntArrayRef rows,
                                          c10::string_view group_name) {
  // Also the kernel for empty lists (CompositeExplicitAutograd), which a device with no kernel of
  // its own would reach too.
  TORCH_CHECK(shards.empty() || shards[0].is_cpu(), kOp, "shards[0] is on ", shards[0].device(),
              ", which has no gather_shards kernel (CPU or CUDA)");
  return gather_shards_with(shards, rows, group_name, {&copy_on_cpu, &cached_workspace});
}

std::vector<at::Tensor> gather_shards_meta(at::TensorList shards, at::IntArrayRef rows,
                                           c10::string_view group_name) {
  validate_lists(shards, rows);
  std::vector<at::Tensor> outputs;
  for (const auto i : c10::irange(shards.size())) {
    std::vector<c10::SymInt> shape(shards[i].sym_sizes().begin(), shards[i].sym_sizes().end());
    shape[0] = rows[i];
    outputs.push_back(at::empty_symint(shape, shards[i].options()));
  }
  return outputs;
}

}  // namespace fsdp_ema::ops

// --- the public C++ API (include/fsdp_ema/ops.h)
// ---------------------------------------------------
namespace fsdp_ema {

std::vector<at::Tensor> gather_shards(at::TensorList shards, c10::ArrayRef<int64_t> rows,
                                      const std::string& group_name) {
  static const auto op = ops::typed_op<std::vector<at::Tensor>(
      at::TensorList, c10::ArrayRef<int64_t>, c10::string_view)>("fsdp_ema::gather_shards");
  return op.call(shards, rows, group_name);
}

std::vector<at::Tensor> gather_shards(at::TensorList shards, c10::ArrayRef<int64_t> rows,
                                      const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return gather_shards(shards, rows, register_process_group(group));
}

std::string register_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  TORCH_CHECK(group, "fsdp_ema::register_process_group: group is null");
  // Serialized so that two threads registering one group agree on its name.
  static std::mutex mutex;
  static std::atomic<int64_t> next{0};
  const std::lock_guard<std::mutex> lock(mutex);
  std::string current;
  try {
    current = group->getGroupName();  // throws for a group never named
  } catch (const std::exception&) {
  }
  if (!current.empty()) {
    bool taken = false;
    try {
      const auto registered = c10d::resolve_process_group(current);
      if (registered.get() == group.get()) return current;
      taken = true;  // another group holds the name: this one gets a fresh one
    } catch (const std::exception&) {
      // Named but not registered: register it under its own name.
    }
    if (!taken) {
      c10d::register_process_group(current, group);
      return current;
    }
  }
  const std::string name = "fsdp_ema_group_" + std::to_string(next++);
  group->setGroupName(name);
  c10d::register_process_group(name, group);
  return name;
}

}  // namespace fsdp_ema
