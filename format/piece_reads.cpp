#include "fsdp_ema/format/piece_reads.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/parallel.h"

namespace fsdp_ema::format {
namespace {

struct Chunk {
  size_t read;     // index in reads
  size_t index;    // chunk number inside its read
  uint64_t begin;  // offset inside the read
  uint64_t length;
};

// The in-order hash of one read of several chunks. Whoever marks the next unhashed chunk ready
// while nobody hashes becomes the hasher and hashes every consecutive ready chunk; the others
// only mark theirs and read on.
struct HashLane {
  std::mutex mu;
  Checksummer state;
  size_t first = 0;  // the read's first chunk in `chunks`
  std::vector<char> ready;
  size_t next = 0;
  bool busy = false;
};

}  // namespace

void read_pieces(std::span<const PieceRead> reads, size_t threads,
                 const std::function<void(size_t, uint64_t)>& on_hashed) {
  std::vector<Chunk> chunks;
  chunks.reserve(reads.size());
  std::vector<std::unique_ptr<HashLane>> lanes(reads.size());
  for (size_t i = 0; i < reads.size(); ++i) {
    const PieceRead& r = reads[i];
    const uint64_t n = (r.length + kReadChunkBytes - 1) / kReadChunkBytes;
    if (n == 0 && r.hash) on_hashed(i, checksum_of(nullptr, 0));
    if (n > 1 && r.hash) {
      lanes[i] = std::make_unique<HashLane>();
      lanes[i]->first = chunks.size();
      lanes[i]->ready.assign(n, 0);
    }
    for (uint64_t k = 0; k < n; ++k) {
      const uint64_t begin = k * kReadChunkBytes;
      chunks.push_back({i, k, begin, std::min(kReadChunkBytes, r.length - begin)});
    }
  }
  // Units of work: one large chunk, or a run of small ones (a load of 100,000 small tensors is
  // not 100,000 handoffs between threads).
  std::vector<size_t> unit_begin;
  uint64_t total = 0;
  for (size_t c = 0, run = kReadChunkBytes; c < chunks.size(); ++c) {
    if (run + chunks[c].length > kReadChunkBytes) {
      unit_begin.push_back(c);
      run = 0;
    }
    run += chunks[c].length;
    total += chunks[c].length;
  }
  unit_begin.push_back(chunks.size());
  if (total < 2 * kReadChunkBytes) threads = 1;

  auto dst_of = [&](const Chunk& c) {
    return static_cast<std::byte*>(reads[c.read].dst) + c.begin;
  };
  auto hash_in_order = [&](const Chunk& c) {
    HashLane& lane = *lanes[c.read];
    std::unique_lock lock(lane.mu);
    lane.ready[c.index] = 1;
    if (lane.busy) return;
    lane.busy = true;
    while (lane.next < lane.ready.size() && lane.ready[lane.next]) {
      const size_t k = lane.next;
      lock.unlock();
      const Chunk& ck = chunks[lane.first + k];
      lane.state.update(dst_of(ck), ck.length);
      lock.lock();
      ++lane.next;
    }
    lane.busy = false;
    const bool done = lane.next == lane.ready.size();
    lock.unlock();
    if (done) on_hashed(c.read, lane.state.digest());
  };

  // Read-ahead: several threads preading interleaved chunks of one descriptor look random to
  // the kernel, which then reads a cold file only as each (hashed: 1 MiB) pread asks, one I/O
  // at a time (issue 29: a cold owned load 1.3x torch.load). So when a unit starts, the next
  // kAheadBytes of the batch, in chunk order, are advised (POSIX_FADV_WILLNEED), runs adjacent
  // in one file as one call and runs under 64 KiB not at all; where the first byte of a run is
  // cached, nothing is advised (ShardFile::prefetch_if_cold).
  constexpr uint64_t kAheadBytes = uint64_t{64} << 20;
  constexpr uint64_t kAheadMinRun = uint64_t{64} << 10;
  std::vector<uint64_t> chunk_start(chunks.size() + 1, 0);  // batch bytes before chunk c
  for (size_t c = 0; c < chunks.size(); ++c) {
    chunk_start[c + 1] = chunk_start[c] + chunks[c].length;
  }
  std::mutex ahead_mu;
  size_t advised = 0;  // chunks before it were advised (or are read already)
  auto read_ahead = [&](size_t first_chunk) {
    struct Run {
      const ShardFile* file;
      uint64_t begin, end;
    };
    std::vector<Run> runs;
    {
      const std::lock_guard lock(ahead_mu);
      advised = std::max(advised, first_chunk);
      for (;
           advised < chunks.size() && chunk_start[advised] < chunk_start[first_chunk] + kAheadBytes;
           ++advised) {
        const Chunk& c = chunks[advised];
        const PieceRead& r = reads[c.read];
        const uint64_t at = r.tensor->data_offset + r.offset + c.begin;
        if (runs.empty() || runs.back().file != r.file || runs.back().end != at) {
          runs.push_back({r.file, at, at});
        }
        runs.back().end = at + c.length;
      }
    }
    // The calls outside the lock: on a cold file one may wait for the device's queue.
    for (const Run& run : runs) {
      if (run.end - run.begin >= kAheadMinRun)
        run.file->prefetch_if_cold(run.begin, run.end - run.begin);
    }
  };
  const bool ahead = unit_begin.size() > 2;

  std::atomic<bool> failed{false};
  const auto errors = detail::run_jobs(
      unit_begin.size() - 1,
      [&](size_t u) {
        if (failed.load(std::memory_order_relaxed)) return;
        try {
          if (ahead) read_ahead(unit_begin[u]);
          for (size_t i = unit_begin[u]; i < unit_begin[u + 1]; ++i) {
            const Chunk& c = chunks[i];
            const PieceRead& r = reads[c.read];
            if (r.hash && !lanes[c.read]) {
              // One chunk: hashed block by block as it is read, while each block is in cache.
              Checksummer h;
              r.file->read(*r.tensor, r.offset, r.length, r.dst, &h);
              on_hashed(c.read, h.digest());
              continue;
            }
            r.file->read(*r.tensor, r.offset + c.begin, c.length, dst_of(c));
            if (r.hash) hash_in_order(c);
          }
        } catch (...) {
          failed = true;
          throw;
        }
      },
      threads);
  detail::rethrow_first(errors);
}

}  // namespace fsdp_ema::format
