#include "fsdp_ema/format/read_exec.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/parallel.h"

namespace fsdp_ema::format {
namespace {

// One read of a unit: bytes [begin, begin + length) of it (offsets inside the unit).
struct Chunk {
  size_t unit;
  size_t index;  // chunk number inside its unit
  uint64_t begin;
  uint64_t length;
};

// A block-checked unit's chunks hold whole blocks: every chunk is verified on its own.
uint64_t chunk_bytes_of(const ReadUnit& u) {
  if (u.check != UnitCheck::kBlocks) return kReadChunkBytes;
  return std::max(u.block_bytes, kReadChunkBytes / u.block_bytes * u.block_bytes);
}

struct Chunks {
  std::vector<Chunk> chunks;
  std::vector<size_t> first;  // per unit: its first chunk
  std::vector<size_t> count;  // per unit: its number of chunks
};

Chunks make_chunks(const ReadPlan& plan) {
  Chunks c;
  c.chunks.reserve(plan.units.size());
  c.first.resize(plan.units.size());
  c.count.resize(plan.units.size());
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const ReadUnit& unit = plan.units[u];
    const uint64_t step = chunk_bytes_of(unit);
    c.first[u] = c.chunks.size();
    size_t k = 0;
    for (uint64_t pos = 0; pos < unit.length; pos += step, ++k) {
      c.chunks.push_back({u, k, pos, std::min(step, unit.length - pos)});
    }
    c.count[u] = k;
  }
  return c;
}

// The in-order hash of a whole-checked unit of several chunks. Whoever marks the next unhashed
// chunk ready while nobody hashes becomes the hasher and hashes every consecutive ready chunk;
// the others only mark theirs and read on. The bytes of every chunk stay where they were read
// until it is hashed (a destination, or a staging buffer until its step ends).
struct HashLane {
  std::mutex mu;
  Checksummer state;
  std::vector<const std::byte*> ready;  // per chunk: where it lies once read
  size_t next = 0;
  bool busy = false;
};

class Lanes {
 public:
  // A lane for every whole-checked unit of several chunks whose bytes stay where they are read
  // (`stable(unit)`), which lie `where`.
  template <typename Stable>
  Lanes(const ReadPlan& plan, const Chunks& chunks, ShardFile::Bytes where, Stable&& stable)
      : plan_(plan), chunks_(chunks), where_(where), lanes_(plan.units.size()) {
    for (size_t u = 0; u < plan.units.size(); ++u) {
      const ReadUnit& unit = plan.units[u];
      const bool lane = unit.check == UnitCheck::kWhole && chunks.count[u] > 1 && stable(u);
      if (!lane) continue;
      lanes_[u] = std::make_unique<HashLane>();
      lanes_[u]->ready.assign(chunks.count[u], nullptr);
    }
  }
  bool has(size_t unit) const { return lanes_[unit] != nullptr; }

  // Chunk c is in memory at `data`: hashes what is next in order; checks the digest once the
  // unit's last chunk is hashed (on whichever thread hashed it).
  void ready(const Chunk& c, const std::byte* data) {
    HashLane& lane = *lanes_[c.unit];
    const ReadUnit& u = plan_.units[c.unit];
    std::unique_lock lock(lane.mu);
    lane.ready[c.index] = data;
    if (lane.busy) return;
    lane.busy = true;
    while (lane.next < lane.ready.size() && lane.ready[lane.next] != nullptr) {
      const size_t k = lane.next;
      const Chunk& next = chunks_.chunks[chunks_.first[c.unit] + k];
      lock.unlock();
      u.file->hash_into(*u.info, u.offset + next.begin, lane.ready[k], next.length, lane.state,
                        where_);
      lock.lock();
      ++lane.next;
    }
    lane.busy = false;
    const bool done = lane.next == lane.ready.size();
    lock.unlock();
    if (done) u.file->check_digest(*u.info, lane.state.digest());
  }

