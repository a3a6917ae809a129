#include "fsdp_ema/format/shard_file.h"

#include <fcntl.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/mapped_guard.h"
#include "fsdp_ema/format/name_index.h"
#include "fsdp_ema/format/paths.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

// Read descriptors of open ShardFiles, least recently used evicted past kCapacity: a reader of a
// checkpoint with thousands of shard files keeps a bounded number open. Entries are shared_ptrs so
// that an eviction never closes a descriptor another thread is reading from.
class ReadFdCache {
 public:
  static constexpr size_t kCapacity = 128;
  using Fd = std::shared_ptr<const detail::UniqueFd>;

  static ReadFdCache& instance() {
    static auto* cache = new ReadFdCache();  // leaked: ShardFiles may die during static teardown
    return *cache;
  }

  void put(const void* key, Fd fd) {
    std::lock_guard lock(mu_);
    insert_locked(key, std::move(fd));
  }

  // The cached descriptor of `key`, or the file reopened (and checked to be the same file).
  Fd get(const void* key, const std::string& path, const detail::FileIdentity& identity) {
    std::lock_guard lock(mu_);
    if (auto it = where_.find(key); it != where_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
    auto fd = std::make_shared<detail::UniqueFd>(detail::open_read_only(path));
    check_identity(fd->get(), path, identity);
    insert_locked(key, fd);
    return fd;
  }

  static void check_identity(int fd, const std::string& path,
                             const detail::FileIdentity& identity) {
    if (!detail::unchanged_since(detail::file_identity(fd, path), identity)) {
      throw FormatError(path +
                        ": changed since it was opened (replaced, truncated or rewritten by "
                        "another writer): refusing to read it");
    }
  }

  void forget(const void* key) noexcept {
    std::lock_guard lock(mu_);
    if (auto it = where_.find(key); it != where_.end()) {
      lru_.erase(it->second);
      where_.erase(it);
    }
  }

 private:
  void insert_locked(const void* key, Fd fd) {
    lru_.emplace_front(key, std::move(fd));
    where_[key] = lru_.begin();
    if (lru_.size() > kCapacity) {
      where_.erase(lru_.back().first);
      lru_.pop_back();
    }
  }

  std::mutex mu_;
  std::list<std::pair<const void*, Fd>> lru_;
  std::unordered_map<const void*, std::list<std::pair<const void*, Fd>>::iterator> where_;
};

// Reads of at most this many bytes at a time when hashing on the way: the block is hashed while it
// is still in cache.
constexpr uint64_t kHashBlockBytes = uint64_t{1} << 20;
// verify_all reads the data section in blocks of this size, so that many small tensors cost one
// pread per block, not one each.
constexpr uint64_t kVerifyBlockBytes = uint64_t{8} << 20;

// The first of n bytes that is neither 0 nor 1 (n when none is): a plain loop, mapped bytes
// included.
uint64_t first_non_bool(const std::byte* p, uint64_t n) {
  uint64_t i = 0;
  while (i < n && static_cast<unsigned char>(p[i]) <= 1) ++i;
  return i;
}

void throw_non_bool(const std::string& path, const TensorInfo& t, unsigned value) {
  throw FormatError(path + ": tensor " + json_quote(t.name) + ": BOOL byte " +
                    std::to_string(value) + " is neither 0 nor 1 (corrupt or not a bool tensor)");
}

// torch and safetensors treat BOOL bytes other than 0 and 1 as undefined: refuse them.
void check_bool_bytes(const std::string& path, const TensorInfo& t, const std::byte* p,
                      uint64_t n) {
  if (t.dtype != DType::kBool) return;
  if (const uint64_t i = first_non_bool(p, n); i < n) {
    throw_non_bool(path, t, static_cast<unsigned>(p[i]));
  }
}

// "<file>: tensor "<name>" (piece at offsets [..])", the context of a data error.
std::string piece_context(const std::string& path, const TensorInfo& t) {
  std::string out = path + ": tensor " + json_quote(t.name);
  if (!t.offsets.empty()) out += " (piece at offsets " + shape_to_string(t.offsets) + ")";
  return out;
}

// Runs touch() (plain code reading bytes [offset, offset + length) of the tensor at `data`, in a
// mapping of the file) through touch_mapped; a SIGBUS there is an error naming the file.
template <typename F>
void touch_or_throw(const std::string& path, const TensorInfo& t, uint64_t offset,
                    const std::byte* data, uint64_t length, F&& touch) {
  if (detail::touch_mapped(data, length, touch)) return;
  throw FormatError(piece_context(path, t) + ": bytes " + std::to_string(offset) + " to " +
                    std::to_string(offset + length) +
                    " could not be read through the file's mapping (SIGBUS): the file shrank "
                    "(truncated or rewritten by another process) or could not be read during "
                    "the load");
}

void check_stored_checksum(const std::string& path, const TensorInfo& t, uint64_t actual) {
  if (actual != *t.checksum) {
    throw FormatError(piece_context(path, t) + ": checksum mismatch: stored " +
                      format_checksum(*t.checksum) + ", data hashes to " + format_checksum(actual) +
                      " (corrupted data)");
  }
}

}  // namespace

