// The ExportWriter op class (torch.classes.fsdp_ema.ExportWriter): format::ExportWriter for
// tensors, so that ShardedEMA.export writes the same Hugging Face files as `fsdp-ema export`
// without Python touching the file system.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/custom_class.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_ema/format/export.h"

namespace fsdp_ema::ops {

class ExportWriter : public torch::CustomClassHolder {
 public:
  //   out_dir:        the export directory (created if missing)
  //   names:          [N] tensor names
  //   like:           [N] tensors (meta is enough) with each tensor's shape and the dtype its data
  //                   will come in
  //   dtype:          cast floating tensors to this (float64/float32/float16/bfloat16), or none
  //   max_file_bytes: tensor data per file before the export is split (0: no limit)
  ExportWriter(const std::string& out_dir, const std::vector<std::string>& names,
               const std::vector<at::Tensor>& like, std::optional<at::ScalarType> dtype,
               int64_t max_file_bytes, bool overwrite, bool fsync);
  // The whole tensor `name`, any device (copied to the host in chunks), of its planned dtype.
  void write(const std::string& name, const at::Tensor& tensor);
  // Puts the export in place; returns the bytes of tensor data written.
  int64_t finish();
  // Drops the staged export (out_dir is left as it was).
  void abort();
  int64_t total_size() const;

 private:
  std::unique_ptr<format::ExportWriter> writer_;
  std::vector<std::string> names_;  // sorted, for the dtype check
  std::vector<at::ScalarType> dtypes_;
};

}  // namespace fsdp_ema::ops
