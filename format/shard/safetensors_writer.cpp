#include "fsdp_ema/format/safetensors_writer.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <thread>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/paths.h"
#include "fsdp_ema/format/safetensors_header.h"

namespace fsdp_ema::format {
namespace {

// Host tensors at least this large are written straight from the caller's memory (no staging
// copy); smaller ones are packed into the staging buffers so that many small tensors cost one
// write call instead of one each.
constexpr uint64_t kDirectWriteBytes = uint64_t{256} << 10;
// Direct writes in flight at once (each is at most chunk_bytes).
constexpr size_t kMaxQueuedJobs = 4;
// A direct write is hashed and written in pieces of this size, each hashed right before its
// write, so that the write copies bytes the hash just brought into the core's cache (one read of
// the caller's memory from DRAM instead of two).
constexpr uint64_t kHotPieceBytes = uint64_t{512} << 10;

// Writes queued byte ranges to the file in order on its own thread, hashing those that come with
// a hasher (in order: the jobs of one tensor are queued in order) piece by piece just before.
class BackgroundWriter {
 public:
  BackgroundWriter(int fd, const std::string& path, size_t num_buffers, bool writeback)
      : fd_(fd), path_(path), writeback_(writeback), busy_(num_buffers, false) {
    thread_ = std::thread([this] { run(); });
  }

  ~BackgroundWriter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if (!error_) abort_ = true;  // a clean finish() already drained the queue
    }
    cv_.notify_all();
    thread_.join();
  }

  // Queues a write; `buffer` is the staging buffer id it reads from, or -1 for caller memory;
  // `hasher`, when not null, is fed the bytes before they are written.
  void submit(const std::byte* data, uint64_t size, uint64_t offset, int buffer,
              TensorHasher* hasher = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return error_ || queue_.size() < kMaxQueuedJobs; });
    rethrow_locked();
    if (buffer >= 0) busy_[static_cast<size_t>(buffer)] = true;
    queue_.push_back(Job{data, size, offset, buffer, hasher});
    lock.unlock();
    cv_.notify_all();
  }

  // Blocks until the buffer's pending write (if any) is done.
  void wait_free(int buffer) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return error_ || !busy_[static_cast<size_t>(buffer)]; });
    rethrow_locked();
  }

  // Blocks until every queued write is done; rethrows the first write error.
  void finish() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return error_ || queue_.empty(); });
    rethrow_locked();
  }

 private:
  struct Job {
    const std::byte* data;
    uint64_t size;
    uint64_t offset;
    int buffer;
    TensorHasher* hasher;
  };

  void rethrow_locked() {
    if (error_) std::rethrow_exception(error_);
  }

  void run() {
    for (;;) {
      Job job{};
      bool skip = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = queue_.front();  // stays queued until written, so queue_.size() counts in-flight
        skip = error_ != nullptr || abort_;
      }
      if (!skip) {
        try {
          write_job(job);
          if (writeback_) detail::start_writeback(fd_, job.offset, job.size);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu_);
          error_ = std::current_exception();
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.pop_front();
        if (job.buffer >= 0) busy_[static_cast<size_t>(job.buffer)] = false;
      }
      cv_.notify_all();
    }
  }

  void write_job(const Job& job) {
    if (job.hasher == nullptr) {
      detail::pwrite_all(fd_, job.data, job.size, job.offset, path_);
      return;
    }
    for (uint64_t pos = 0; pos < job.size; pos += kHotPieceBytes) {
      const uint64_t n = std::min(kHotPieceBytes, job.size - pos);
      job.hasher->update(job.data + pos, n);
      detail::pwrite_all(fd_, job.data + pos, n, job.offset + pos, path_);
    }
  }

  const int fd_;
  const std::string& path_;
  const bool writeback_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::vector<bool> busy_;
  bool stop_ = false;
  bool abort_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// Staging buffers from the caller's allocator or page-aligned operator new.
class StagingBuffers {
 public:
  StagingBuffers(const WriteOptions& o, size_t count) : options_(o), buffers_(count, nullptr) {}
  ~StagingBuffers() {
    for (void* b : buffers_) {
      if (b == nullptr) continue;
      if (options_.free_buffer) {
        options_.free_buffer(b);
      } else {
        ::operator delete (b, std::align_val_t{4096});
      }
    }
  }
  StagingBuffers(const StagingBuffers&) = delete;
  StagingBuffers& operator=(const StagingBuffers&) = delete;