struct ShardFile::Impl {
  std::string path;
  detail::FileIdentity identity;
  ShardHeader header;
  detail::NameIndex by_name;  // views of header.tensors' names

  ~Impl() { ReadFdCache::instance().forget(this); }

  ReadFdCache::Fd fd() const { return ReadFdCache::instance().get(this, path, identity); }
};

ShardFile::ShardFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardFile::ShardFile(ShardFile&&) noexcept = default;
ShardFile& ShardFile::operator=(ShardFile&&) noexcept = default;
ShardFile::~ShardFile() = default;

ShardFile ShardFile::open(const std::string& path, bool verify_checksums) {
  check_path(path, "shard file");
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  auto fd = std::make_shared<detail::UniqueFd>(detail::open_read_only(path));
  impl->identity = detail::file_identity(fd->get(), path);
  const uint64_t size = impl->identity.size;
  std::byte first8[8] = {};
  if (size >= 8) detail::pread_all(fd->get(), first8, 8, 0, path);
  const uint64_t n = parse_header_length(std::span<const std::byte>(first8, 8), size, path);
  std::string json(n, '\0');
  detail::pread_all(fd->get(), json.data(), n, 8, path);
  impl->header = interpret_shard_header(parse_safetensors_header(json, size, path), path);
  impl->by_name.reserve(impl->header.tensors.size());
  for (size_t i = 0; i < impl->header.tensors.size(); ++i) {
    impl->by_name.insert(impl->header.tensors[i].name, i);
  }
  ReadFdCache::instance().put(impl.get(), std::move(fd));
  ShardFile file(std::move(impl));
  if (verify_checksums) file.verify_all();
  return file;
}

const std::string& ShardFile::path() const { return impl_->path; }
uint64_t ShardFile::file_bytes() const { return impl_->header.raw.file_bytes; }
const ShardHeader& ShardFile::header() const { return impl_->header; }
const std::vector<TensorInfo>& ShardFile::tensors() const { return impl_->header.tensors; }
const std::map<std::string, std::string>& ShardFile::metadata() const {
  return impl_->header.raw.metadata;
}
bool ShardFile::is_fsdp_ema() const { return impl_->header.fsdp_ema; }

const TensorInfo* ShardFile::find(std::string_view name) const {
  const auto i = impl_->by_name.find(name);
  return i ? &impl_->header.tensors[*i] : nullptr;
}

const TensorInfo& ShardFile::tensor(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) {
    throw FormatError(impl_->path + ": no tensor " + json_quote(name) + " in this file");
  }
  return *t;
}

ShardMapping::ShardMapping(detail::MappedFile map)
    : map_(std::make_unique<detail::MappedFile>(std::move(map))) {}
ShardMapping::~ShardMapping() = default;

std::span<const std::byte> ShardMapping::data(const TensorInfo& t) const {
  if (t.nbytes == 0) return {};
  return {map_->data() + t.data_offset, t.nbytes};
}

std::shared_ptr<const ShardMapping> ShardFile::map() const {
  detail::ensure_guard();  // the mapping's reads in touch_mapped find the SIGBUS handler in place
  const auto fd = impl_->fd();  // a reopened descriptor is checked by fd() itself
  return std::make_shared<const ShardMapping>(
      detail::MappedFile(fd->get(), impl_->identity.size, impl_->path));
}

