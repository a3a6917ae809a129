// The read pipeline, stage 1 of 3 (plan -> read + verify -> place; docs/ARCHITECTURE.md): which
// bytes of which stored piece a load reads, how they are verified in the pass that reads them,
// and where each of them lands. Every load of the library plans here: whole tensors, a rank's
// dim-0 rows, any box (tensor-parallel layouts), into fresh memory, into existing destinations,
// to the CPU or through the staging buffers to a device (read_exec.h runs the plans).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/rows.h"
#include "fsdp_ema/format/shard_file.h"

namespace fsdp_ema::format {

// One stored box of a tensor: the file holding it, its header entry there (dtype, local shape,
// data offset, checksums) and its global offsets.
struct StoredPiece {
  const ShardFile* file = nullptr;
  const TensorInfo* info = nullptr;
  std::span<const int64_t> offsets;
};

// A tensor as a checkpoint stores it: its global shape and pieces, which cover it exactly once
// (CheckpointDir::stored; a lone shard file's tensors are one piece each).
struct StoredTensor {
  std::string_view name;
  DType dtype = DType::kF32;
  std::span<const int64_t> shape;
  std::span<const StoredPiece> pieces;
};

// What a load asks of one tensor: rows [rows.begin, rows.end) of dim 0 with every other
// dimension whole, or (box_shape not empty) the box [box_offsets, box_offsets + box_shape). A
// 0-dim tensor is read whole (rows and box ignored). The bytes land row-major from byte
// `dst_offset` of destination `dst`.
struct ReadRequest {
  StoredTensor tensor;
  RowRange rows;
  std::span<const int64_t> box_offsets;
  std::span<const int64_t> box_shape;
  size_t dst = 0;
  uint64_t dst_offset = 0;
};

// How a unit's bytes are checked as they are read. Every check also applies the data checks of
// a read (BOOL bytes are 0 or 1; ShardFile::read).
enum class UnitCheck : uint8_t {
  kNone,    // nothing stored to check against (DCP files), or verify off
  kBlocks,  // each block it covers against its block checksum (offset and end on block edges)
  kWhole,   // the whole piece (offset 0, length nbytes) against the piece's checksum
  kStream,  // consecutive bytes of a piece fed to a ReadSession, checked once the last arrives
};

// Bytes [offset, offset + length) of one stored piece, read once and checked as they are read.
struct ReadUnit {
  const ShardFile* file = nullptr;
  const TensorInfo* info = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
  UnitCheck check = UnitCheck::kNone;
  // Exactly one placement covers the whole unit: a host destination can take the read directly.
  bool direct = false;
  size_t placement_begin = 0;  // its placements, in unit order
  size_t placement_end = 0;
  uint64_t block_bytes = 0;  // kBlocks: the file's block size
  size_t stream = 0;         // kStream: the piece's slot in the session
};

// Bytes [unit_offset, unit_offset + length) of a unit land at byte dst_offset of destination dst.
struct Placement {
  uint64_t unit_offset = 0;
  uint64_t length = 0;
  size_t dst = 0;
  uint64_t dst_offset = 0;
};

class ReadSession;

struct ReadPlan {
  std::vector<ReadUnit> units;
  std::vector<Placement> placements;
  uint64_t read_bytes = 0;               // what the units read
  uint64_t placed_bytes = 0;             // what lands in destinations
  std::shared_ptr<ReadSession> session;  // kStream units' state
};

// Streamed verification for readers that read consecutive parts of pieces in order, call after
// call (the consolidated export fills its output this way): a piece without block checksums is
// then hashed once across the calls, and a mismatch raises on the call that reads its last byte.
// A part read out of order is read whole (verified in that pass) and ends the piece's stream,
// which check_complete then reports. Not thread-safe across calls.
class ReadSession {
 public:
  ReadSession();
  ~ReadSession();
  ReadSession(const ReadSession&) = delete;
  ReadSession& operator=(const ReadSession&) = delete;

  // The slot of piece `info` when its stream is at `offset` (a new piece: at 0), its stream then
  // moved on by `length`; nullopt when the stream is elsewhere (the part is then read whole).
  std::optional<size_t> continue_at(const TensorInfo& info, uint64_t offset, uint64_t length);
  // Feeds the piece's next bytes (the ones continue_at allowed) and checks the digest once the
  // last byte came in. Throws FormatError naming the file on a mismatch.
  void feed(size_t slot, const ShardFile& file, const TensorInfo& info, const std::byte* data,
            uint64_t length);
  // Throws FormatError naming the piece unless every piece streamed was streamed to its end and
  // in order (then every byte it returned was verified): call once the reads are done, before
  // their bytes are used (the export calls it before it commits its files).
  void check_complete() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct PlanOptions {
  bool verify = true;
  // Stream pieces without block checksums that are read in part (see ReadSession).
  std::shared_ptr<ReadSession> session;
};

// The check of one request the planner makes first: rows or box inside the tensor, one offset and
// size per dimension, none negative. Throws FormatError naming the tensor (`where`: the directory
// or file). For callers that size destinations from a request before planning it.
void check_read_request(const ReadRequest& request, const std::string& where);

// The one planner. Checks each request (rows or box inside the tensor, one offset and size per
// dimension; its bytes inside dst_bytes[dst]) before anything is planned and throws FormatError
// naming the tensor (`where`: the directory or file) on the first bad one. For each piece the
// request touches:
//   - with block checksums (or a piece of at most one block): the block-aligned cover of what is
//     needed, split so that the aligned middle of a dim-0 range is one direct unit and only the
//     edge blocks go through a buffer (a resharded load reads its own bytes plus at most one
//     block per piece edge);
//   - with a whole-piece checksum only: the whole piece, read and hashed, the needed bytes placed
//     from that pass (or, with a session, only the needed bytes, streamed);
//   - with no checksum (or verify off): the needed runs, runs less than 64 KiB apart merged.
// Linear in requests, pieces touched and placements.
ReadPlan plan_reads(std::span<const ReadRequest> requests, std::span<const uint64_t> dst_bytes,
                    const std::string& where, const PlanOptions& options = {});

// The plan of reading every tensor of one shard file whole, tensor i (file order) into
// destination i.
ReadPlan plan_file_reads(const ShardFile& file, bool verify);

// The part of a plan whose units place into destinations d with keep(d) (a unit's placements all
// go to one destination in the plans above), destination indices unchanged.
ReadPlan select_destinations(const ReadPlan& plan, const std::function<bool(size_t)>& keep);

}  // namespace fsdp_ema::format
