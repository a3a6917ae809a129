#include "ops/checkpoint/export_writer.h"

#include <c10/util/irange.h>

#include <algorithm>
#include <numeric>

#include "ops/common/format_bridge.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kWhere = "fsdp_ema::ExportWriter: ";
// Bytes copied to the host per write call for a device tensor.
constexpr int64_t kDeviceChunkBytes = int64_t{64} << 20;

}  // namespace

ExportWriter::ExportWriter(const std::string& out_dir, const std::vector<std::string>& names,
                           const std::vector<at::Tensor>& like, std::optional<at::ScalarType> dtype,
                           int64_t max_file_bytes, bool overwrite, bool fsync) {
  TORCH_CHECK(names.size() == like.size(), kWhere, "names has ", names.size(),
              " entries but like has ", like.size());
  TORCH_CHECK(max_file_bytes >= 0, kWhere, "max_file_bytes must be >= 0, got ", max_file_bytes);
  format::ExportOptions options;
  options.max_file_bytes = static_cast<uint64_t>(max_file_bytes);
  options.overwrite = overwrite;
  options.fsync = fsync;
  if (dtype) options.dtype = to_format_dtype(*dtype, "dtype");
  std::vector<format::ExportEntry> entries(names.size());
  for (const auto i : c10::irange(names.size())) {
    TORCH_CHECK(like[i].defined(), kWhere, "like[", i, "] is an undefined tensor");
    entries[i].name = names[i];
    entries[i].dtype = to_format_dtype(like[i].scalar_type(), "'" + names[i] + "'");
    entries[i].shape.assign(like[i].sizes().begin(), like[i].sizes().end());
  }
  std::vector<size_t> order(names.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return names[a] < names[b]; });
  for (size_t i : order) {
    names_.push_back(names[i]);
    dtypes_.push_back(like[i].scalar_type());
  }
  writer_ = translate_errors(kWhere, [&] {
    return std::make_unique<format::ExportWriter>(out_dir, std::move(entries), options);
  });
}

void ExportWriter::write(const std::string& name, const at::Tensor& tensor) {
  TORCH_CHECK(writer_, kWhere, "the writer is finished");
  const auto it = std::lower_bound(names_.begin(), names_.end(), name);
  TORCH_CHECK(it != names_.end() && *it == name, kWhere, "'", name,
              "' is not a tensor the export was planned with");
  const at::ScalarType want = dtypes_[static_cast<size_t>(it - names_.begin())];
  TORCH_CHECK(tensor.scalar_type() == want, kWhere, "'", name, "' comes as ", tensor.scalar_type(),
              " but was planned as ", want);
  const at::Tensor flat = tensor.detach().contiguous().reshape({-1});
  const int64_t n = flat.numel();
  if (flat.device().is_cpu()) {
    translate_errors(
        kWhere, [&] { writer_->write(name, 0, static_cast<uint64_t>(n), flat.const_data_ptr()); });
    return;
  }
  const int64_t step = std::max<int64_t>(1, kDeviceChunkBytes / flat.element_size());
  for (int64_t e = 0; e < n; e += step) {
    const at::Tensor host = flat.narrow(0, e, std::min(step, n - e)).cpu();
    translate_errors(kWhere, [&] {
      writer_->write(name, static_cast<uint64_t>(e), static_cast<uint64_t>(host.numel()),
                     host.const_data_ptr());
    });
  }
}

int64_t ExportWriter::finish() {
  TORCH_CHECK(writer_, kWhere, "the writer is finished");
  const auto result = translate_errors(kWhere, [&] { return writer_->finish(); });
  writer_.reset();
  return static_cast<int64_t>(result.total_size);
}

void ExportWriter::abort() { writer_.reset(); }

int64_t ExportWriter::total_size() const {
  TORCH_CHECK(writer_, kWhere, "the writer is finished");
  return static_cast<int64_t>(writer_->total_size());
}

}  // namespace fsdp_ema::ops