void ShardFile::prefetch_if_cold(uint64_t offset, uint64_t length) const {
  if (length == 0) return;
  const auto fd = impl_->fd();
  std::byte probe;
  iovec v{&probe, 1};
  if (::preadv2(fd->get(), &v, 1, static_cast<off_t>(offset), RWF_NOWAIT) >= 0 || errno != EAGAIN) {
    return;  // cached (or no answer): the reads find the bytes without help
  }
  (void)::posix_fadvise(fd->get(), static_cast<off_t>(offset), static_cast<off_t>(length),
                        POSIX_FADV_WILLNEED);
}

void ShardFile::read(const TensorInfo& t, uint64_t offset, uint64_t length, void* dst,
                     Checksummer* hash) const {
  auto end = checked_add(offset, length);
  if (!end || *end > t.nbytes) {
    throw FormatError(impl_->path + ": tensor " + json_quote(t.name) + ": read of " +
                      std::to_string(length) + " bytes at " + std::to_string(offset) +
                      " is outside its " + std::to_string(t.nbytes) + " bytes");
  }
  if (length == 0) return;
  const auto fd = impl_->fd();
  auto* out = static_cast<std::byte*>(dst);
  if (hash == nullptr) {
    detail::pread_all(fd->get(), out, length, t.data_offset + offset, impl_->path);
    check_bool_bytes(impl_->path, t, out, length);
    return;
  }
  for (uint64_t pos = 0; pos < length; pos += kHashBlockBytes) {
    const uint64_t n = std::min(kHashBlockBytes, length - pos);
    detail::pread_all(fd->get(), out + pos, n, t.data_offset + offset + pos, impl_->path);
    hash->update(out + pos, n);
    check_bool_bytes(impl_->path, t, out + pos, n);
  }
}

void ShardFile::check_digest(const TensorInfo& t, uint64_t digest) const {
  if (t.checksum) check_stored_checksum(impl_->path, t, digest);
}

void ShardFile::check_data(const TensorInfo& t, uint64_t offset, const std::byte* data,
                           uint64_t length, Bytes where) const {
  if (t.dtype != DType::kBool) return;
  if (where == Bytes::kOwned) {
    check_bool_bytes(impl_->path, t, data, length);
    return;
  }
  uint64_t i = length;
  unsigned value = 0;
  touch_or_throw(impl_->path, t, offset, data, length, [&] {
    i = first_non_bool(data, length);
    if (i < length) value = static_cast<unsigned>(data[i]);
  });
  if (i < length) throw_non_bool(impl_->path, t, value);
}

uint64_t ShardFile::digest_of(const TensorInfo& t, uint64_t offset, const std::byte* data,
                              uint64_t length, Bytes where) const {
  if (where == Bytes::kOwned) return checksum_of(data, length);
  uint64_t digest = 0;
  touch_or_throw(impl_->path, t, offset, data, length, [&] { digest = checksum_of(data, length); });
  return digest;
}

void ShardFile::hash_into(const TensorInfo& t, uint64_t offset, const std::byte* data,
                          uint64_t length, Checksummer& hash, Bytes where) const {
  if (where == Bytes::kOwned) {
    hash.update(data, length);
    return;
  }
  touch_or_throw(impl_->path, t, offset, data, length, [&] { hash.update(data, length); });
}

void ShardFile::check_blocks(const TensorInfo& t, uint64_t offset, const std::byte* data,
                             uint64_t length, Bytes where) const {
  const uint64_t b = impl_->header.block_bytes;
  if (b == 0 || !t.checksum) return;  // nothing stored to check against
  for (uint64_t pos = 0; pos < length; pos += b) {
    const uint64_t n = std::min(b, length - pos);
    const uint64_t k = (offset + pos) / b;
    const uint64_t stored = t.nbytes <= b ? *t.checksum : t.block_checksums[k];
    const uint64_t actual = digest_of(t, offset + pos, data + pos, n, where);
    if (actual != stored) {
      throw FormatError(piece_context(impl_->path, t) + ": checksum mismatch in block " +
                        std::to_string(k) + " (bytes " + std::to_string(offset + pos) + " to " +
                        std::to_string(offset + pos + n) + "): stored " + format_checksum(stored) +
                        ", data hashes to " + format_checksum(actual) +
                        " (corrupted data, or the file changed while it was read)");
    }
  }
}

void ShardFile::check_unchanged() const {
  const auto fd = impl_->fd();  // a reopened descriptor is checked by fd() itself
  ReadFdCache::check_identity(fd->get(), impl_->path, impl_->identity);
}

