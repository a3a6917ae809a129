// load_into_: a committed checkpoint read straight into tensors the caller already has (a model's
// parameters, an optimizer's state), as torch.distributed.checkpoint.load does: no allocation,
// no first-touch page faults, no second copy. Every argument and every stored piece's checksum is
// checked before the first destination byte is written.
#include "ops/load_into.h"

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <memory>

#include "fsdp_ema/format/rows.h"
#include "ops/checkpoint_info.h"
#include "ops/format_bridge.h"
#include "ops/load_tensors.h"
#include "ops/memory.h"
#include "ops/reads.h"
#include "ops/staged_reads.h"
#include "ops/tracing.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::load_into_: ";

using Plan = RowsPlan;

// Opens the checkpoint and checks every destination against what is stored (and, for real
// tensors, that no two share memory); reads no tensor data.
Plan plan_load_into(const std::shared_ptr<const format::CheckpointDir>& dir,
                    c10::string_view directory, const std::vector<std::string>& names,
                    at::TensorList out, int64_t rank, int64_t world_size, bool meta) {
  check_rank(kOp, rank, world_size);
  TORCH_CHECK(names.size() == out.size(), kOp, "names has ", names.size(), " entries but out has ",
              out.size());

  // Every destination against what is stored, before anything is read.
  std::vector<std::pair<const format::IndexTensor*, format::RowRange>> plan;
  plan.reserve(names.size());
  auto label = [&](size_t i) { return "out[" + std::to_string(i) + "] ('" + names[i] + "')"; };
  for (const auto i : c10::irange(names.size())) {
    const format::IndexTensor* info = dir->find(names[i]);
    TORCH_CHECK(info != nullptr, kOp, "names[", i, "] '", names[i], "' is not in checkpoint '",
                directory, "'");
    const format::RowRange rows = format::tensor_rows(info->shape, rank, world_size);
    const std::vector<int64_t> shape = rows_shape(*info, rows);
    const at::Tensor& t = out[i];
    TORCH_CHECK(t.defined(), kOp, "out[", i, "] ('", names[i], "') is an undefined tensor");
    check_strided(kOp, t, label, i);
    TORCH_CHECK(t.scalar_type() == to_scalar_type(info->dtype), kOp, "out[", i, "] ('", names[i],
                "') has dtype ", t.scalar_type(), " but the checkpoint stores ",
                to_scalar_type(info->dtype));
    // Sizes as SymInts: a tracer's destinations may have symbolic shapes.
    bool same_shape = t.dim() == static_cast<int64_t>(shape.size());
    for (int64_t d = 0; same_shape && d < t.dim(); ++d) same_shape = t.sym_size(d) == shape[d];
    TORCH_CHECK(same_shape, kOp, "out[", i, "] ('", names[i], "') has shape ", t.sym_sizes(),
                " but rank ", rank, " of ", world_size, " holds ", at::IntArrayRef(shape),
                " of it");
    // In the Meta kernel (tracing) every destination must be a tracer's fake tensor.
    const bool usable = meta ? t.is_meta() && !is_real_meta(t) : t.is_cpu() || t.is_cuda();
    TORCH_CHECK(usable, kOp, "out[", i, "] ('", names[i], "') is ",
                is_real_meta(t) ? "a meta tensor, which has no memory to load into"
                                : "on " + t.device().str() + " while other destinations are not",
                "; destinations must be CPU or CUDA tensors");
    if (meta) {
      plan.emplace_back(info, rows);
      continue;
    }
    check_in_storage(kOp, t, label, i, /*written=*/true);
    plan.emplace_back(info, rows);
  }
  // No two destinations may share memory (one would overwrite the other); exact for strided
  // views, so interleaved disjoint ones (x[0::2], x[1::2]) are fine.
  if (!meta) check_no_overlap(kOp, out, label, {}, label, "; no two destinations may share memory");
  return plan;
}

std::shared_ptr<const format::CheckpointDir> open_dir(c10::string_view directory) {
  return translate_errors(kOp, [&] {
    return std::make_shared<const format::CheckpointDir>(
        format::CheckpointDir::open(std::string(directory)));
  });
}

// Runs `read` (reads of pieces hashed before, by this call or an earlier check_into, which are
// not hashed again) between two fstat checks of every file: a file rewritten in place since it
// was opened, even with its size and mtime kept, is refused before the first destination is
// written, and reported if it changed while it was read.
template <typename F>
auto between_unchanged_checks(const format::CheckpointDir& dir, F&& read) {
  dir.check_unchanged();
  auto result = read();
  try {
    dir.check_unchanged();
  } catch (const format::FormatError& e) {
    throw format::FormatError(std::string(e.what()) +
                              "; it changed while it was read: what was read from it may be "
                              "partly the new content");
  }
  return result;
}

