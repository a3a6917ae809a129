#include "ops/load_shard.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <span>
#include <utility>

#include "fsdp_ema/format/piece_reads.h"
#include "fsdp_ema/format/shard_file.h"
#include "ops/format_bridge.h"
#include "ops/reads.h"
#include "ops/staged_reads.h"
#include "ops/tracing.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::load_shard: ";

}  // namespace

ShardContents load_shard(c10::string_view path, bool verify, std::optional<at::Device> device,
                         bool mmap) {
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
    std::vector<format::PieceRead> reads;  // the owned tensors, read in one batch
    std::vector<size_t> read_of;           // per read: its index in tensors
    // To CUDA: every tensor allocated there and staged through two pinned buffers
    // (staged_reads.h), after the whole file was verified.
    const bool staged = target.is_cuda();
    std::vector<const format::TensorInfo*> staged_infos;
    std::vector<at::Tensor> staged_dst;
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
      if (staged) {
        t = at::empty(info.shape, options.device(target));
        staged_infos.push_back(&info);
        staged_dst.push_back(t);
      } else if (!t.defined()) {
        t = empty_for_read(info.shape, to_scalar_type(info.dtype));
        reads.push_back({file.get(), &info, 0, info.nbytes, t.data_ptr(),
                         verify && !zero_copy && info.checksum.has_value()});
        read_of.push_back(tensors.size());
      }
      tensors.push_back(std::move(t));
    }
    if (staged) {
      if (verify) file->verify_all();  // one pass over the data section; nothing staged yet
      read_file_to_device(*file, staged_infos, staged_dst);
      // What was staged is what was hashed unless the file changed in place meanwhile.
      if (verify) file->check_unchanged();
      return std::make_tuple(std::move(names), std::move(tensors), std::move(offsets),
                             std::move(global_shapes));
    }
    // The read path of every load (format/piece_reads.h): chunked, on torch's thread count,
    // each tensor hashed in order as it is read. For another device, one tensor at a time, so
    // that the host never holds the whole file.
    const size_t threads = read_threads();
    const size_t batch = target.is_cpu() ? std::max<size_t>(reads.size(), 1) : 1;
    for (size_t k = 0; k < reads.size(); k += batch) {
      const size_t n = std::min(batch, reads.size() - k);
      format::read_pieces(std::span(reads).subspan(k, n), threads, [&](size_t i, uint64_t digest) {
        file->check_digest(*reads[k + i].tensor, digest);
      });
      if (target.is_cpu()) continue;
      tensors[read_of[k]] = tensors[read_of[k]].to(target);
    }
    return std::make_tuple(std::move(names), std::move(tensors), std::move(offsets),
                           std::move(global_shapes));
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
  return translate_errors(kOp, [&] {
    // Header only: the checksums are not checked (that would read the data).
    const format::ShardFile file = format::ShardFile::open(std::string(path), false);
    ShardContents out;
    auto& [names, tensors, offsets, global_shapes] = out;
    for (const format::TensorInfo& info : file.tensors()) {
      names.push_back(info.name);
      offsets.insert(offsets.end(), info.offsets.begin(), info.offsets.end());
      global_shapes.insert(global_shapes.end(), info.global_shape.begin(), info.global_shape.end());
      tensors.push_back(at::empty(info.shape, meta_options(to_scalar_type(info.dtype))));
    }
    return out;
  });
}

}  // namespace fsdp_ema::ops