  std::byte* get(size_t i) {
    if (buffers_[i] == nullptr) {
      if (options_.allocate_buffer) {
        buffers_[i] = options_.allocate_buffer(options_.chunk_bytes);
        if (buffers_[i] == nullptr) throw std::bad_alloc();
      } else {
        buffers_[i] = ::operator new (options_.chunk_bytes, std::align_val_t{4096});
      }
    }
    return static_cast<std::byte*>(buffers_[i]);
  }

 private:
  const WriteOptions& options_;
  std::vector<void*> buffers_;
};

// Removes the temporary file unless disarmed.
struct TempFileGuard {
  std::string path;
  bool armed = true;
  ~TempFileGuard() {
    if (armed) detail::remove_quietly(path);
  }
};

}  // namespace

std::vector<size_t> file_order(std::span<const RawTensor> tensors) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const size_t sa = dtype_size(tensors[a].dtype);
    const size_t sb = dtype_size(tensors[b].dtype);
    if (sa != sb) return sa > sb;
    return tensors[a].name < tensors[b].name;
  });
  return order;
}

namespace {

// The options a write needs: staging chunks, buffers and their allocator, the block size.
void check_write_options(const std::string& path, const WriteOptions& options) {
  if (options.chunk_bytes < 64 || options.chunk_bytes % 64 != 0) {
    throw FormatError(path + ": WriteOptions::chunk_bytes " + std::to_string(options.chunk_bytes) +
                      " must be a positive multiple of 64");
  }
  if (options.num_buffers < 2) {
    throw FormatError(path + ": WriteOptions::num_buffers must be at least 2");
  }
  if (static_cast<bool>(options.allocate_buffer) != static_cast<bool>(options.free_buffer)) {
    throw FormatError(path + ": WriteOptions::allocate_buffer and free_buffer go together");
  }
  const uint64_t block = options.checksum_block_bytes;
  if (block != 0 && (block < kMinChecksumBlockBytes || block > kMaxChecksumBlockBytes ||
                     (block & (block - 1)) != 0)) {
    throw FormatError(path + ": WriteOptions::checksum_block_bytes " + std::to_string(block) +
                      " must be 0 or a power of two in [" + std::to_string(kMinChecksumBlockBytes) +
                      ", " + std::to_string(kMaxChecksumBlockBytes) + "]");
  }
}

// Streams every tensor's bytes in file order to `fd` (the temporary at `temp_path`, to be renamed
// to `path`) from byte `data_start` on, through the staging buffers and the background writer (a
// large host tensor directly), hashing each on the way: fills result.checksums and
// result.block_checksums.
void write_data(int fd, const std::string& temp_path, const std::string& path,
                std::span<const RawTensor> tensors, const WriteOptions& options,
                uint64_t data_start, RawWriteResult& result) {
  const uint64_t block = options.checksum_block_bytes;
  // The hashers of the tensors written straight from the caller's memory, fed on the writer's
  // thread (declared before it: they outlive its thread).
  std::vector<std::pair<size_t, std::unique_ptr<TensorHasher>>> direct;
  StagingBuffers buffers(options, options.num_buffers);
  BackgroundWriter writer(fd, temp_path, options.num_buffers, options.fsync);
  const uint64_t chunk = options.chunk_bytes;
  int cur = -1;            // staging buffer being filled, -1 if none
  int next = 0;            // the buffer to fill after it
  uint64_t cur_fill = 0;   // bytes in the current buffer
  uint64_t cur_start = 0;  // file offset of the current buffer's first byte
  uint64_t file_pos = data_start;

  auto flush = [&] {
    if (cur >= 0 && cur_fill > 0) {
      writer.submit(buffers.get(static_cast<size_t>(cur)), cur_fill, cur_start, cur);
      next = (cur + 1) % static_cast<int>(options.num_buffers);
      cur = -1;
      cur_fill = 0;
    }
  };
  for (const size_t idx : result.order) {
    const RawTensor& t = tensors[idx];
    if (t.nbytes > 0 && t.host_data == nullptr && !t.fill) {
      throw FormatError(path + ": tensor '" + std::string(t.name) + "' has no data source");
    }
    if (t.host_data != nullptr && t.nbytes >= kDirectWriteBytes) {
      flush();
      TensorHasher* hasher =
          direct.emplace_back(idx, std::make_unique<TensorHasher>(t.nbytes, block)).second.get();
      const auto* src = static_cast<const std::byte*>(t.host_data);
      for (uint64_t pos = 0; pos < t.nbytes; pos += chunk) {
        const uint64_t n = std::min(chunk, t.nbytes - pos);
        writer.submit(src + pos, n, file_pos, -1, hasher);
        file_pos += n;
      }
      continue;  // its checksums once the writer is done
    }
    TensorHasher hasher(t.nbytes, block);
    uint64_t pos = 0;
    while (pos < t.nbytes) {
      if (cur < 0) {
        writer.wait_free(next);
        cur = next;
        cur_fill = 0;
        cur_start = file_pos;
      }
      const uint64_t n = std::min(chunk - cur_fill, t.nbytes - pos);
      std::byte* dst = buffers.get(static_cast<size_t>(cur)) + cur_fill;
      if (t.host_data != nullptr) {
        std::memcpy(dst, static_cast<const std::byte*>(t.host_data) + pos, n);
      } else {
        t.fill(pos, n, dst);
      }
      hasher.update(dst, n);
      cur_fill += n;
      pos += n;
      file_pos += n;
      if (cur_fill == chunk) flush();
    }
    result.checksums[idx] = hasher.digest();
    result.block_checksums[idx] = std::move(hasher.blocks());
  }
  flush();
  writer.finish();
  for (auto& [idx, hasher] : direct) {
    result.checksums[idx] = hasher->digest();
    result.block_checksums[idx] = std::move(hasher->blocks());
  }
}

}  // namespace