// load_into_'s reads, on a directory opened already.
void read_into(const format::CheckpointDir& dir, const Plan& plan, at::TensorList out,
               bool verify) {
  translate_errors(kOp, [&] {
    // Every stored piece these reads touch is hashed first (once each, on the machine's cores),
    // so that a corrupted file is refused with every destination still untouched.
    if (verify) verify_pieces(dir, plan);
    between_unchanged_checks(dir, [&] {
      bump_versions(out);  // as torch's in-place ops: backward through an overwritten tensor raises
      // Contiguous CPU destinations are read into directly; contiguous device ones through two
      // pinned buffers, the device copying one while the file is read into the other
      // (staged_reads.h); the others through a host buffer of their own (pinned for CUDA),
      // copied over after the read, in batches that hold at most kStagingBytes of such buffers
      // at a time.
      std::vector<std::pair<at::Device, std::vector<size_t>>> staged;  // per device, in order
      std::vector<size_t> rest;
      for (size_t i = 0; i < plan.size(); ++i) {
        const at::Tensor& t = out[i];
        if (t.device().is_cpu() || !t.is_contiguous()) {
          rest.push_back(i);
          continue;
        }
        auto it = std::find_if(staged.begin(), staged.end(),
                               [&](const auto& s) { return s.first == t.device(); });
        if (it == staged.end()) it = staged.insert(staged.end(), {t.device(), {}});
        it->second.push_back(i);
      }
      for (const auto& [device, indices] : staged) {
        Plan part;
        std::vector<at::Tensor> dst;
        for (const size_t i : indices) {
          part.push_back(plan[i]);
          dst.push_back(out[i]);
        }
        read_rows_to_device(dir, part, dst);
      }
      constexpr uint64_t kStagingBytes = uint64_t{256} << 20;
      for (size_t begin = 0; begin < rest.size();) {
        Plan batch;
        std::vector<at::Tensor> host;
        uint64_t staged_bytes = 0;
        size_t end = begin;
        for (; end < rest.size() && staged_bytes < kStagingBytes; ++end) {
          const at::Tensor& t = out[rest[end]];
          const bool direct = t.device().is_cpu() && t.is_contiguous();
          if (!direct) staged_bytes += t.nbytes();
          batch.push_back(plan[rest[end]]);
          host.push_back(direct ? t
                                : at::Tensor(at::detail::empty_cpu(
                                      t.sizes(), t.scalar_type(),
                                      /*pin_memory=*/t.device().is_cuda(), std::nullopt)));
        }
        read_rows_into(dir, batch, host, verify);
        for (size_t k = begin; k < end; ++k) {
          const at::Tensor& t = out[rest[k]];
          if (!host[k - begin].is_same(t)) t.copy_(host[k - begin]);
        }
        begin = end;
      }
      return 0;
    });
  });
}

}  // namespace

void load_into_(c10::string_view directory, const std::vector<std::string>& names,
                at::TensorList out, int64_t rank, int64_t world_size, bool verify) {
  const auto dir = open_dir(directory);
  read_into(*dir, plan_load_into(dir, directory, names, out, rank, world_size, false), out, verify);
}

void load_into_meta(c10::string_view directory, const std::vector<std::string>& names,
                    at::TensorList out, int64_t rank, int64_t world_size, bool verify) {
  plan_load_into(open_dir(directory), directory, names, out, rank, world_size, true);
}

OpenCheckpoint::OpenCheckpoint(const std::string& directory)
    : directory_(directory), dir_(open_dir(directory)) {}

void OpenCheckpoint::check_into(const std::vector<std::string>& names,
                                const std::vector<at::Tensor>& out, int64_t rank,
                                int64_t world_size, bool verify) const {
  const Plan plan = plan_load_into(dir_, directory_, names, out, rank, world_size, false);
  if (verify) translate_errors(kOp, [&] { verify_pieces(*dir_, plan); });
}

void OpenCheckpoint::load_into_(const std::vector<std::string>& names,
                                const std::vector<at::Tensor>& out, int64_t rank,
                                int64_t world_size, bool verify) const {
  read_into(*dir_, plan_load_into(dir_, directory_, names, out, rank, world_size, false), out,
            verify);
}

std::vector<at::Tensor> OpenCheckpoint::load(const std::vector<std::string>& names, int64_t rank,
                                             int64_t world_size, bool verify) const {
  constexpr const char* kLoad = "fsdp_ema::OpenCheckpoint.load: ";
  check_rank(kLoad, rank, world_size);
  return translate_errors(kLoad, [&] {
    return between_unchanged_checks(*dir_, [&] {
      return load_tensors_from(dir_, names, rank, world_size, verify, std::nullopt, false);
    });
  });
}

std::string OpenCheckpoint::info() const { return info_json(*dir_); }

void OpenCheckpoint::check_unchanged() const {
  translate_errors("fsdp_ema::OpenCheckpoint.check_unchanged: ", [&] { dir_->check_unchanged(); });
}

}  // namespace fsdp_ema::ops
