#include "fsdp_ema/format/export.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string_view>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/dtype_cast.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/paths.h"
#include "fsdp_ema/format/safetensors_header.h"
#include "fsdp_ema/format/safetensors_writer.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

constexpr std::string_view kHfIndexName = kExportIndexFileName;

std::string file_name_of(size_t g, size_t nfiles) {
  return nfiles == 1 ? std::string(kExportSingleFileName) : export_file_name(g + 1, nfiles);
}

// The staging directory holds only plain files (the new export and the writers' temporaries).
void remove_staging_quietly(const std::string& stage) noexcept {
  try {
    for (const std::string& n : detail::list_dir(stage))
      detail::remove_quietly(detail::join_path(stage, n));
  } catch (const FormatError&) {
  }
  ::rmdir(stage.c_str());
}

// "<out>/.fsdp_ema-export.tmp-<pid>-<random>": the new export is written here in full, then
// renamed into place, so a failure while writing leaves an earlier export untouched.
constexpr std::string_view kStagingName = "fsdp_ema-export";

// Staging directories of exports whose process is gone (a crash or a kill mid-write).
void remove_dead_staging(const std::string& out_dir) {
  for (const std::string& n : detail::list_dir(out_dir)) {
    if (detail::temporary_is_orphaned(n, temporary_name_prefix(kStagingName))) {
      remove_staging_quietly(detail::join_path(out_dir, n));
    }
  }
}

// Puts the complete export staged in `stage` in place of the earlier one (`existing`, its file
// names). Renames only, in an order that lets a reader see the earlier export, none, or the new
// one, never a mix: the earlier index goes first (its numbered files are then no export), then the
// earlier files the new export does not rename over (model.safetensors too when the new export is
// split), then the new weight files, the new index last. A single model.safetensors replacing
// another is one atomic rename: old, then new.
void switch_to_staged(const std::string& out_dir, const std::string& stage,
                      const std::vector<std::string>& existing, const ExportResult& result,
                      bool fsync) {
  auto is_new = [&](const std::string& n) {
    return std::find(result.files.begin(), result.files.end(), n) != result.files.end();
  };
  auto remove = [&](std::string_view name) {
    const std::string path = detail::join_path(out_dir, name);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      throw FormatError(path +
                        ": cannot remove the earlier export's file: " + detail::errno_text(errno));
    }
  };
  if (std::find(existing.begin(), existing.end(), kHfIndexName) != existing.end()) {
    remove(kHfIndexName);
    if (fsync) detail::fsync_directory(out_dir);
  }
  for (const std::string& old : existing) {
    // A model.safetensors left beside a new index would be read first (Hugging Face prefers it).
    if (old == kExportSingleFileName && !is_new(old)) remove(old);
    if (old != kHfIndexName && !is_new(old))
      detail::remove_quietly(detail::join_path(out_dir, old));
  }
  for (const std::string& f : result.files) {
    detail::rename_replace(detail::join_path(stage, f), detail::join_path(out_dir, f));
  }
  if (result.wrote_index) {
    detail::rename_replace(detail::join_path(stage, kHfIndexName),
                           detail::join_path(out_dir, kHfIndexName));
  }
  if (fsync) detail::fsync_directory(out_dir);
}

// The output directory of one export: created with its parents if missing (and removed again,
// while empty, unless the export finished: a failed export leaves no directory behind), with the
// earlier export's files in it listed; refused when there are some, unless overwrite.
class OutDir {
 public:
  OutDir(const std::string& out_dir, bool overwrite)
      : path_(out_dir), created_(detail::make_directories(out_dir)) {
    for (const std::string& n : detail::list_dir(out_dir)) {
      if (is_export_file_name(n)) existing_.push_back(n);
    }
    std::sort(existing_.begin(), existing_.end());
    if (!existing_.empty() && !overwrite) {
      throw FormatError(out_dir + ": already holds " + existing_.front() +
                        " (pass overwrite=True, or --overwrite on the command line, to replace an "
                        "earlier export)");
    }
  }
  ~OutDir() {
    if (!kept_) detail::remove_created_directories(path_, created_);
  }
  OutDir(const OutDir&) = delete;
  OutDir& operator=(const OutDir&) = delete;
  const std::vector<std::string>& existing() const { return existing_; }
  void keep() { kept_ = true; }