namespace {

// Every check of a tensor's bytes, fed in order in any split: the whole checksum, the block
// checksums (when the file has them) and the data checks.
class TensorVerdict {
 public:
  TensorVerdict(const ShardFile& file, const TensorInfo& t, uint64_t block_bytes)
      : file_(file), t_(t), hash_(t.nbytes, t.block_checksums.empty() ? 0 : block_bytes) {}
  void update(const std::byte* data, uint64_t n) {
    file_.check_data(t_, 0, data, n);
    hash_.update(data, n);
  }
  // True when a checksum was checked.
  bool finish() {
    if (!t_.checksum) return false;
    file_.check_digest(t_, hash_.digest());
    const std::vector<uint64_t>& blocks = hash_.blocks();
    for (size_t k = 0; k < blocks.size(); ++k) {
      if (blocks[k] != t_.block_checksums[k]) {
        throw FormatError(piece_context(file_.path(), t_) + ": checksum mismatch in block " +
                          std::to_string(k) + ": stored " + format_checksum(t_.block_checksums[k]) +
                          ", data hashes to " + format_checksum(blocks[k]) +
                          " (the block checksums disagree with the data's checksum)");
      }
    }
    return true;
  }

 private:
  const ShardFile& file_;
  const TensorInfo& t_;
  TensorHasher hash_;
};

}  // namespace

bool ShardFile::verify(const TensorInfo& t) const {
  // Raw reads: every check of the verdict is TensorVerdict's (the data checks included).
  TensorVerdict v(*this, t, impl_->header.block_bytes);
  std::vector<std::byte> block(std::min(kHashBlockBytes, t.nbytes));
  const auto fd = impl_->fd();
  for (uint64_t pos = 0; pos < t.nbytes; pos += block.size()) {
    const uint64_t n = std::min<uint64_t>(block.size(), t.nbytes - pos);
    detail::pread_all(fd->get(), block.data(), n, t.data_offset + pos, impl_->path);
    v.update(block.data(), n);
  }
  return v.finish();
}

bool ShardFile::verify(std::string_view name) const { return verify(tensor(name)); }

size_t ShardFile::verify_all() const {
  // Tensors are in data order and contiguous (checked at parse): stream the data section once.
  const auto& tensors = impl_->header.tensors;
  if (tensors.empty()) return 0;
  const uint64_t data_end = impl_->identity.size;
  std::vector<std::byte> block(std::min(kVerifyBlockBytes, data_end - tensors.front().data_offset));
  uint64_t block_start = 0;
  uint64_t block_len = 0;
  std::shared_ptr<const detail::UniqueFd> fd;
  size_t n = 0;
  for (const TensorInfo& t : tensors) {
    TensorVerdict v(*this, t, impl_->header.block_bytes);
    const uint64_t end = t.data_offset + t.nbytes;
    for (uint64_t pos = t.data_offset; pos < end;) {
      if (pos < block_start || pos >= block_start + block_len) {
        if (!fd) fd = impl_->fd();
        block_start = pos;
        block_len = std::min<uint64_t>(block.size(), data_end - pos);
        detail::pread_all(fd->get(), block.data(), block_len, block_start, impl_->path);
      }
      const uint64_t take = std::min(end, block_start + block_len) - pos;
      v.update(block.data() + (pos - block_start), take);
      pos += take;
    }
    n += v.finish() ? 1 : 0;
  }
  return n;
}

ShardDescription describe_shard_file(const std::string& path, int64_t rank, int64_t world_size) {
  ShardFile f = ShardFile::open(path, /*verify_checksums=*/false);
  const ShardHeader& h = f.header();
  if (!h.fsdp_ema || h.rank != rank || h.world_size != world_size) {
    throw FormatError(path + ": not the fsdp_ema shard file of rank " + std::to_string(rank) +
                      " of " + std::to_string(world_size) + " (metadata says rank " +
                      (h.rank ? std::to_string(*h.rank) : "?") + " of " +
                      (h.world_size ? std::to_string(*h.world_size) : "?") + ")");
  }
  ShardDescription d;
  d.rank = rank;
  d.world_size = world_size;
  d.file_bytes = f.file_bytes();
  d.tensors = h.tensors;
  return d;
}

}  // namespace fsdp_ema::format