 private:
  const ReadPlan& plan_;
  const Chunks& chunks_;
  const ShardFile::Bytes where_;
  std::vector<std::unique_ptr<HashLane>> lanes_;
};

// The checks of one chunk that stands alone: its blocks, or (a unit of one chunk) its piece.
void check_chunk(const ReadUnit& u, const Chunk& c, const std::byte* data,
                 ShardFile::Bytes where = ShardFile::Bytes::kOwned) {
  if (u.check == UnitCheck::kBlocks) {
    u.file->check_blocks(*u.info, u.offset + c.begin, data, c.length, where);
  } else if (u.check == UnitCheck::kWhole) {
    u.file->check_digest(*u.info,
                         u.file->digest_of(*u.info, u.offset + c.begin, data, c.length, where));
  }
}

// Calls fn(placement, lo, hi) for each placement of unit u that chunk c holds part of: unit bytes
// [lo, hi) of it. Placements are in unit order: a binary search finds the first.
template <typename F>
void for_each_overlap(const ReadPlan& plan, const ReadUnit& u, const Chunk& c, F&& fn) {
  const uint64_t end = c.begin + c.length;
  const auto last = plan.placements.begin() + static_cast<ptrdiff_t>(u.placement_end);
  auto it = std::partition_point(
      plan.placements.begin() + static_cast<ptrdiff_t>(u.placement_begin), last,
      [&](const Placement& p) { return p.unit_offset + p.length <= c.begin; });
  for (; it != last && it->unit_offset < end; ++it) {
    fn(*it, std::max(c.begin, it->unit_offset), std::min(end, it->unit_offset + it->length));
  }
}

// Copies the part of unit u's placements that chunk c holds (at `data`) into host destinations.
void place_chunk(const ReadPlan& plan, const ReadUnit& u, const Chunk& c, const std::byte* data,
                 std::span<std::byte* const> dst) {
  for_each_overlap(plan, u, c, [&](const Placement& p, uint64_t lo, uint64_t hi) {
    if (dst[p.dst] == nullptr) return;
    std::memcpy(dst[p.dst] + p.dst_offset + (lo - p.unit_offset), data + (lo - c.begin), hi - lo);
  });
}

// A per-thread buffer for chunks that are not read straight into their destination.
std::byte* scratch(uint64_t bytes) {
  thread_local std::vector<std::byte> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// Read-ahead: several threads preading interleaved chunks of one descriptor look random to the
// kernel, which then reads a cold file only as each pread asks, one I/O at a time (issue 29: a
// cold owned load 1.3x torch.load). So when a job starts, the next kAheadBytes of the plan, in
// chunk order, are advised (POSIX_FADV_WILLNEED), runs adjacent in one file as one call and runs
// under 64 KiB not at all; where the first byte of a run is cached, nothing is advised
// (ShardFile::prefetch_if_cold).
class ReadAhead {
 public:
  ReadAhead(const ReadPlan& plan, const Chunks& chunks) : plan_(plan), chunks_(chunks) {
    start_.assign(chunks.chunks.size() + 1, 0);
    for (size_t c = 0; c < chunks.chunks.size(); ++c) {
      start_[c + 1] = start_[c] + chunks.chunks[c].length;
    }
  }

  void before(size_t first_chunk) {
    constexpr uint64_t kAheadBytes = uint64_t{64} << 20;
    constexpr uint64_t kAheadMinRun = uint64_t{64} << 10;
    struct Run {
      const ShardFile* file;
      uint64_t begin, end;
    };
    std::vector<Run> runs;
    {
      const std::lock_guard lock(mu_);
      advised_ = std::max(advised_, first_chunk);
      const auto& all = chunks_.chunks;
      for (; advised_ < all.size() && start_[advised_] < start_[first_chunk] + kAheadBytes;
           ++advised_) {
        const Chunk& c = all[advised_];
        const ReadUnit& u = plan_.units[c.unit];
        const uint64_t at = u.info->data_offset + u.offset + c.begin;
        if (runs.empty() || runs.back().file != u.file || runs.back().end != at) {
          runs.push_back({u.file, at, at});
        }
        runs.back().end = at + c.length;
      }
    }
    // Outside the lock: on a cold file one may wait for the device's queue.
    for (const Run& run : runs) {
      if (run.end - run.begin >= kAheadMinRun) {
        run.file->prefetch_if_cold(run.begin, run.end - run.begin);
      }
    }
  }

 private:
  const ReadPlan& plan_;
  const Chunks& chunks_;
  std::vector<uint64_t> start_;  // plan bytes before chunk c
  std::mutex mu_;
  size_t advised_ = 0;
};

size_t resolve_threads(size_t threads, uint64_t bytes) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  return bytes < 2 * kReadChunkBytes ? 1 : threads;
}

// Jobs: runs of consecutive chunks one thread handles in order. Chunks that stand alone are
// grouped up to kReadChunkBytes (a load of 100,000 small tensors is not 100,000 handoffs); a
// unit whose chunks must be processed in order (`sequential`) is one job.
template <typename Sequential>
std::vector<size_t> make_jobs(const Chunks& chunks, size_t begin, size_t end,
                              Sequential&& sequential) {
  std::vector<size_t> jobs;
  uint64_t run = kReadChunkBytes;
  for (size_t c = begin; c < end;) {
    const Chunk& ch = chunks.chunks[c];
    if (sequential(ch.unit)) {
      jobs.push_back(c);
      c += chunks.count[ch.unit];
      run = kReadChunkBytes;  // the next chunk starts a job of its own
      continue;
    }
    if (run + ch.length > kReadChunkBytes) {
      jobs.push_back(c);
      run = 0;
    }
    run += ch.length;
    ++c;
  }
  jobs.push_back(end);
  return jobs;
}

// Runs jobs on `threads` threads; the first failure is rethrown after all stopped, and no job
// starts after one.
template <typename Job>
void run_jobs_until_failure(size_t n, size_t threads, Job&& job) {
  std::atomic<bool> failed{false};
  const auto errors = detail::run_jobs(
      n,
      [&](size_t i) {
        if (failed.load(std::memory_order_relaxed)) return;
        try {
          job(i);
        } catch (...) {
          failed = true;
          throw;
        }
      },
      threads);
  detail::rethrow_first(errors);
}

}  // namespace