 private:
  std::string path_;
  std::string created_;  // the topmost directory this export made ("" for none)
  std::vector<std::string> existing_;
  bool kept_ = false;
};

void check_dtype_option(const ExportOptions& options) {
  if (options.dtype && !can_cast(*options.dtype, *options.dtype)) {
    throw FormatError("export: --dtype must be " + dtype_names_with_role(kRoleCast, ", ") +
                      ", not " + std::string(dtype_name(*options.dtype)));
  }
}

// The file dtype of a tensor that arrives as `dtype`.
DType output_dtype(DType dtype, const ExportOptions& options) {
  return (options.dtype && can_cast(dtype, *options.dtype)) ? *options.dtype : dtype;
}

// Tensors (given in name order, with their output bytes) into files: a new file starts when the
// next tensor would take the current one past max_file_bytes (0: no limit). Always one file.
std::vector<std::vector<size_t>> plan_files(const std::vector<uint64_t>& out_bytes, uint64_t max) {
  std::vector<std::vector<size_t>> groups;
  uint64_t in_group = 0;
  for (size_t i = 0; i < out_bytes.size(); ++i) {
    const bool full = max > 0 && !groups.empty() && !groups.back().empty() &&
                      (in_group > max || out_bytes[i] > max - in_group);
    if (groups.empty() || full) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(i);
    in_group += out_bytes[i];
  }
  if (groups.empty()) groups.emplace_back();  // no tensor: one empty file
  return groups;
}

// model.safetensors.index.json of a split export.
std::string index_json(uint64_t total_size, const std::vector<std::vector<size_t>>& groups,
                       const std::vector<std::string>& files,
                       const std::function<std::string_view(size_t)>& name_of) {
  std::string json = "{\n  \"metadata\": {\"total_size\": " + std::to_string(total_size) +
                     "},\n  \"weight_map\": {";
  bool first = true;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i : groups[g]) {
      json += first ? "\n    " : ",\n    ";
      first = false;
      json += json_quote(name_of(i)) + ": " + json_quote(files[g]);
    }
  }
  json += first ? "}\n}\n" : "\n  }\n}\n";
  return json;
}

// The hidden staging directory of one export inside out_dir; removed unless released.
class Stage {
 public:
  explicit Stage(const std::string& out_dir) : out_dir_(out_dir) {
    remove_dead_staging(out_dir);
    path_ = detail::temp_path_for(detail::join_path(out_dir, kStagingName));
    if (::mkdir(path_.c_str(), 0755) != 0) {
      throw FormatError(path_ +
                        ": cannot create the staging directory: " + detail::errno_text(errno));
    }
  }
  ~Stage() { discard(); }
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;
  const std::string& path() const { return path_; }
  std::string file(std::string_view name) const { return detail::join_path(path_, name); }
  void discard() noexcept {
    if (!path_.empty()) remove_staging_quietly(path_);
    path_.clear();
  }
  // Writes the index (several files), puts the staged export in place of `existing`.
  void finish(const std::vector<std::string>& existing, ExportResult& result,
              const std::vector<std::vector<size_t>>& groups,
              const std::function<std::string_view(size_t)>& name_of, bool fsync) {
    if (result.files.size() > 1) {
      detail::write_file_atomically(file(kHfIndexName),
                                    index_json(result.total_size, groups, result.files, name_of),
                                    fsync, /*replace=*/true);
      result.wrote_index = true;
    }
    switch_to_staged(out_dir_, path_, existing, result, fsync);
    ::rmdir(path_.c_str());
    path_.clear();
  }

 private:
  std::string out_dir_;
  std::string path_;
};

// The tensors an export writes, under their exported names: those whose names start with
// `prefix` (every tensor for an empty one), without it; `source` gets their names as stored.
std::vector<IndexTensor> select_tensors(const CheckpointDir& ckpt, const std::string& dir,
                                        const std::string& prefix,
                                        std::vector<std::string>& source) {
  std::vector<IndexTensor> tensors;
  for (const IndexTensor& t : ckpt.tensors()) {
    if (!t.name.starts_with(prefix) || t.name.size() == prefix.size()) continue;
    source.push_back(t.name);
    tensors.push_back(t);
    tensors.back().name = t.name.substr(prefix.size());
  }
  if (!prefix.empty() && tensors.empty()) {
    throw FormatError(dir + ": no tensor name starts with " + json_quote(prefix));
  }
  return tensors;
}

