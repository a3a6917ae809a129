#include "ops/load/pipeline.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <functional>
#include <unordered_map>
#include <utility>

#include "fsdp_ema/format/read_exec.h"
#include "fsdp_ema/format/read_plan.h"
#include "ops/common/format_bridge.h"
#include "ops/common/memory.h"
#include "ops/common/tracing.h"

namespace fsdp_ema::ops {

std::shared_ptr<const format::CheckpointDir> open_dir(const char* op, c10::string_view directory) {
  return translate_errors(op, [&] {
    return std::make_shared<const format::CheckpointDir>(
        format::CheckpointDir::open(std::string(directory)));
  });
}

size_t read_threads() { return static_cast<size_t>(std::max(1, at::get_num_threads())); }

LoadPlan plan_rows(const format::CheckpointDir& dir, const std::vector<std::string>& names,
                   int64_t rank, int64_t world_size) {
  LoadPlan plan;
  plan.reserve(names.size());
  for (const std::string& name : names) {
    const size_t ti = dir.index_of(name);
    plan.push_back({ti, format::tensor_rows(dir.tensors()[ti].shape, rank, world_size), {}, {}});
  }
  return plan;
}

LoadPlan plan_boxes(const format::CheckpointDir& dir, const std::vector<std::string>& names,
                    const std::vector<int64_t>& offsets, const std::vector<int64_t>& shapes) {
  LoadPlan plan;
  plan.reserve(names.size());
  size_t at = 0;
  for (const std::string& name : names) {
    const size_t ti = dir.index_of(name);
    const size_t ndim = dir.tensors()[ti].shape.size();
    if (offsets.size() < at + ndim || shapes.size() < at + ndim) {
      throw format::FormatError(dir.path() + ": tensor '" + name + "' has " + std::to_string(ndim) +
                                " dimensions, but offsets and shapes hold " + "only " +
                                std::to_string(offsets.size()) + " and " +
                                std::to_string(shapes.size()) + " entries in all");
    }
    LoadItem item{ti,
                  {},
                  {offsets.begin() + at, offsets.begin() + at + ndim},
                  {shapes.begin() + at, shapes.begin() + at + ndim}};
    at += ndim;
    // Inside the tensor before anything is sized from it (a fresh load allocates its shape).
    format::ReadRequest q;
    q.tensor = dir.stored(ti);
    q.box_offsets = item.box_offsets;
    q.box_shape = item.box_shape;
    if (ndim > 0) format::check_read_request(q, dir.path());
    plan.push_back(std::move(item));
  }
  if (offsets.size() != at || shapes.size() != at) {
    throw format::FormatError(dir.path() + ": offsets and shapes hold " +
                              std::to_string(offsets.size()) + " and " +
                              std::to_string(shapes.size()) + " entries but the tensors have " +
                              std::to_string(at) + " dimensions in all");
  }
  return plan;
}

std::vector<int64_t> item_shape(const format::CheckpointDir& dir, const LoadItem& item) {
  const format::IndexTensor& t = dir.tensors()[item.tensor];
  if (t.shape.empty()) return {};
  if (!item.box_shape.empty()) return item.box_shape;
  std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
  shape[0] = item.rows.size();
  return shape;
}

at::ScalarType item_dtype(const format::CheckpointDir& dir, const LoadItem& item) {
  return to_scalar_type(dir.tensors()[item.tensor].dtype);
}

void check_destinations(const char* op, const format::CheckpointDir& dir, const LoadPlan& plan,
                        const std::vector<std::string>& names, at::TensorList out, int64_t rank,
                        int64_t world_size, bool meta) {
  TORCH_CHECK(names.size() == out.size(), op, "names has ", names.size(), " entries but out has ",
              out.size());
  auto label = [&](size_t i) { return "out[" + std::to_string(i) + "] ('" + names[i] + "')"; };
  for (const auto i : c10::irange(plan.size())) {
    const at::Tensor& t = out[i];
    TORCH_CHECK(t.defined(), op, label(i), " is an undefined tensor");
    check_strided(op, t, label, i);
    const at::ScalarType stored = item_dtype(dir, plan[i]);
    TORCH_CHECK(t.scalar_type() == stored, op, label(i), " has dtype ", t.scalar_type(),
                " but the checkpoint stores ", stored);
    const std::vector<int64_t> shape = item_shape(dir, plan[i]);
    // Sizes as SymInts: a tracer's destinations may have symbolic shapes.
    bool same_shape = t.dim() == static_cast<int64_t>(shape.size());
    for (int64_t d = 0; same_shape && d < t.dim(); ++d) same_shape = t.sym_size(d) == shape[d];
    TORCH_CHECK(same_shape, op, label(i), " has shape ", t.sym_sizes(), " but rank ", rank, " of ",
                world_size, " holds ", at::IntArrayRef(shape), " of it");
    // In the Meta kernel (tracing) every destination must be a tracer's fake tensor.
    const bool usable = meta ? t.is_meta() && !is_real_meta(t) : t.is_cpu() || t.is_cuda();
    TORCH_CHECK(usable, op, label(i), " is ",
                is_real_meta(t) ? "a meta tensor, which has no memory to load into"
                                : "on " + t.device().str() + " while other destinations are not",
                "; destinations must be CPU or CUDA tensors");
    if (!meta) check_in_storage(op, t, label, i, /*written=*/true);
  }
  // No two destinations may share memory (one would overwrite the other); exact for strided
  // views, so interleaved disjoint ones (x[0::2], x[1::2]) are fine.
  if (!meta) check_no_overlap(op, out, label, {}, label, "; no two destinations may share memory");
}

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

void free_huge(void* p) { std::free(p); }

// Read destinations of 2 MiB or more start on a 2 MiB boundary and ask for transparent huge
// pages, as torch's own CPU allocator does under THP_MEM_ALLOC_ENABLE=1; smaller ones come from
// torch's CPU allocator. Without the alignment only the aligned middle of a tensor gets huge
// pages and its edges still fault 4 KiB at a time (48,000 faults per GiB in 300 tensors).
class ReadAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n < kHugePage) return c10::GetCPUAllocator()->allocate(n);
    // The last huge page whole too, where that costs at most an eighth more memory: otherwise
    // the tail of an odd-sized tensor still faults 4 KiB at a time.
    const size_t whole = (n + kHugePage - 1) / kHugePage * kHugePage;
    const size_t size = (whole - n) * 8 <= n ? whole : n;
    void* p = nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, ::posix_memalign(&p, kHugePage, size) == 0,
                     "fsdp_ema: cannot allocate ", n, " bytes for a load");
    // A hint only: where the kernel has no THP (or says no), the pages stay 4 KiB.
    ::madvise(p, size / kHugePage * kHugePage, MADV_HUGEPAGE);
    return {p, p, &free_huge, at::Device(at::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Copies from two pinned buffers on the device's current stream; an event per buffer says when
// its copies are done.
class DeviceTarget final : public format::StageTarget {
 public:
  DeviceTarget(const std::vector<at::Tensor>& dst, at::Device device)
      : stream_(c10::impl::VirtualGuardImpl(device.type()).getStream(device)),
        events_{c10::Event(device.type()), c10::Event(device.type())} {
    bytes_.reserve(dst.size());
    for (const at::Tensor& t : dst) bytes_.push_back(t.reshape({-1}).view(at::kByte));
  }
  ~DeviceTarget() override {
    // On an error between steps: the copies still in flight read the buffers; wait for them.
    for (auto& e : events_) {
      if (e.was_marked_for_recording()) e.synchronize();
    }
  }
  std::byte* buffer(int b, uint64_t bytes) override {
    at::Tensor& buf = buffers_[static_cast<size_t>(b)];
    if (!buf.defined()) {
      buf = at::empty({static_cast<int64_t>(bytes)},
                      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    }
    return static_cast<std::byte*>(buf.data_ptr());
  }
  void copy(size_t dst, uint64_t dst_offset, int b, uint64_t src_offset, uint64_t bytes) override {
    const auto n = static_cast<int64_t>(bytes);
    bytes_[dst]
        .narrow(0, static_cast<int64_t>(dst_offset), n)
        .copy_(buffers_[static_cast<size_t>(b)].narrow(0, static_cast<int64_t>(src_offset), n),
               /*non_blocking=*/true);
  }
  void release(int b) override { events_[static_cast<size_t>(b)].record(stream_); }
  void acquire(int b) override { events_[static_cast<size_t>(b)].synchronize(); }
  void finish() override {
    for (auto& e : events_) {
      if (e.was_marked_for_recording()) e.synchronize();
    }
  }

 private:
  c10::Stream stream_;
  std::array<c10::Event, 2> events_;
  std::array<at::Tensor, 2> buffers_;
  std::vector<at::Tensor> bytes_;
};

// The pipeline's requests for items `which` of the plan, item which[k] landing in destination k.
struct Requests {
  std::vector<format::ReadRequest> requests;
  std::vector<uint64_t> dst_bytes;
};

Requests requests_for(const format::CheckpointDir& dir, const LoadPlan& plan,
                      std::span<const size_t> which) {
  Requests r;
  r.requests.reserve(which.size());
  r.dst_bytes.reserve(which.size());
  for (size_t k = 0; k < which.size(); ++k) {
    const LoadItem& item = plan[which[k]];
    format::ReadRequest q;
    q.tensor = dir.stored(item.tensor);
    q.rows = item.rows;
    q.box_offsets = item.box_offsets;
    q.box_shape = item.box_shape;
    q.dst = k;
    r.requests.push_back(q);
    const auto shape = item_shape(dir, item);
    r.dst_bytes.push_back(*format::nbytes(shape, q.tensor.dtype));
  }
  return r;
}

std::vector<size_t> iota(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

// Items `which` into host memory dst[k] (contiguous, item which[k]'s bytes; null: verify only).
void read_to_host(const format::CheckpointDir& dir, const LoadPlan& plan,
                  std::span<const size_t> which, std::span<std::byte* const> dst, bool verify) {
  const Requests r = requests_for(dir, plan, which);
  const format::ReadPlan p = dir.plan(r.requests, r.dst_bytes, {verify, nullptr});
  format::execute_reads(p, dst, {read_threads(), nullptr});
}

// Runs a plan onto contiguous tensors of one non-CPU device (dst[i] for destination i) through
// the two pinned staging buffers, on the device's current stream; complete when it returns.
void stage_to_device(const format::ReadPlan& plan, const std::vector<at::Tensor>& dst) {
  if (dst.empty()) return;
  const at::Device device = dst.front().device();
  for (const at::Tensor& t : dst) {
    TORCH_INTERNAL_ASSERT(t.device() == device && t.is_contiguous() && !device.is_cpu());
  }
  const c10::DeviceGuard guard(device);
  DeviceTarget target(dst, device);
  format::execute_staged(plan, target, read_threads());
}

void read_to_device(const format::CheckpointDir& dir, const LoadPlan& plan,
                    std::span<const size_t> which, const std::vector<at::Tensor>& dst,
                    bool verify) {
  const Requests r = requests_for(dir, plan, which);
  stage_to_device(dir.plan(r.requests, r.dst_bytes, {verify, nullptr}), dst);
}

// The stored piece of item `item` that holds exactly what it reads, if one does.
const format::StoredPiece* exact_piece(const format::CheckpointDir& dir, const LoadItem& item) {
  const format::StoredTensor t = dir.stored(item.tensor);
  const std::vector<int64_t> shape = item_shape(dir, item);
  for (const format::StoredPiece& p : t.pieces) {
    if (!std::ranges::equal(p.info->shape, shape)) continue;
    if (item.box_shape.empty()) {
      if (p.offsets.empty() || p.offsets[0] == item.rows.begin) return &p;
    } else if (std::ranges::equal(p.offsets, item.box_offsets)) {
      return &p;
    }
  }
  return nullptr;
}

// The mappings of one zero-copy load: each file it views mapped once, by this load alone
// (ShardFile::map), so that a write through one load's tensors reaches no other load's, nor the
// bytes a later load verifies.
class LoadMappings {
 public:
  const std::shared_ptr<const format::ShardMapping>& of(const format::ShardFile& file) {
    std::shared_ptr<const format::ShardMapping>& m = maps_[&file];
    if (!m) m = file.map();
    return m;
  }
  // The mapping of a file mapped already (no insertion: safe on several threads).
  const std::shared_ptr<const format::ShardMapping>& lookup_existing(
      const format::ShardFile& file) const {
    return maps_.at(&file);
  }
  // The same, for execute_reads.
  std::function<const format::ShardMapping&(const format::ShardFile&)> lookup() const {
    return [this](const format::ShardFile& file) -> const format::ShardMapping& {
      return *lookup_existing(file);
    };
  }

 private:
  std::unordered_map<const format::ShardFile*, std::shared_ptr<const format::ShardMapping>> maps_;
};

// A zero-copy view of a tensor's bytes in `mapping` (undefined where the mapping does not hold
// them aligned for the dtype), which the view keeps alive.
at::Tensor mapped_view(const std::shared_ptr<const format::ShardMapping>& mapping,
                       const format::TensorInfo& info, std::vector<int64_t> shape) {
  if (info.nbytes == 0) return {};
  const auto bytes = mapping->data(info);
  if (reinterpret_cast<uintptr_t>(bytes.data()) % format::dtype_size(info.dtype) != 0) return {};
  const auto options = at::TensorOptions().dtype(to_scalar_type(info.dtype));
  return at::from_blob(
      const_cast<std::byte*>(bytes.data()), shape, [mapping](void*) {}, options);
}

}  // namespace

at::Tensor empty_for_read(c10::IntArrayRef shape, at::ScalarType dtype) {
  static ReadAllocator allocator;  // lives as long as the tensors whose storages name it
  return at::detail::empty_generic(shape, &allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, std::nullopt);
}

std::vector<at::Tensor> read_fresh(const std::shared_ptr<const format::CheckpointDir>& dir,
                                   const LoadPlan& plan, bool verify,
                                   std::optional<at::Device> device, bool mmap) {
  const at::Device target = device.value_or(at::Device(at::kCPU));
  std::vector<at::Tensor> out(plan.size());
  if (target.is_cuda()) {
    for (size_t i = 0; i < plan.size(); ++i) {
      out[i] = at::empty(item_shape(*dir, plan[i]),
                         at::TensorOptions().dtype(item_dtype(*dir, plan[i])).device(target));
    }
    read_to_device(*dir, plan, iota(plan.size()), out, verify);
    return out;
  }
  if (!target.is_cpu()) {
    // One tensor at a time through the CPU: the host never holds the whole load.
    for (size_t i = 0; i < plan.size(); ++i) {
      out[i] = read_fresh(dir, LoadPlan{plan[i]}, verify, std::nullopt, false)[0].to(target);
    }
    return out;
  }
  // Zero-copy views (opt-in) where one piece holds exactly the item, of this load's own mappings
  // and verified through them; owned tensors for the rest. Allocations on torch's threads: a load
  // of 200,000 small tensors is 200,000 of them.
  LoadMappings maps;
  std::vector<const format::StoredPiece*> exact(plan.size(), nullptr);
  if (mmap) {
    for (size_t i = 0; i < plan.size(); ++i) {
      exact[i] = exact_piece(*dir, plan[i]);
      if (exact[i] != nullptr && exact[i]->info->nbytes > 0) maps.of(*exact[i]->file);
    }
  }
  std::vector<char> mapped(plan.size(), 0);
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (const format::StoredPiece* p = exact[i]; p != nullptr && p->info->nbytes > 0) {
        out[i] = mapped_view(maps.lookup_existing(*p->file), *p->info, item_shape(*dir, plan[i]));
      }
      mapped[i] = out[i].defined();
      if (!mapped[i]) out[i] = empty_for_read(item_shape(*dir, plan[i]), item_dtype(*dir, plan[i]));
    }
  });
  std::vector<size_t> owned, views;
  for (size_t i = 0; i < plan.size(); ++i) (mapped[i] ? views : owned).push_back(i);
  if (!views.empty()) {
    const Requests r = requests_for(*dir, plan, views);
    const std::vector<std::byte*> none(views.size(), nullptr);
    format::execute_reads(dir->plan(r.requests, r.dst_bytes, {verify, nullptr}), none,
                          {read_threads(), maps.lookup()});
  }
  std::vector<std::byte*> dst;
  dst.reserve(owned.size());
  for (size_t i : owned) dst.push_back(static_cast<std::byte*>(out[i].data_ptr()));
  read_to_host(*dir, plan, owned, dst, verify);
  return out;
}