RawWriteResult write_safetensors_file(const std::string& path, std::span<const RawTensor> tensors,
                                      const MetadataFn& metadata, const WriteOptions& options,
                                      std::vector<size_t> order, const HeaderPatchFn& patch) {
  check_path(path, "safetensors file");
  check_write_options(path, options);

  RawWriteResult result;
  if (order.size() != tensors.size()) order = file_order(tensors);
  result.order = std::move(order);
  result.checksums.assign(tensors.size(), 0);
  result.block_checksums.resize(tensors.size());
  result.data_offset.assign(tensors.size(), 0);

  std::vector<HeaderEntry> entries(tensors.size());
  uint64_t data_bytes = 0;
  for (size_t k = 0; k < result.order.size(); ++k) {
    const RawTensor& t = tensors[result.order[k]];
    auto end = checked_add(data_bytes, t.nbytes);
    if (!end) throw FormatError(path + ": total tensor bytes overflow");
    entries[k] = HeaderEntry{t.name, t.dtype, t.shape, data_bytes, *end};
    data_bytes = *end;
  }
  std::vector<size_t> value_offsets;
  std::string placeholder =
      serialize_safetensors_header(entries, metadata(result.checksums), /*include_metadata=*/true,
                                   kHeaderAlignment, patch ? &value_offsets : nullptr);
  const uint64_t data_start = placeholder.size();
  for (size_t k = 0; k < result.order.size(); ++k) {
    result.data_offset[result.order[k]] = data_start + entries[k].begin;
  }
  auto file_bytes = checked_add(data_start, data_bytes);
  if (!file_bytes) throw FormatError(path + ": file size overflows");

  TempFileGuard guard{detail::temp_path_for(path)};
  detail::UniqueFd fd = detail::create_exclusive(guard.path);
  write_data(fd.get(), guard.path, path, tensors, options, data_start, result);

  std::string header;
  if (patch) {
    header = std::move(placeholder);
    patch(header, value_offsets, result);
  } else {
    header = serialize_safetensors_header(entries, metadata(result.checksums));
  }
  if (header.size() != data_start) {
    throw FormatError(path + ": internal error: header size changed from " +
                      std::to_string(data_start) + " to " + std::to_string(header.size()) +
                      " bytes once checksums were filled in");
  }
  detail::pwrite_all(fd.get(), header.data(), header.size(), 0, guard.path);
  result.header_checksum = checksum_of(header.data(), header.size());
  if (options.fsync) detail::fsync_fd(fd.get(), guard.path);
  fd.close_or_throw(guard.path);
  detail::rename_replace(guard.path, path);
  guard.armed = false;
  if (options.fsync) detail::fsync_directory(detail::parent_dir(path));
  result.file_bytes = *file_bytes;
  return result;
}

}  // namespace fsdp_ema::format
