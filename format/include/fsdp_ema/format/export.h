// Consolidated export: full tensors as a Hugging Face style directory. One layout, two data paths:
// export_consolidated reads a checkpoint directory (the fsdp-ema command line), ExportWriter takes
// the tensors as a running job produces them (ShardedEMA.export, through the ExportWriter op
// class). Both plan files, headers, the index and the replacement of an earlier export with the
// same code, so the same tensors give byte-identical files either way.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/shape.h"

namespace fsdp_ema::format {

struct ExportProgress {
  uint64_t bytes_done = 0;   // tensor bytes written so far (output dtype)
  uint64_t bytes_total = 0;  // tensor bytes of the whole export
  std::string_view tensor;   // the tensor being written
  size_t file_index = 0;     // 0-based output file
  size_t num_files = 1;
};

struct ExportOptions {
  // Largest tensor data per output file; above it the export is split into
  // model-00001-of-0000N.safetensors ... (a tensor larger than the limit gets a file of its
  // own). 0 = no limit. Default 5 GB, the Hugging Face default.
  uint64_t max_file_bytes = 5'000'000'000;
  // Cast every F64/F32/F16/BF16 tensor to this dtype (round to nearest even, NaN kept); other
  // tensors (integers, bool, F8) are written unchanged. Must be one of those four.
  std::optional<DType> dtype;
  // Called from the writing thread after every chunk and at the end.
  std::function<void(const ExportProgress&)> progress;
  bool verify = true;  // check the checksum of every piece read
  bool fsync = true;
  bool overwrite = false;  // replace model files already in out_dir (else error)
  // Non-empty: export only the tensors whose names start with it (and are longer), named
  // without it ("ema." selects the EMA of a training-state checkpoint); none selected is an error.
  std::string select_prefix;
};

struct ExportResult {
  std::vector<std::string> files;  // written safetensors file names, in order
  bool wrote_index = false;        // model.safetensors.index.json (only with several files)
  uint64_t total_size = 0;         // sum of tensor bytes (the index's "total_size")
};

// Reads checkpoint `dir` (any layout CheckpointDir opens) and writes `out_dir` (created if
// missing; must not be `dir`): model.safetensors, or model-0000k-of-0000N.safetensors plus
// model.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map": {name: file}}).
// Every file is written atomically (temporary + rename), holds full tensors and
// "__metadata__": {"format": "pt"}. Tensors are assigned to files in name order.
ExportResult export_consolidated(const std::string& dir, const std::string& out_dir,
                                 const ExportOptions& options = {});

// One tensor an ExportWriter will receive: its name, shape and the dtype its data comes in (the
// file holds options.dtype where the cast applies, as in export_consolidated).
struct ExportEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

// The streaming form of export_consolidated: every file, header and offset is planned up front
// from the entries (files in name order, split at max_file_bytes, tensors in file_order within a
// file), and each tensor's data is written at its place whenever it arrives, in any order. The new
// export is staged in a hidden directory inside out_dir and put in place by finish(); a writer
// destroyed before finish() removes the staging directory and leaves out_dir as it was.
// options.progress, verify and select_prefix do not apply.
class ExportWriter {
 public:
  // Validates everything first (dtype option, names unique and non-empty, sizes, out_dir and an
  // earlier export there against options.overwrite), then creates the staged files.
  ExportWriter(const std::string& out_dir, std::vector<ExportEntry> entries,
               const ExportOptions& options);
  ~ExportWriter();
  ExportWriter(const ExportWriter&) = delete;
  ExportWriter& operator=(const ExportWriter&) = delete;

  // Writes elements [first, first + count) of tensor `name` (flattened, row-major), `data` in the
  // entry's dtype, cast on the way where the file's dtype differs.
  void write(std::string_view name, uint64_t first, uint64_t count, const void* data);
  // Checks that every element of every tensor was written, makes the files durable, writes the
  // index (several files) and puts the export in place of an earlier one.
  ExportResult finish();
  // Removes the staging directory now (finish() then refuses).
  void abort() noexcept;

  uint64_t total_size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp_ema::format