void execute_reads(const ReadPlan& plan, std::span<std::byte* const> dst,
                   const ExecOptions& options) {
  if (plan.units.empty()) return;
  for (const Placement& p : plan.placements) {
    if (options.mapped && dst[p.dst] != nullptr) {
      throw FormatError("execute_reads: a mapped plan places nothing (destinations must be null)");
    }
  }
  if (options.mapped && plan.session) {
    // A session hashes the bytes it is fed on its own, unguarded (mapped_guard.h).
    throw FormatError("execute_reads: a mapped plan streams nothing (no ReadSession)");
  }
  // Mapped bytes are read only through the guarded calls (ShardFile::Bytes::kMapped).
  const ShardFile::Bytes where =
      options.mapped ? ShardFile::Bytes::kMapped : ShardFile::Bytes::kOwned;
  const Chunks chunks = make_chunks(plan);
  const size_t threads = resolve_threads(options.threads, plan.read_bytes);
  // Where a direct unit's bytes are read to: straight into its one host destination. Others go
  // through a per-thread buffer, from which their bytes are placed once checked.
  std::vector<std::byte*> direct(plan.units.size(), nullptr);
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const ReadUnit& unit = plan.units[u];
    if (options.mapped || !unit.direct) continue;
    const Placement& p = plan.placements[unit.placement_begin];
    if (dst[p.dst] != nullptr) direct[u] = dst[p.dst] + p.dst_offset;
  }
  // Bytes stay where they were read (a destination, the mapping): a lane can hash them later.
  Lanes lanes(plan, chunks, where,
              [&](size_t u) { return options.mapped || direct[u] != nullptr; });
  // Units whose chunks depend on each other and go through a buffer (a whole-checked piece not
  // read directly, a stream) are handled in order by one job, hashed as they go.
  auto sequential = [&](size_t u) {
    const ReadUnit& unit = plan.units[u];
    if (unit.check == UnitCheck::kStream) return true;
    return unit.check == UnitCheck::kWhole && chunks.count[u] > 1 && !lanes.has(u);
  };
  const std::vector<size_t> jobs = make_jobs(chunks, 0, chunks.chunks.size(), sequential);
  ReadAhead ahead(plan, chunks);
  const bool advise = !options.mapped && jobs.size() > 2;

  // One chunk's bytes: read into the destination or a buffer, or found in the mapping.
  auto load = [&](size_t u, const Chunk& c) -> const std::byte* {
    const ReadUnit& unit = plan.units[u];
    if (options.mapped) {
      const std::byte* at =
          options.mapped(*unit.file).data(*unit.info).data() + unit.offset + c.begin;
      unit.file->check_data(*unit.info, unit.offset + c.begin, at, c.length, where);
      return at;
    }
    std::byte* into = direct[u] != nullptr ? direct[u] + c.begin : scratch(c.length);
    unit.file->read(*unit.info, unit.offset + c.begin, c.length, into);
    return into;
  };
  auto run_sequential = [&](size_t first) {
    const size_t u = chunks.chunks[first].unit;
    const ReadUnit& unit = plan.units[u];
    Checksummer hash;
    for (size_t i = first; i < first + chunks.count[u]; ++i) {
      const Chunk& c = chunks.chunks[i];
      const std::byte* data = load(u, c);
      if (unit.check == UnitCheck::kStream) {
        plan.session->feed(unit.stream, *unit.file, *unit.info, data, c.length);
      } else {
        unit.file->hash_into(*unit.info, unit.offset + c.begin, data, c.length, hash, where);
      }
      if (direct[u] == nullptr) place_chunk(plan, unit, c, data, dst);
    }
    if (unit.check == UnitCheck::kWhole) unit.file->check_digest(*unit.info, hash.digest());
  };
  run_jobs_until_failure(jobs.size() - 1, threads, [&](size_t j) {
    if (advise) ahead.before(jobs[j]);
    if (sequential(chunks.chunks[jobs[j]].unit)) {
      run_sequential(jobs[j]);
      return;
    }
    for (size_t i = jobs[j]; i < jobs[j + 1]; ++i) {
      const Chunk& c = chunks.chunks[i];
      const ReadUnit& unit = plan.units[c.unit];
      const std::byte* data = load(c.unit, c);
      if (lanes.has(c.unit)) {
        lanes.ready(c, data);
      } else {
        check_chunk(unit, c, data, where);
      }
      if (direct[c.unit] == nullptr && !options.mapped) place_chunk(plan, unit, c, data, dst);
    }
  });
}

