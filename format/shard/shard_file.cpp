#include "fsdp_ema/format/shard_file.h"

#include <fcntl.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/name_index.h"
#include "fsdp_ema/format/parallel.h"
#include "fsdp_ema/format/paths.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;
using detail::JsonReader;

std::optional<int64_t> parse_decimal(std::string_view s) {
  int64_t v = 0;
  if (s.empty()) return std::nullopt;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

using TensorsByName = detail::NameIndex;

// Reads a metadata value holding a JSON object keyed by tensor name, whose keys must be exactly
// the file's tensors, in one pass: on_entry(tensor, reader) reads each entry's value.
// `required(tensor)`: whether the tensor must have an entry (and may: an entry for a tensor
// that is not required is refused too); every tensor by default.
template <typename F, typename R>
void for_each_tensor_entry(const std::map<std::string, std::string>& metadata, std::string_view key,
                           std::vector<TensorInfo>& tensors, const TensorsByName& by_name,
                           const std::string& file, F&& on_entry, R&& required) {
  const std::string what = file + ": metadata " + std::string(key);
  const std::string& text = metadata.at(std::string(key));
  std::vector<char> seen(tensors.size(), 0);
  detail::interpret_json(text, what, [&] {
    JsonReader r(text, what);
    if (const auto kind = r.peek(); kind != JsonReader::Kind::kObject) {
      throw FormatError(what + ": is a JSON " + JsonReader::kind_name(kind) +
                        ", expected an object keyed by tensor name");
    }
    r.begin_object(/*caller_checks_keys=*/true);
    std::string name;
    size_t next = 0;  // writers list the entries in file order: try that slot before hashing
    while (r.next_key(name)) {
      const auto found = next < tensors.size() && tensors[next].name == name
                             ? std::optional<size_t>(next)
                             : by_name.find(name);
      if (!found) {
        throw FormatError(what + ": names tensor " + json_quote(name) + " that is not in the file");
      }
      if (seen[*found]) r.duplicate_key(name);
      if (!required(tensors[*found])) {
        throw FormatError(what + ": has an entry for tensor " + json_quote(name) +
                          ", which must have none");
      }
      seen[*found] = 1;
      next = *found + 1;
      on_entry(tensors[*found], r);
    }
    r.expect_end();
  });
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!seen[i] && required(tensors[i])) {
      throw FormatError(what + ": has no entry for tensor " + json_quote(tensors[i].name));
    }
  }
}

template <typename F>
void for_each_tensor_entry(const std::map<std::string, std::string>& metadata, std::string_view key,
                           std::vector<TensorInfo>& tensors, const TensorsByName& by_name,
                           const std::string& file, F&& on_entry) {
  for_each_tensor_entry(metadata, key, tensors, by_name, file, std::forward<F>(on_entry),
                        [](const TensorInfo&) { return true; });
}

// The block size of the extension: a power of two in the accepted range.
uint64_t parse_block_bytes(const std::string& value, const std::string& file) {
  const auto v = parse_decimal(value);
  const auto b = v ? static_cast<uint64_t>(*v) : 0;
  if (!v || b < kMinChecksumBlockBytes || b > kMaxChecksumBlockBytes || (b & (b - 1)) != 0) {
    throw FormatError(file + ": metadata " + std::string(kMetaBlockBytes) + " " +
                      json_quote(value) + " is not a power of two in [" +
                      std::to_string(kMinChecksumBlockBytes) + ", " +
                      std::to_string(kMaxChecksumBlockBytes) + "]");
  }
  return b;
}

// A checksum's digits per block, concatenated.
std::optional<std::vector<uint64_t>> parse_block_digits(std::string_view text, uint64_t blocks) {
  if (text.size() != blocks * kChecksumDigits) return std::nullopt;
  std::vector<uint64_t> out(blocks);
  for (uint64_t b = 0; b < blocks; ++b) {
    const auto v = parse_checksum_digits(text.substr(b * kChecksumDigits, kChecksumDigits));
    if (!v) return std::nullopt;
    out[b] = *v;
  }
  return out;
}

}  // namespace

