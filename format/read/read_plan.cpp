#include "fsdp_ema/format/read_plan.h"

#include <algorithm>
#include <unordered_map>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/shape.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

// Unverified runs closer than this are read as one unit (one pread instead of many small ones).
constexpr uint64_t kMergeGapBytes = uint64_t{64} << 10;

uint64_t align_down(uint64_t v, uint64_t b) { return v / b * b; }
uint64_t align_up(uint64_t v, uint64_t b) { return (v + b - 1) / b * b; }

// One contiguous run of a request inside a piece: piece bytes [src, src + length) land at byte
// dst_offset of the destination.
struct Run {
  uint64_t src;
  uint64_t length;
  uint64_t dst_offset;
};

// The box a request reads (offsets, shape), from its rows or its box; 0-dim: the whole tensor.
void request_box(const ReadRequest& q, Shape& off, Shape& shape) {
  const auto& t = q.tensor;
  if (t.shape.empty()) {
    off.clear();
    shape.clear();
  } else if (!q.box_shape.empty()) {
    off.assign(q.box_offsets.begin(), q.box_offsets.end());
    shape.assign(q.box_shape.begin(), q.box_shape.end());
  } else {
    off.assign(t.shape.size(), 0);
    shape.assign(t.shape.begin(), t.shape.end());
    off[0] = q.rows.begin;
    shape[0] = q.rows.size();
  }
}

// The request's bytes fit its destination (the request itself checked already).
void check_destination(const ReadRequest& q, const Shape& shape,
                       std::span<const uint64_t> dst_bytes, const std::string& where) {
  const auto& t = q.tensor;
  const uint64_t need = *nbytes(shape, t.dtype);  // inside a validated tensor: no overflow
  if (q.dst >= dst_bytes.size() || q.dst_offset > dst_bytes[q.dst] ||
      need > dst_bytes[q.dst] - q.dst_offset) {
    throw FormatError(where + ": tensor " + json_quote(t.name) + ": destination has " +
                      (q.dst < dst_bytes.size() ? std::to_string(dst_bytes[q.dst]) : "no") +
                      " bytes but the slice of shape " + shape_to_string(shape) + " of " +
                      std::string(dtype_name(t.dtype)) + " needs " + std::to_string(need) +
                      (q.dst_offset > 0 ? " from byte " + std::to_string(q.dst_offset) : ""));
  }
}

}  // namespace

void check_read_request(const ReadRequest& q, const std::string& where) {
  Shape off, shape;
  request_box(q, off, shape);
  const auto& t = q.tensor;
  auto ctx = [&] { return where + ": tensor " + json_quote(t.name); };  // on error only
  const size_t ndim = t.shape.size();
  if (ndim > 0 && q.box_shape.empty() &&
      (q.rows.begin < 0 || q.rows.begin > q.rows.end || q.rows.end > t.shape[0])) {
    throw FormatError(ctx() + ": rows [" + std::to_string(q.rows.begin) + ", " +
                      std::to_string(q.rows.end) + ") are not inside its " +
                      std::to_string(t.shape[0]) + " rows");
  }
  if (ndim > 0 && !q.box_shape.empty()) {
    if (q.box_offsets.size() != ndim || q.box_shape.size() != ndim) {
      throw FormatError(ctx() + ": slice offsets " + shape_to_string(q.box_offsets) +
                        " and shape " + shape_to_string(q.box_shape) + " need " +
                        std::to_string(ndim) + " entries each (global shape " +
                        shape_to_string(t.shape) + ")");
    }
    for (size_t d = 0; d < ndim; ++d) {
      if (off[d] < 0 || shape[d] < 0 || off[d] > t.shape[d] || shape[d] > t.shape[d] - off[d]) {
        throw FormatError(ctx() + ": slice at offsets " + shape_to_string(off) + " with shape " +
                          shape_to_string(shape) + " is outside global shape " +
                          shape_to_string(t.shape));
      }
    }
  }
}