StageLayout stage_layout(const ReadPlan& plan, uint64_t buffer_bytes) {
  const Chunks chunks = make_chunks(plan);
  auto align = [](uint64_t n) { return (n + kStageAlign - 1) / kStageAlign * kStageAlign; };
  StageLayout layout;
  layout.buffer_bytes = align(std::max<uint64_t>(buffer_bytes, 1));
  for (const Chunk& c : chunks.chunks) {
    layout.buffer_bytes = std::max(layout.buffer_bytes, align(c.length));
  }
  uint64_t used = layout.buffer_bytes;  // no step open yet
  for (const Chunk& c : chunks.chunks) {
    uint64_t at = align(used);
    if (at + c.length > layout.buffer_bytes) {
      ++layout.steps;
      at = 0;
    }
    layout.step_of.push_back(layout.steps - 1);
    layout.offset_of.push_back(at);
    layout.chunk_length.push_back(c.length);
    used = at + c.length;
  }
  return layout;
}

void execute_staged(const ReadPlan& plan, StageTarget& target, size_t threads,
                    uint64_t buffer_bytes) {
  for (const ReadUnit& u : plan.units) {
    if (u.check == UnitCheck::kStream) {
      throw FormatError("execute_staged: streamed (ReadSession) units cannot be staged");
    }
  }
  const Chunks chunks = make_chunks(plan);
  const StageLayout layout = stage_layout(plan, buffer_bytes);
  // Every chunk of a whole-checked unit goes through its lane: its bytes stay in the buffer until
  // the step ends, and every chunk of the step is hashed by then (each one read is marked ready
  // before its job returns, and the lane's hasher runs while the next chunk in order is ready).
  Lanes lanes(plan, chunks, ShardFile::Bytes::kOwned, [](size_t) { return true; });
  ReadAhead ahead(plan, chunks);
  size_t c0 = 0;
  for (size_t s = 0; s < layout.steps; ++s) {
    size_t c1 = c0;
    while (c1 < chunks.chunks.size() && layout.step_of[c1] == s) ++c1;
    const int b = static_cast<int>(s % 2);
    if (s >= 2) target.acquire(b);
    std::byte* buffer = target.buffer(b, layout.buffer_bytes);
    uint64_t step_bytes = 0;
    for (size_t c = c0; c < c1; ++c) step_bytes += chunks.chunks[c].length;
    const std::vector<size_t> jobs = make_jobs(chunks, c0, c1, [](size_t) { return false; });
    run_jobs_until_failure(jobs.size() - 1, resolve_threads(threads, step_bytes), [&](size_t j) {
      if (jobs.size() > 2) ahead.before(jobs[j]);
      for (size_t i = jobs[j]; i < jobs[j + 1]; ++i) {
        const Chunk& c = chunks.chunks[i];
        const ReadUnit& u = plan.units[c.unit];
        std::byte* into = buffer + layout.offset_of[i];
        u.file->read(*u.info, u.offset + c.begin, c.length, into);
        if (lanes.has(c.unit)) {
          lanes.ready(c, into);
        } else {
          check_chunk(u, c, into);
        }
      }
    });
    // The step's bytes are verified (a whole-checked piece's once its last chunk is in): copy.
    for (size_t i = c0; i < c1; ++i) {
      const Chunk& c = chunks.chunks[i];
      for_each_overlap(plan, plan.units[c.unit], c,
                       [&](const Placement& p, uint64_t lo, uint64_t hi) {
                         target.copy(p.dst, p.dst_offset + (lo - p.unit_offset), b,
                                     layout.offset_of[i] + (lo - c.begin), hi - lo);
                       });
    }
    target.release(b);
    c0 = c1;
  }
  target.finish();
}

}  // namespace fsdp_ema::format
