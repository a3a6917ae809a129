// Reading a checkpoint directory: ours (index + shard files) or one written by torch DCP's
// HuggingFace storage writer; full tensors, any box of them, or the dim-0 rows one rank of M needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/read_plan.h"
#include "fsdp_ema/format/rows.h"
#include "fsdp_ema/format/shard_file.h"

namespace fsdp_ema::format {

enum class CheckpointLayout {
  // fsdp_ema.index.json + shard-<rank>-of-<world>.safetensors files.
  kFsdpEma,
  // No index: every *.safetensors file of the directory is read, pieces placed by each file's
  // DCP_SHARDING_INFO saved_offsets (zeros without it), global shape = elementwise max of
  // offsets + shape over the pieces (what DCP's HuggingFaceStorageReader does). Also reads plain
  // Hugging Face directories (model.safetensors, model-0000k-of-0000n.safetensors).
  kDcpHuggingFace,
};

std::string_view layout_name(CheckpointLayout layout);  // "fsdp_ema", "dcp-huggingface"

class CheckpointDir {
 public:
  // Opens `dir`, validating everything but the data: our layout needs the index ("incomplete
  // checkpoint: fsdp_ema.index.json missing" otherwise) and checks every shard file's header
  // against it (dtype, shape, offsets, global shape, checksum); the DCP layout checks dtypes
  // agree across files. Both check that each tensor's pieces cover it exactly once.
  static CheckpointDir open(const std::string& dir);

  CheckpointDir(CheckpointDir&&) noexcept;
  CheckpointDir& operator=(CheckpointDir&&) noexcept;
  ~CheckpointDir();

  const std::string& path() const;
  CheckpointLayout layout() const;
  // Ours: the index's world size. DCP: the number of shard files.
  int64_t world_size() const;
  // Our index, or the one synthesized from a DCP directory (no checksums there).
  const CheckpointIndex& index() const;
  // Sorted by name.
  const std::vector<IndexTensor>& tensors() const;
  const IndexTensor* find(std::string_view name) const;
  // Throws FormatError "no tensor '<name>' in <dir>".
  const IndexTensor& tensor(std::string_view name) const;
  // numel(global shape) * element size.
  uint64_t tensor_nbytes(std::string_view name) const;
  // The shard files this checkpoint reads (plain names, sorted).
  const std::vector<std::string>& files() const;
  const ShardFile& shard_file(std::string_view file) const;
  // *.safetensors files in the directory that the index does not list (always empty for the DCP
  // layout). Harmless to us, but DCP's HuggingFace reader would read them too.
  std::vector<std::string> stray_files() const;

  // The read pipeline's view of tensor `index` (its position in tensors()): shape and pieces.
  StoredTensor stored(size_t index) const;
  // Position in tensors(); throws FormatError "no tensor '<name>' in <dir>".
  size_t index_of(std::string_view name) const;
  // plan_reads (read_plan.h) of requests on this checkpoint's tensors; errors name the directory.
  ReadPlan plan(std::span<const ReadRequest> requests, std::span<const uint64_t> dst_bytes,
                const PlanOptions& options = {}) const;

  // Conveniences over plan + execute_reads (what the CLI reads through), on `threads` threads
  // (0: the machine's cores), every byte verified (with verify) in the pass that reads it:
  // the whole tensor (row-major, dst_bytes == tensor_nbytes);
  void read_full(std::string_view name, void* dst, size_t dst_bytes, bool verify = true,
                 size_t threads = 1) const;
  // elements [elem_begin, elem_end) of the flattened (row-major) tensor. A reader that reads a
  // tensor in consecutive ranges passes one `session` to every call, so that a piece without
  // block checksums is hashed once across them (read_plan.h: ReadSession).
  void read_flat(std::string_view name, uint64_t elem_begin, uint64_t elem_end, void* dst,
                 size_t dst_bytes, bool verify = true,
                 const std::shared_ptr<ReadSession>& session = {}) const;

  // Every check any read of piece `piece` of tensor `name` makes (ShardFile::verify: checksum,
  // block checksums, data checks), on the bytes as they are in the file now. True when a checksum
  // was verified, false when it has none (DCP); throws on a mismatch.
  bool verify_piece(std::string_view name, size_t piece) const;
  // verify_piece for every piece, one pass over each file (files on the machine's cores);
  // returns the number of pieces with a checksum.
  size_t verify_all() const;
  // ShardFile::check_unchanged for every file (fstat: size, mtime, ctime against the open): an
  // early refusal of a file rewritten since it was opened. Not a proof that it is unchanged (a
  // write through a shared mapping moves neither time); the proof is each read's hash.
  void check_unchanged() const;

 private:
  struct Impl;
  explicit CheckpointDir(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp_ema::format