namespace {

// The runs of box (off, shape) inside piece p, in increasing piece (and destination) order.
// dims > k are whole in the piece and the box, so a run spans dims k.. contiguously on both
// sides; the odometer walks dims < k.
template <typename Emit>
void for_each_run(const StoredPiece& p, const Box& ib, std::span<const int64_t> box_off,
                  std::span<const int64_t> box_shape, uint64_t esz, uint64_t dst_offset,
                  Emit&& emit) {
  const std::span<const int64_t> ps = p.info->shape;
  const size_t ndim = ib.shape.size();
  if (ndim == 0) {
    emit(Run{0, esz, dst_offset});
    return;
  }
  size_t k = ndim - 1;
  while (k > 0 && ib.shape[k] == ps[k] && ib.shape[k] == box_shape[k]) --k;
  uint64_t run = esz;
  for (size_t d = k; d < ndim; ++d) run *= static_cast<uint64_t>(ib.shape[d]);
  // Element strides of the piece and the box (row-major).
  Shape sstride(ndim, 1), dstride(ndim, 1);
  for (size_t d = ndim; d-- > 1;) {
    sstride[d - 1] = sstride[d] * ps[d];
    dstride[d - 1] = dstride[d] * box_shape[d];
  }
  std::vector<int64_t> idx(k, 0);
  for (;;) {
    uint64_t s = 0, q = 0;
    for (size_t d = 0; d <= k; ++d) {
      const int64_t i = d < k ? idx[d] : 0;
      s += static_cast<uint64_t>(ib.offsets[d] - p.offsets[d] + i) *
           static_cast<uint64_t>(sstride[d]);
      q +=
          static_cast<uint64_t>(ib.offsets[d] - box_off[d] + i) * static_cast<uint64_t>(dstride[d]);
    }
    emit(Run{s * esz, run, dst_offset + q * esz});
    size_t d = k;
    while (d > 0) {
      --d;
      if (++idx[d] < ib.shape[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (k == 0) return;
  }
}

// Builds a plan's units and placements.
class Planner {
 public:
  Planner(ReadPlan& plan, const PlanOptions& options) : plan_(plan), options_(options) {}

  // The runs of one request inside one piece, planned.
  void add(const StoredPiece& p, size_t dst, std::vector<Run>& runs) {
    if (runs.empty()) return;
    const TensorInfo& info = *p.info;
    const uint64_t b = p.file->header().block_bytes;
    const bool blocks = options_.verify && b > 0 && info.checksum &&
                        (info.nbytes <= b || !info.block_checksums.empty());
    if (blocks) {
      add_blocks(p, dst, runs, std::min(b, std::max<uint64_t>(info.nbytes, 1)), b);
    } else if (options_.verify && info.checksum) {
      add_whole(p, dst, runs);
    } else {
      add_unchecked(p, dst, runs);
    }
  }

 private:
  ReadUnit& open_unit(const StoredPiece& p, uint64_t offset, uint64_t end, UnitCheck check) {
    ReadUnit& u = plan_.units.emplace_back();
    u.file = p.file;
    u.info = p.info;
    u.offset = offset;
    u.length = end - offset;
    u.check = check;
    u.placement_begin = u.placement_end = plan_.placements.size();
    plan_.read_bytes += u.length;
    return u;
  }
  void place(ReadUnit& u, uint64_t src, uint64_t length, size_t dst, uint64_t dst_offset) {
    plan_.placements.push_back({src - u.offset, length, dst, dst_offset});
    u.placement_end = plan_.placements.size();
    u.direct = u.placement_end - u.placement_begin == 1 && src == u.offset && length == u.length;
    plan_.placed_bytes += length;
  }

  // Block-checked: units start and end on block edges (or the piece's end). A single run (a dim-0
  // range) becomes its edge blocks, each through a buffer, and the aligned middle, direct.
  void add_blocks(const StoredPiece& p, size_t dst, const std::vector<Run>& runs, uint64_t b,
                  uint64_t block_bytes) {
    const uint64_t n = p.info->nbytes;
    auto cover_end = [&](uint64_t e) { return std::min(align_up(e, b), n); };
    auto unit = [&](uint64_t begin, uint64_t end) -> ReadUnit& {
      ReadUnit& u = open_unit(p, begin, end, UnitCheck::kBlocks);
      u.block_bytes = block_bytes;
      return u;
    };
    if (runs.size() == 1) {
      const Run& r = runs[0];
      const uint64_t end = r.src + r.length;
      const uint64_t mid_begin = align_up(r.src, b);
      const uint64_t mid_end = end == n ? n : align_down(end, b);
      if (mid_begin >= mid_end) {  // inside one block, or over one edge between two
        ReadUnit& u = unit(align_down(r.src, b), cover_end(end));
        place(u, r.src, r.length, dst, r.dst_offset);
        return;
      }
      if (r.src < mid_begin) {
        ReadUnit& head = unit(align_down(r.src, b), mid_begin);
        place(head, r.src, mid_begin - r.src, dst, r.dst_offset);
      }
      ReadUnit& mid = unit(mid_begin, mid_end);
      place(mid, mid_begin, mid_end - mid_begin, dst, r.dst_offset + (mid_begin - r.src));
      if (mid_end < end) {
        ReadUnit& tail = unit(mid_end, cover_end(end));
        place(tail, mid_end, end - mid_end, dst, r.dst_offset + (mid_end - r.src));
      }
      return;
    }
    // A box of several runs: covers merged where their blocks touch or are close.
    ReadUnit* u = nullptr;
    for (const Run& r : runs) {
      const uint64_t begin = align_down(r.src, b);
      if (u == nullptr || begin > u->offset + u->length + kMergeGapBytes) {
        u = &unit(begin, cover_end(r.src + r.length));
      } else {
        const uint64_t end = std::max(u->offset + u->length, cover_end(r.src + r.length));
        plan_.read_bytes += end - (u->offset + u->length);
        u->length = end - u->offset;
      }
      place(*u, r.src, r.length, dst, r.dst_offset);
    }
  }

  // Whole-piece checksum only: the whole piece is read and hashed; the runs are placed from that
  // pass. With a session, a piece read in consecutive parts is streamed instead.
  void add_whole(const StoredPiece& p, size_t dst, const std::vector<Run>& runs) {
    const uint64_t n = p.info->nbytes;
    const uint64_t first = runs.front().src;
    const uint64_t last = runs.back().src + runs.back().length;
    if (options_.session && (first > 0 || last < n)) {
      if (auto slot = options_.session->continue_at(*p.info, first, last - first)) {
        ReadUnit& u = open_unit(p, first, last, UnitCheck::kStream);
        u.stream = *slot;
        for (const Run& r : runs) place(u, r.src, r.length, dst, r.dst_offset);
        return;
      }
    }
    ReadUnit& u = open_unit(p, 0, n, UnitCheck::kWhole);
    for (const Run& r : runs) place(u, r.src, r.length, dst, r.dst_offset);
  }

  // Nothing to check: the runs themselves, close ones merged.
  void add_unchecked(const StoredPiece& p, size_t dst, const std::vector<Run>& runs) {
    ReadUnit* u = nullptr;
    for (const Run& r : runs) {
      if (u == nullptr || r.src > u->offset + u->length + kMergeGapBytes) {
        u = &open_unit(p, r.src, r.src + r.length, UnitCheck::kNone);
      } else {
        const uint64_t end = r.src + r.length;
        plan_.read_bytes += end - (u->offset + u->length);
        u->length = end - u->offset;
      }
      place(*u, r.src, r.length, dst, r.dst_offset);
    }
  }

  ReadPlan& plan_;
  const PlanOptions& options_;
};

}  // namespace

struct ReadSession::Impl {
  struct Stream {
    const TensorInfo* info = nullptr;
    const ShardFile* file = nullptr;  // set by the first feed
    uint64_t planned = 0;             // bytes the plans so far read (in order)
    uint64_t fed = 0;                 // bytes hashed
    bool broken = false;              // a part came out of order: the stream cannot finish
    Checksummer hash;
  };
  std::unordered_map<const TensorInfo*, size_t> slot_of;
  std::vector<Stream> streams;
};

ReadSession::ReadSession() : impl_(std::make_unique<Impl>()) {}
ReadSession::~ReadSession() = default;

std::optional<size_t> ReadSession::continue_at(const TensorInfo& info, uint64_t offset,
                                               uint64_t length) {
  auto [it, inserted] = impl_->slot_of.try_emplace(&info, impl_->streams.size());
  if (inserted) impl_->streams.emplace_back().info = &info;
  Impl::Stream& s = impl_->streams[it->second];
  if (s.broken || s.planned != offset) {
    // Read whole instead (verified in that pass); what the stream returned so far can no longer
    // be judged, which check_complete reports.
    s.broken = s.planned > 0 && s.planned < info.nbytes;  // a finished stream stays judged
    return std::nullopt;
  }
  s.planned += length;
  return it->second;
}

void ReadSession::check_complete() const {
  for (const Impl::Stream& s : impl_->streams) {
    if (s.fed == s.info->nbytes && !s.broken) continue;
    if (s.planned == 0) continue;  // never streamed
    const std::string file = s.file != nullptr ? s.file->path() + ": " : "";
    throw FormatError(file + "tensor \"" + s.info->name + "\": read in parts " +
                      (s.broken ? "out of order" : "not to its end") + " (" +
                      std::to_string(s.fed) + " of " + std::to_string(s.info->nbytes) +
                      " bytes streamed): the bytes read so far were not verified");
  }
}

void ReadSession::feed(size_t slot, const ShardFile& file, const TensorInfo& info,
                       const std::byte* data, uint64_t length) {
  Impl::Stream& s = impl_->streams[slot];
  s.file = &file;
  s.hash.update(data, length);
  s.fed += length;
  if (s.fed == info.nbytes) file.check_digest(info, s.hash.digest());
}

ReadPlan plan_reads(std::span<const ReadRequest> requests, std::span<const uint64_t> dst_bytes,
                    const std::string& where, const PlanOptions& options) {
  Shape off, shape;
  for (const ReadRequest& q : requests) {
    check_read_request(q, where);
    request_box(q, off, shape);
    check_destination(q, shape, dst_bytes, where);
  }
  ReadPlan plan;
  plan.session = options.session;
  plan.units.reserve(requests.size());
  plan.placements.reserve(requests.size());
  Planner planner(plan, options);
  std::vector<Run> runs;
  for (const ReadRequest& q : requests) {
    request_box(q, off, shape);
    if (!numel(shape).value_or(0)) continue;
    const uint64_t esz = dtype_size(q.tensor.dtype);
    const Box want{off, shape};
    for (const StoredPiece& p : q.tensor.pieces) {
      // Pieces are sorted by offsets: none past the box's last row can touch it.
      if (!off.empty() && p.offsets[0] >= off[0] + shape[0]) break;
      runs.clear();
      if (off.empty()) {
        runs.push_back(Run{0, p.info->nbytes, q.dst_offset});
      } else {
        if (p.offsets[0] + p.info->shape[0] <= off[0]) continue;
        const auto ib =
            intersect(want, Box{Shape(p.offsets.begin(), p.offsets.end()), p.info->shape});
        if (!ib) continue;
        for_each_run(p, *ib, off, shape, esz, q.dst_offset,
                     [&](const Run& r) { runs.push_back(r); });
      }
      planner.add(p, q.dst, runs);
    }
  }
  return plan;
}

ReadPlan plan_file_reads(const ShardFile& file, bool verify) {
  std::vector<StoredPiece> pieces;
  pieces.reserve(file.tensors().size());
  for (const TensorInfo& t : file.tensors()) pieces.push_back({&file, &t, t.offsets});
  ReadPlan plan;
  plan.units.reserve(pieces.size());
  plan.placements.reserve(pieces.size());
  const PlanOptions options{verify, nullptr};
  Planner planner(plan, options);
  std::vector<Run> runs;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const TensorInfo& t = file.tensors()[i];
    if (t.nbytes == 0) continue;
    runs.assign(1, Run{0, t.nbytes, 0});
    planner.add(pieces[i], i, runs);
  }
  return plan;
}

ReadPlan select_destinations(const ReadPlan& plan, const std::function<bool(size_t)>& keep) {
  ReadPlan out;
  out.session = plan.session;
  for (const ReadUnit& u : plan.units) {
    if (u.placement_begin == u.placement_end || !keep(plan.placements[u.placement_begin].dst)) {
      continue;
    }
    ReadUnit v = u;
    v.placement_begin = out.placements.size();
    for (size_t p = u.placement_begin; p < u.placement_end; ++p) {
      out.placements.push_back(plan.placements[p]);
      out.placed_bytes += plan.placements[p].length;
    }
    v.placement_end = out.placements.size();
    out.units.push_back(v);
    out.read_bytes += v.length;
  }
  return out;
}

}  // namespace fsdp_ema::format