ShardHeader interpret_shard_header(SafetensorsHeader raw, const std::string& file) {
  ShardHeader h;
  h.tensors.reserve(raw.tensors.size());
  // Views of the names in h.tensors, which is not resized after this loop.
  TensorsByName by_name;
  by_name.reserve(raw.tensors.size());
  for (HeaderTensor& e : raw.tensors) {
    TensorInfo t;
    t.name = std::move(e.name);
    t.dtype = e.dtype;
    t.offsets.assign(e.shape.size(), 0);
    t.shape = std::move(e.shape);
    t.data_offset = raw.data_start + e.begin;
    t.nbytes = e.end - e.begin;
    h.tensors.push_back(std::move(t));
  }
  // Moved into h.tensors: the raw entries would only hold a second copy of every name.
  raw.tensors.clear();
  raw.tensors.shrink_to_fit();
  for (size_t i = 0; i < h.tensors.size(); ++i) by_name.insert(h.tensors[i].name, i);
  const auto& md = raw.metadata;
  auto has = [&](std::string_view k) { return md.contains(std::string(k)); };

  if (!has(kMetaFormatVersion)) {
    // Our keys are reserved: a file that carries some of them claims our layout, and without the
    // version nothing says which rules it follows.
    for (const auto& [key, value] : md) {
      if (key.starts_with("fsdp_ema_")) {
        throw FormatError(file + ": metadata key " + json_quote(key) + " without " +
                          std::string(kMetaFormatVersion) +
                          ": a file that claims the fsdp_ema layout must say its version");
      }
    }
  }
  if (has(kMetaFormatVersion)) {
    const std::string& v = md.at(std::string(kMetaFormatVersion));
    if (parse_decimal(v) != kShardFormatVersion) {
      throw FormatError(file + ": unsupported " + std::string(kMetaFormatVersion) + " " +
                        json_quote(v) + " (this build reads " +
                        std::to_string(kShardFormatVersion) + ")");
    }
    h.fsdp_ema = true;
    for (std::string_view k :
         {kMetaDcpShardingInfo, kMetaGlobalShapes, kMetaChecksums, kMetaRank, kMetaWorldSize}) {
      if (!has(k)) {
        throw FormatError(file + ": fsdp_ema shard file lacks metadata key " + std::string(k));
      }
    }
  }

  // The three per-tensor metadata documents are parsed independently (in parallel when large):
  // each pass writes its own field of every TensorInfo, and the global shapes are checked
  // against the offsets once both are in. Errors are reported in the sequential order.
  const size_t n = h.tensors.size();
  std::vector<Shape> globals;
  std::vector<std::function<void()>> passes;
  size_t text_bytes = 0;
  if (has(kMetaDcpShardingInfo)) {
    text_bytes += md.at(std::string(kMetaDcpShardingInfo)).size();
    passes.emplace_back([&] {
      for_each_tensor_entry(
          md, kMetaDcpShardingInfo, h.tensors, by_name, file, [&](TensorInfo& t, JsonReader& r) {
            auto ctx = [&] {
              return file + ": tensor " + json_quote(t.name) + ": DCP_SHARDING_INFO";
            };
            std::optional<Shape> offsets;
            bool present = false;
            if (r.peek() == JsonReader::Kind::kObject) {
              r.begin_object();
              std::string k;
              while (r.next_key(k)) {
                if (k == "saved_offsets") {
                  present = true;
                  offsets = r.read_shape();
                } else {
                  r.skip_value();
                }
              }
            }
            if (!present)
              throw FormatError(ctx() + " entry must be an object with \"saved_offsets\"");
            if (!offsets || offsets->size() != t.shape.size()) {
              throw FormatError(ctx() + " saved_offsets must be " + std::to_string(t.shape.size()) +
                                " non-negative integers (one per dimension of shape " +
                                shape_to_string(t.shape) + ")");
            }
            for (size_t d = 0; d < offsets->size(); ++d) {
              if ((*offsets)[d] > std::numeric_limits<int64_t>::max() - t.shape[d]) {
                throw FormatError(ctx() + " saved_offsets " + shape_to_string(*offsets) +
                                  " + shape overflow");
              }
            }
            t.offsets = std::move(*offsets);
          });
    });
  }
  if (has(kMetaGlobalShapes)) {
    text_bytes += md.at(std::string(kMetaGlobalShapes)).size();
    globals.resize(n);
    passes.emplace_back([&] {
      for_each_tensor_entry(
          md, kMetaGlobalShapes, h.tensors, by_name, file, [&](TensorInfo& t, JsonReader& r) {
            auto g = r.read_shape();
            if (!g || g->size() != t.shape.size()) {
              throw FormatError(file + ": tensor " + json_quote(t.name) + ": " +
                                std::string(kMetaGlobalShapes) + " entry must be " +
                                std::to_string(t.shape.size()) +
                                " non-negative integers (one per dimension of shape " +
                                shape_to_string(t.shape) + ")");
            }
            globals[static_cast<size_t>(&t - h.tensors.data())] = std::move(*g);
          });
    });
  }
  if (has(kMetaChecksums)) {
    text_bytes += md.at(std::string(kMetaChecksums)).size();
    passes.emplace_back([&] {
      for_each_tensor_entry(
          md, kMetaChecksums, h.tensors, by_name, file, [&](TensorInfo& t, JsonReader& r) {
            std::optional<uint64_t> c;
            std::string text;
            if (r.peek() == JsonReader::Kind::kString) {
              text = r.read_string();
              c = parse_checksum(text);
              if (!c) text = json_quote(text);
            } else {
              text = std::string(r.skip_value());
            }
            if (!c) {
              throw FormatError(file + ": tensor " + json_quote(t.name) + ": checksum " + text +
                                " is not " + checksum_form_text());
            }
            t.checksum = *c;
          });
    });
  }
  if (has(kMetaBlockBytes) != has(kMetaBlockChecksums)) {
    throw FormatError(file + ": metadata " +
                      std::string(has(kMetaBlockBytes) ? kMetaBlockBytes : kMetaBlockChecksums) +
                      " without " +
                      std::string(has(kMetaBlockBytes) ? kMetaBlockChecksums : kMetaBlockBytes) +
                      ": the block-checksum extension needs both");
  }
  if (has(kMetaBlockChecksums)) {
    h.block_bytes = parse_block_bytes(md.at(std::string(kMetaBlockBytes)), file);
    text_bytes += md.at(std::string(kMetaBlockChecksums)).size();
    passes.emplace_back([&] {
      const uint64_t block = h.block_bytes;
      for_each_tensor_entry(
          md, kMetaBlockChecksums, h.tensors, by_name, file,
          [&](TensorInfo& t, JsonReader& r) {
            const uint64_t blocks = checksum_blocks(t.nbytes, block);
            std::optional<std::vector<uint64_t>> sums;
            if (r.peek() == JsonReader::Kind::kString) {
              sums = parse_block_digits(r.read_string(), blocks);
            } else {
              r.skip_value();
            }
            if (!sums) {
              throw FormatError(file + ": tensor " + json_quote(t.name) + ": " +
                                std::string(kMetaBlockChecksums) + " entry must be a string of " +
                                std::to_string(blocks) + " x " + checksum_digits_text() + " (" +
                                std::to_string(t.nbytes) + " bytes in blocks of " +
                                std::to_string(block) + ")");
            }
            t.block_checksums = std::move(*sums);
          },
          [block](const TensorInfo& t) { return t.nbytes > block; });
    });
  }
  const auto errors = detail::run_jobs(
      passes.size(), [&](size_t i) { passes[i](); },
      text_bytes >= detail::kParallelParseBytes ? 0 : 1);
  // Sharding info, then global shapes (parse, then the check against the offsets), then checksums.
  const bool has_globals = has(kMetaGlobalShapes);
  const size_t globals_pass = has(kMetaDcpShardingInfo) ? 1 : 0;
  for (size_t i = 0; i <= globals_pass && i < errors.size(); ++i) {
    if (errors[i]) std::rethrow_exception(errors[i]);
  }
  for (TensorInfo& t : h.tensors) {
    if (!has_globals) {
      t.global_shape.resize(t.shape.size());
      for (size_t d = 0; d < t.shape.size(); ++d) t.global_shape[d] = t.offsets[d] + t.shape[d];
      continue;
    }
    Shape& g = globals[static_cast<size_t>(&t - h.tensors.data())];
    for (size_t d = 0; d < g.size(); ++d) {
      if (t.offsets[d] + t.shape[d] > g[d]) {
        throw FormatError(
            file + ": tensor " + json_quote(t.name) + ": " + std::string(kMetaGlobalShapes) +
            ": offsets " + shape_to_string(t.offsets) + " + shape " + shape_to_string(t.shape) +
            " exceed global shape " + shape_to_string(g) + " in dimension " + std::to_string(d));
      }
    }
    if (!numel(g)) {
      throw FormatError(file + ": tensor " + json_quote(t.name) + ": " +
                        std::string(kMetaGlobalShapes) + ": global shape " + shape_to_string(g) +
                        " overflows");
    }
    t.global_shape = std::move(g);
  }
  detail::rethrow_first(errors);
  if (has(kMetaWorldSize)) {
    const std::string& v = md.at(std::string(kMetaWorldSize));
    auto w = parse_decimal(v);
    if (!w || *w < 1) {
      throw FormatError(file + ": metadata " + std::string(kMetaWorldSize) + " " + json_quote(v) +
                        " is not a positive integer");
    }
    h.world_size = *w;
  }
  if (has(kMetaRank)) {
    const std::string& v = md.at(std::string(kMetaRank));
    auto r = parse_decimal(v);
    if (!r || (h.world_size && *r >= *h.world_size)) {
      throw FormatError(file + ": metadata " + std::string(kMetaRank) + " " + json_quote(v) +
                        " is not an integer in [0, world size)");
    }
    h.rank = *r;
  }
  h.raw = std::move(raw);
  return h;
}