// Each tensor's output dtype and bytes; returns their total.
uint64_t size_outputs(const std::vector<IndexTensor>& tensors, const ExportOptions& options,
                      const std::string& dir, std::vector<DType>& out_dtype,
                      std::vector<uint64_t>& out_bytes) {
  uint64_t total_size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const IndexTensor& t = tensors[i];
    out_dtype[i] = output_dtype(t.dtype, options);
    auto b = nbytes(t.shape, out_dtype[i]);
    if (!b) throw FormatError(dir + ": tensor " + json_quote(t.name) + ": size overflows");
    out_bytes[i] = *b;
    auto total = checked_add(total_size, *b);
    if (!total) throw FormatError(dir + ": total size overflows");
    total_size = *total;
  }
  return total_size;
}

}  // namespace

ExportResult export_consolidated(const std::string& dir, const std::string& out_dir,
                                 const ExportOptions& options) {
  check_path(out_dir, "export output");
  check_dtype_option(options);
  const CheckpointDir ckpt = CheckpointDir::open(dir);
  // Checked before anything is created; by device and inode, so links and "dir/." are caught.
  if (same_or_inside(out_dir, dir)) {
    throw FormatError(out_dir + ": the export must go outside the checkpoint directory " + dir);
  }
  OutDir out(out_dir, options.overwrite);
  const std::vector<std::string>& existing = out.existing();

  // Output dtype and size per tensor, then files in name order, split at max_file_bytes.
  std::vector<std::string> source;  // the selected tensors' names in the checkpoint
  const std::vector<IndexTensor> tensors = select_tensors(ckpt, dir, options.select_prefix, source);
  std::vector<DType> out_dtype(tensors.size());
  std::vector<uint64_t> out_bytes(tensors.size());
  ExportResult result;
  result.total_size = size_outputs(tensors, options, dir, out_dtype, out_bytes);
  const std::vector<std::vector<size_t>> groups = plan_files(out_bytes, options.max_file_bytes);

  const size_t nfiles = groups.size();
  ExportProgress progress;
  progress.bytes_total = result.total_size;
  progress.num_files = nfiles;
  auto report = [&] {
    if (options.progress) options.progress(progress);
  };
  WriteOptions wopts;
  wopts.fsync = options.fsync;
  wopts.checksum_block_bytes = 0;  // the export's files carry no checksums of ours
  // The fills read each tensor in consecutive ranges: a piece without block checksums is then
  // hashed once across them (read_plan.h).
  const auto session = std::make_shared<ReadSession>();
  Stage stage(out_dir);
  {
    for (size_t g = 0; g < nfiles; ++g) {
      const std::string name = file_name_of(g, nfiles);
      progress.file_index = g;
      std::vector<RawTensor> raw;
      raw.reserve(groups[g].size());
      for (size_t i : groups[g]) {
        const IndexTensor& t = tensors[i];
        RawTensor r;
        r.name = t.name;
        r.dtype = out_dtype[i];
        r.shape = t.shape;
        r.nbytes = out_bytes[i];
        const DType src_dtype = t.dtype;
        const DType dst_dtype = out_dtype[i];
        const std::string& src = source[i];
        r.fill = [&ckpt, &t, &src, &progress, &report, &options, &session, src_dtype, dst_dtype](
                     uint64_t offset, uint64_t length, void* dst) {
          const uint64_t osz = dtype_size(dst_dtype), isz = dtype_size(src_dtype);
          const uint64_t e0 = offset / osz, e1 = (offset + length) / osz;
          if (src_dtype == dst_dtype) {
            ckpt.read_flat(src, e0, e1, dst, length, options.verify, session);
          } else {
            std::vector<std::byte> tmp((e1 - e0) * isz);
            ckpt.read_flat(src, e0, e1, tmp.data(), tmp.size(), options.verify, session);
            cast_elements(src_dtype, tmp.data(), dst_dtype, dst, e1 - e0);
          }
          progress.bytes_done += length;
          progress.tensor = t.name;
          report();
        };
        raw.push_back(std::move(r));
      }
      auto metadata = [](std::span<const uint64_t>) {
        return std::vector<std::pair<std::string, std::string>>{{"format", "pt"}};
      };
      write_safetensors_file(stage.file(name), raw, metadata, wopts);
      result.files.push_back(name);
    }
    // Every piece streamed was judged (the fills read each tensor to its end, in order).
    session->check_complete();
    stage.finish(
        existing, result, groups, [&](size_t i) -> std::string_view { return tensors[i].name; },
        options.fsync);
    out.keep();
  }
  progress.tensor = {};
  report();
  return result;
}
struct ExportWriter::Impl {
  std::string out_dir;
  ExportOptions options;
  std::vector<ExportEntry> entries;  // name order
  std::vector<DType> out_dtype;
  std::vector<uint64_t> numel;
  std::vector<uint64_t> written;  // elements written so far, per entry
  std::vector<size_t> file_of;
  std::vector<uint64_t> data_offset;  // absolute offset in its file
  std::vector<std::vector<size_t>> groups;
  std::unique_ptr<OutDir> out;  // before the stage inside it: destroyed after it
  std::vector<detail::UniqueFd> fds;
  std::vector<std::string> paths;
  ExportResult result;
  std::unique_ptr<Stage> stage;
  bool done = false;