void read_into(const format::CheckpointDir& dir, const LoadPlan& plan, at::TensorList out,
               bool verify) {
  bump_versions(out);  // as torch's in-place ops: backward through an overwritten tensor raises
  // Contiguous CPU destinations are read into directly; contiguous device ones through the two
  // pinned buffers; the others through a host buffer of their own (pinned for CUDA), copied over
  // after the read, in batches that hold at most kStagingBytes of such buffers at a time.
  std::vector<size_t> direct;
  std::vector<std::pair<at::Device, std::vector<size_t>>> staged;  // per device, in order
  std::vector<size_t> rest;
  for (size_t i = 0; i < plan.size(); ++i) {
    const at::Tensor& t = out[i];
    if (!t.is_contiguous()) {
      rest.push_back(i);
    } else if (t.device().is_cpu()) {
      direct.push_back(i);
    } else {
      auto it = std::find_if(staged.begin(), staged.end(),
                             [&](const auto& s) { return s.first == t.device(); });
      if (it == staged.end()) it = staged.insert(staged.end(), {t.device(), {}});
      it->second.push_back(i);
    }
  }
  {
    std::vector<std::byte*> dst;
    dst.reserve(direct.size());
    for (size_t i : direct) dst.push_back(static_cast<std::byte*>(out[i].data_ptr()));
    read_to_host(dir, plan, direct, dst, verify);
  }
  for (const auto& [device, indices] : staged) {
    std::vector<at::Tensor> dst;
    for (const size_t i : indices) dst.push_back(out[i]);
    read_to_device(dir, plan, indices, dst, verify);
  }
  constexpr uint64_t kStagingBytes = uint64_t{256} << 20;
  for (size_t begin = 0; begin < rest.size();) {
    std::vector<size_t> batch;
    std::vector<at::Tensor> host;
    std::vector<std::byte*> dst;
    uint64_t bytes = 0;
    for (; begin < rest.size() && bytes < kStagingBytes; ++begin) {
      const at::Tensor& t = out[rest[begin]];
      bytes += t.nbytes();
      batch.push_back(rest[begin]);
      host.push_back(at::detail::empty_cpu(t.sizes(), t.scalar_type(),
                                           /*pin_memory=*/t.device().is_cuda(), std::nullopt));
      dst.push_back(static_cast<std::byte*>(host.back().data_ptr()));
    }
    read_to_host(dir, plan, batch, dst, verify);
    for (size_t k = 0; k < batch.size(); ++k) out[batch[k]].copy_(host[k]);
  }
}