namespace {

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

// torch and safetensors treat BOOL bytes other than 0 and 1 as undefined: refuse them.
void check_bool_bytes(const std::string& path, const TensorInfo& t, const std::byte* p,
                      uint64_t n) {
  if (t.dtype != DType::kBool) return;
  for (uint64_t i = 0; i < n; ++i) {
    if (static_cast<unsigned char>(p[i]) > 1) {
      throw FormatError(path + ": tensor " + json_quote(t.name) + ": BOOL byte " +
                        std::to_string(static_cast<unsigned>(p[i])) +
                        " is neither 0 nor 1 (corrupt or not a bool tensor)");
    }
  }
}

// "<file>: tensor "<name>" (piece at offsets [..])", the context of a data error.
std::string piece_context(const std::string& path, const TensorInfo& t) {
  std::string out = path + ": tensor " + json_quote(t.name);
  if (!t.offsets.empty()) out += " (piece at offsets " + shape_to_string(t.offsets) + ")";
  return out;
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
  mutable std::once_flag map_once;
  mutable detail::MappedFile map;  // zero-copy opt-in only

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

std::span<const std::byte> ShardFile::data(const TensorInfo& t) const {
  if (t.nbytes == 0) return {};
  std::call_once(impl_->map_once, [&] {
    const auto fd = impl_->fd();
    impl_->map = detail::MappedFile(fd->get(), impl_->identity.size, impl_->path);
  });
  return {impl_->map.data() + t.data_offset, t.nbytes};
}

std::span<const std::byte> ShardFile::data(std::string_view name) const {
  return data(tensor(name));
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

void ShardFile::check_data(const TensorInfo& t, const std::byte* data, uint64_t length) const {
  check_bool_bytes(impl_->path, t, data, length);
}

void ShardFile::check_blocks(const TensorInfo& t, uint64_t offset, const std::byte* data,
                             uint64_t length) const {
  const uint64_t b = impl_->header.block_bytes;
  if (b == 0 || !t.checksum) return;  // nothing stored to check against
  for (uint64_t pos = 0; pos < length; pos += b) {
    const uint64_t n = std::min(b, length - pos);
    const uint64_t k = (offset + pos) / b;
    const uint64_t stored = t.nbytes <= b ? *t.checksum : t.block_checksums[k];
    const uint64_t actual = checksum_of(data + pos, n);
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
    file_.check_data(t_, data, n);
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
  TensorVerdict v(*this, t, impl_->header.block_bytes);
  std::vector<std::byte> block(std::min(kHashBlockBytes, t.nbytes));
  for (uint64_t pos = 0; pos < t.nbytes; pos += block.size()) {
    const uint64_t n = std::min<uint64_t>(block.size(), t.nbytes - pos);
    read(t, pos, n, block.data());
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

}  // namespace fsdp_ema::format