  size_t find(std::string_view name) const {
    auto it = std::lower_bound(entries.begin(), entries.end(), name,
                               [](const ExportEntry& e, std::string_view n) { return e.name < n; });
    if (it == entries.end() || it->name != name) {
      throw FormatError(out_dir + ": export: tensor " + json_quote(name) +
                        " is not one the export was planned with");
    }
    return static_cast<size_t>(it - entries.begin());
  }
};

ExportWriter::ExportWriter(const std::string& out_dir, std::vector<ExportEntry> entries,
                           const ExportOptions& options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  check_path(out_dir, "export output");
  check_dtype_option(options);
  m.out_dir = out_dir;
  m.options = options;
  std::sort(entries.begin(), entries.end(),
            [](const ExportEntry& a, const ExportEntry& b) { return a.name < b.name; });
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].name.empty()) throw FormatError(out_dir + ": export: a tensor name is empty");
    if (i > 0 && entries[i].name == entries[i - 1].name) {
      throw FormatError(out_dir + ": export: tensor " + json_quote(entries[i].name) +
                        " appears twice");
    }
  }
  m.entries = std::move(entries);
  const size_t n = m.entries.size();
  m.out_dtype.resize(n);
  m.numel.resize(n);
  m.written.assign(n, 0);
  m.file_of.resize(n);
  m.data_offset.resize(n);
  std::vector<uint64_t> out_bytes(n);
  for (size_t i = 0; i < n; ++i) {
    const ExportEntry& e = m.entries[i];
    m.out_dtype[i] = output_dtype(e.dtype, options);
    const auto count = format::numel(e.shape);
    const auto b = nbytes(e.shape, m.out_dtype[i]);
    if (!count || !b) {
      throw FormatError(out_dir + ": export: tensor " + json_quote(e.name) + " has shape " +
                        shape_to_string(e.shape) + ", whose size is negative or overflows");
    }
    m.numel[i] = *count;
    out_bytes[i] = *b;
    const auto total = checked_add(m.result.total_size, *b);
    if (!total) throw FormatError(out_dir + ": export: total size overflows");
    m.result.total_size = *total;
  }
  m.groups = plan_files(out_bytes, options.max_file_bytes);
  m.out = std::make_unique<OutDir>(out_dir, options.overwrite);
  m.stage = std::make_unique<Stage>(out_dir);
  const std::vector<std::pair<std::string, std::string>> metadata{{"format", "pt"}};
  const size_t nfiles = m.groups.size();
  for (size_t g = 0; g < nfiles; ++g) {
    const std::string name = file_name_of(g, nfiles);
    // The same order and header as write_safetensors_file gives export_consolidated's files.
    std::vector<RawTensor> raw;
    raw.reserve(m.groups[g].size());
    for (size_t i : m.groups[g]) {
      RawTensor r;
      r.name = m.entries[i].name;
      r.dtype = m.out_dtype[i];
      r.shape = m.entries[i].shape;
      r.nbytes = out_bytes[i];
      raw.push_back(r);
    }
    const std::vector<size_t> order = file_order(raw);
    std::vector<HeaderEntry> header_entries(order.size());
    uint64_t pos = 0;
    for (size_t k = 0; k < order.size(); ++k) {
      const RawTensor& r = raw[order[k]];
      header_entries[k] = HeaderEntry{r.name, r.dtype, r.shape, pos, pos + r.nbytes};
      pos += r.nbytes;
    }
    const std::string header = serialize_safetensors_header(header_entries, metadata);
    for (size_t k = 0; k < order.size(); ++k) {
      const size_t i = m.groups[g][order[k]];
      m.file_of[i] = g;
      m.data_offset[i] = header.size() + header_entries[k].begin;
    }
    m.paths.push_back(m.stage->file(name));
    m.fds.push_back(detail::create_exclusive(m.paths.back()));
    detail::pwrite_all(m.fds.back().get(), header.data(), header.size(), 0, m.paths.back());
    if (::ftruncate(m.fds.back().get(), static_cast<off_t>(header.size() + pos)) != 0) {
      throw FormatError(m.paths.back() + ": cannot size the file: " + detail::errno_text(errno));
    }
    m.result.files.push_back(name);
  }
}

