// Reads the format tests make that no product code needs as a call of its own: one request on
// an open CheckpointDir (rows, a rank's chunk, a box), planned and executed as every load is
// (CheckpointDir::plan + execute_reads), and the index of a directory's rank files built without
// committing it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/read_exec.h"
#include "fsdp_ema/format/rows.h"

namespace fsdp_ema::format::testing {

inline void read_request(const CheckpointDir& ckpt, const ReadRequest& q, void* dst,
                         size_t dst_bytes, bool verify, size_t threads) {
  std::byte* d = static_cast<std::byte*>(dst);
  const uint64_t bytes = dst_bytes;
  const ReadPlan plan = ckpt.plan(std::span(&q, 1), std::span(&bytes, 1), {verify, {}});
  execute_reads(plan, std::span(&d, 1), {threads, nullptr});
}

// Rows [row_begin, row_end) of dim 0.
inline void read_rows(const CheckpointDir& ckpt, std::string_view name, int64_t row_begin,
                      int64_t row_end, void* dst, size_t dst_bytes, bool verify = true,
                      size_t threads = 1) {
  ReadRequest q;
  q.tensor = ckpt.stored(ckpt.index_of(name));
  q.rows = {row_begin, row_end};
  read_request(ckpt, q, dst, dst_bytes, verify, threads);
}

// The rows rank `rank` of `world` holds (tensor_rows: a 0-dim tensor whole).
inline void read_chunk(const CheckpointDir& ckpt, std::string_view name, int64_t rank,
                       int64_t world, void* dst, size_t dst_bytes, bool verify = true,
                       size_t threads = 1) {
  ReadRequest q;
  q.tensor = ckpt.stored(ckpt.index_of(name));
  q.rows = tensor_rows(q.tensor.shape, rank, world);
  read_request(ckpt, q, dst, dst_bytes, verify, threads);
}

// The box [offsets, offsets + shape), row-major.
inline void read_slice(const CheckpointDir& ckpt, std::string_view name,
                       std::span<const int64_t> offsets, std::span<const int64_t> shape, void* dst,
                       size_t dst_bytes, bool verify = true, size_t threads = 1) {
  ReadRequest q;
  q.tensor = ckpt.stored(ckpt.index_of(name));
  q.box_offsets = offsets;
  q.box_shape = shape;
  read_request(ckpt, q, dst, dst_bytes, verify, threads);
}

// The index of the world_size files shard-<r>-of-<world_size>.safetensors in `dir` (what a commit
// builds, without writing it).
inline CheckpointIndex index_of_rank_files(const std::string& dir, int64_t world_size) {
  std::vector<std::string> names;
  for (int64_t r = 0; r < world_size; ++r) names.push_back(shard_file_name(r, world_size));
  return build_index_from_files(dir, names, world_size);
}

}  // namespace fsdp_ema::format::testing