void check_reads(const format::CheckpointDir& dir, const LoadPlan& plan, bool verify) {
  const std::vector<std::byte*> none(plan.size(), nullptr);
  read_to_host(dir, plan, iota(plan.size()), none, verify);
}

std::vector<at::Tensor> read_file(const std::shared_ptr<const format::ShardFile>& file, bool verify,
                                  at::Device device, bool mmap) {
  const auto& infos = file->tensors();
  std::vector<at::Tensor> out(infos.size());
  auto shape_of = [](const format::TensorInfo& t) {
    return std::vector<int64_t>(t.shape.begin(), t.shape.end());
  };
  if (device.is_cuda()) {
    for (size_t i = 0; i < infos.size(); ++i) {
      out[i] = at::empty(shape_of(infos[i]),
                         at::TensorOptions().dtype(to_scalar_type(infos[i].dtype)).device(device));
    }
    stage_to_device(format::plan_file_reads(*file, verify), out);
    return out;
  }
  if (!device.is_cpu()) {
    // One tensor at a time through the CPU: each tensor's units alone (the file's plan has its
    // units in file order, one tensor after the other), so the host never holds the whole file.
    const format::ReadPlan plan = format::plan_file_reads(*file, verify);
    std::vector<std::byte*> dst(infos.size(), nullptr);
    size_t u = 0;
    for (size_t i = 0; i < infos.size(); ++i) {
      at::Tensor host = empty_for_read(shape_of(infos[i]), to_scalar_type(infos[i].dtype));
      format::ReadPlan one;
      for (; u < plan.units.size() && plan.placements[plan.units[u].placement_begin].dst == i;
           ++u) {
        format::ReadUnit unit = plan.units[u];
        unit.placement_begin = one.placements.size();
        one.placements.insert(one.placements.end(),
                              plan.placements.begin() + plan.units[u].placement_begin,
                              plan.placements.begin() + plan.units[u].placement_end);
        unit.placement_end = one.placements.size();
        one.units.push_back(unit);
        one.read_bytes += unit.length;
      }
      dst[i] = static_cast<std::byte*>(host.data_ptr());
      format::execute_reads(one, dst, {read_threads(), nullptr});
      dst[i] = nullptr;
      out[i] = host.to(device);
    }
    return out;
  }
  std::vector<std::byte*> dst(infos.size(), nullptr);
  bool any_view = false;
  LoadMappings maps;  // this load's own mapping of the file
  for (size_t i = 0; i < infos.size(); ++i) {
    if (mmap && infos[i].nbytes > 0)
      out[i] = mapped_view(maps.of(*file), infos[i], shape_of(infos[i]));
    if (out[i].defined()) {
      any_view = true;
      continue;
    }
    out[i] = empty_for_read(shape_of(infos[i]), to_scalar_type(infos[i].dtype));
    dst[i] = static_cast<std::byte*>(out[i].data_ptr());
  }
  const format::ReadPlan plan = format::plan_file_reads(*file, verify);
  if (!any_view) {
    format::execute_reads(plan, dst, {read_threads(), nullptr});
    return out;
  }
  // Views are verified through the mapping, owned tensors as they are read.
  const format::ReadPlan views =
      format::select_destinations(plan, [&](size_t d) { return dst[d] == nullptr; });
  const format::ReadPlan owned =
      format::select_destinations(plan, [&](size_t d) { return dst[d] != nullptr; });
  const std::vector<std::byte*> none(infos.size(), nullptr);
  format::execute_reads(views, none, {read_threads(), maps.lookup()});
  format::execute_reads(owned, dst, {read_threads(), nullptr});
  return out;
}

}  // namespace fsdp_ema::ops
