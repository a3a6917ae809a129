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

  // Reads the whole tensor (row-major, dst_bytes == tensor_nbytes). With verify, every piece read
  // is checked against its checksum (each piece at most once per CheckpointDir). read_full,
  // read_rows and read_chunk are read_rows_batch of one read on the caller's thread.
  void read_full(std::string_view name, void* dst, size_t dst_bytes, bool verify = true) const;
  // One destination of read_rows_batch: rows [rows.begin, rows.end) of dim 0 of tensor `name`
  // (a 0-dim tensor is read whole; rows are ignored), row-major into dst.
  struct RowsRead {
    std::string_view name;
    RowRange rows;
    void* dst = nullptr;
    size_t dst_bytes = 0;
  };
  // The read path of every load: each read checked as read_rows checks it, then all of them
  // through read_pieces (piece_reads.h: chunks of 8 MiB on up to `threads` threads, 0 meaning
  // the machine's cores). With verify, a piece read whole is hashed in order as it is read and
  // checked against its checksum; a piece read in part is verified (verify_piece) before any
  // read starts. Each piece is hashed at most once per CheckpointDir, as in read_full.
  void read_rows_batch(std::span<const RowsRead> reads, bool verify, size_t threads) const;
  // Rows [row_begin, row_end) of dim 0 (the tensor must have at least one dimension).
  void read_rows(std::string_view name, int64_t row_begin, int64_t row_end, void* dst,
                 size_t dst_bytes, bool verify = true) const;
  // The rows rank `rank` of `world` holds: read_rows(tensor_rows(shape, rank, world)); a 0-dim
  // tensor whole (every rank holds it).
  void read_chunk(std::string_view name, int64_t rank, int64_t world, void* dst, size_t dst_bytes,
                  bool verify = true) const;
  // Any box [offsets, offsets + shape) of the tensor, written row-major into dst.
  void read_slice(std::string_view name, std::span<const int64_t> offsets,
                  std::span<const int64_t> shape, void* dst, size_t dst_bytes,
                  bool verify = true) const;
  // Elements [elem_begin, elem_end) of the flattened (row-major) tensor.
  void read_flat(std::string_view name, uint64_t elem_begin, uint64_t elem_end, void* dst,
                 size_t dst_bytes, bool verify = true) const;

  // Checks piece `piece` of tensor `name` against its checksum (once; later calls return at
  // once). True when verified, false when it has no checksum (DCP); throws on a mismatch.
  // `mapped`: hash the bytes where the shard file's mapping holds them (ShardFile::
  // compute_checksum), for zero-copy loads, whose views read that mapping anyway.
  bool verify_piece(std::string_view name, size_t piece, bool mapped = false) const;
  // verify_piece for every piece; returns the number of pieces with a checksum.
  size_t verify_all() const;
  // ShardFile::check_unchanged for every file: what a load checks before it writes pieces it
  // hashed earlier (and once more after), so that a file rewritten in place meanwhile is refused.
  void check_unchanged() const;

 private:
  struct Impl;
  explicit CheckpointDir(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp_ema::format