ExportWriter::~ExportWriter() { abort(); }

void ExportWriter::write(std::string_view name, uint64_t first, uint64_t count, const void* data) {
  Impl& m = *impl_;
  if (m.done || !m.stage) throw FormatError(m.out_dir + ": export: the writer is finished");
  const size_t i = m.find(name);
  if (first != m.written[i] || count > m.numel[i] - first) {
    throw FormatError(m.out_dir + ": export: tensor " + json_quote(name) + ": elements [" +
                      std::to_string(first) + ", " + std::to_string(first + count) +
                      ") written, but " + std::to_string(m.written[i]) + " of " +
                      std::to_string(m.numel[i]) + " are (writes go in order, each element once)");
  }
  const DType from = m.entries[i].dtype, to = m.out_dtype[i];
  const uint64_t osz = dtype_size(to), isz = dtype_size(from);
  const int fd = m.fds[m.file_of[i]].get();
  const std::string& path = m.paths[m.file_of[i]];
  const uint64_t offset = m.data_offset[i] + first * osz;
  if (from == to) {
    detail::pwrite_all(fd, data, count * osz, offset, path);
  } else {
    constexpr uint64_t kChunk = uint64_t{1} << 20;  // elements cast per write
    std::vector<std::byte> buf(std::min(count, kChunk) * osz);
    for (uint64_t e = 0; e < count; e += kChunk) {
      const uint64_t k = std::min(kChunk, count - e);
      cast_elements(from, static_cast<const std::byte*>(data) + e * isz, to, buf.data(), k);
      detail::pwrite_all(fd, buf.data(), k * osz, offset + e * osz, path);
    }
  }
  m.written[i] += count;
}

ExportResult ExportWriter::finish() {
  Impl& m = *impl_;
  if (m.done || !m.stage) throw FormatError(m.out_dir + ": export: the writer is finished");
  for (size_t i = 0; i < m.entries.size(); ++i) {
    if (m.written[i] != m.numel[i]) {
      throw FormatError(m.out_dir + ": export: tensor " + json_quote(m.entries[i].name) + " has " +
                        std::to_string(m.written[i]) + " of its " + std::to_string(m.numel[i]) +
                        " elements written");
    }
  }
  for (size_t g = 0; g < m.fds.size(); ++g) {
    if (m.options.fsync) detail::fsync_fd(m.fds[g].get(), m.paths[g]);
    m.fds[g].close_or_throw(m.paths[g]);
  }
  m.stage->finish(
      m.out->existing(), m.result, m.groups,
      [&](size_t i) -> std::string_view { return m.entries[i].name; }, m.options.fsync);
  m.out->keep();
  m.done = true;
  return m.result;
}

void ExportWriter::abort() noexcept {
  if (!impl_) return;
  impl_->fds.clear();  // closes them (quietly) before the staging directory goes
  if (impl_->stage) impl_->stage->discard();
  impl_->stage.reset();
  impl_->out.reset();  // removes out_dir when this export created it (and it is empty)
}

uint64_t ExportWriter::total_size() const { return impl_->result.total_size; }

}  // namespace fsdp_ema::format
