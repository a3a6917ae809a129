#include "fsdp_ema/format/export.h"

#include <signal.h>
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
#include "fsdp_ema/format/safetensors_writer.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

constexpr std::string_view kHfIndexName = "model.safetensors.index.json";

std::string numbered_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

bool is_model_file(std::string_view n) {
  return n == "model.safetensors" || n == kHfIndexName ||
         (n.starts_with("model-") && n.ends_with(".safetensors"));
}

std::string real_or_empty(const std::string& p) {
  std::unique_ptr<char, decltype(&::free)> r(::realpath(p.c_str(), nullptr), &::free);
  return r ? std::string(r.get()) : std::string();
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
constexpr std::string_view kStagingPrefix = ".fsdp_ema-export.tmp-";

// Staging directories of exports whose process is gone (a crash or a kill mid-write).
void remove_dead_staging(const std::string& out_dir) {
  for (const std::string& n : detail::list_dir(out_dir)) {
    if (!n.starts_with(kStagingPrefix)) continue;
    const long pid = std::strtol(n.c_str() + kStagingPrefix.size(), nullptr, 10);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
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
    if (old == "model.safetensors" && !is_new(old)) remove(old);
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

}  // namespace

ExportResult export_consolidated(const std::string& dir, const std::string& out_dir,
                                 const ExportOptions& options) {
  if (options.dtype && !can_cast(*options.dtype, *options.dtype)) {
    throw FormatError("export: --dtype must be F64, F32, F16 or BF16, not " +
                      std::string(dtype_name(*options.dtype)));
  }
  const CheckpointDir ckpt = CheckpointDir::open(dir);

  if (!detail::is_directory(out_dir)) {
    if (::mkdir(out_dir.c_str(), 0755) != 0 && errno != EEXIST) {
      throw FormatError(out_dir + ": cannot create output directory: " + detail::errno_text(errno));
    }
  }
  if (real_or_empty(out_dir) == real_or_empty(dir)) {
    throw FormatError(out_dir + ": the export must go to another directory than the checkpoint");
  }
  std::vector<std::string> existing;
  for (const std::string& n : detail::list_dir(out_dir)) {
    if (is_model_file(n)) existing.push_back(n);
  }
  if (!existing.empty() && !options.overwrite) {
    throw FormatError(out_dir + ": already holds " + existing.front() +
                      " (pass overwrite to replace an earlier export)");
  }

  // Output dtype and size per tensor, then files in name order, split at max_file_bytes.
  std::vector<IndexTensor> tensors;  // the selected tensors, under their exported names
  std::vector<std::string> source;   // their names in the checkpoint
  const std::string& prefix = options.select_prefix;
  for (const IndexTensor& t : ckpt.tensors()) {
    if (!t.name.starts_with(prefix) || t.name.size() == prefix.size()) continue;
    source.push_back(t.name);
    tensors.push_back(t);
    tensors.back().name = t.name.substr(prefix.size());
  }
  if (!prefix.empty() && tensors.empty()) {
    throw FormatError(dir + ": no tensor name starts with " + json_quote(prefix));
  }
  std::vector<DType> out_dtype(tensors.size());
  std::vector<uint64_t> out_bytes(tensors.size());
  ExportResult result;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const IndexTensor& t = tensors[i];
    out_dtype[i] = (options.dtype && can_cast(t.dtype, *options.dtype)) ? *options.dtype : t.dtype;
    auto b = nbytes(t.shape, out_dtype[i]);
    if (!b) throw FormatError(dir + ": tensor " + json_quote(t.name) + ": size overflows");
    out_bytes[i] = *b;
    auto total = checked_add(result.total_size, *b);
    if (!total) throw FormatError(dir + ": total size overflows");
    result.total_size = *total;
  }
  std::vector<std::vector<size_t>> groups;
  uint64_t in_group = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t max = options.max_file_bytes;
    const bool full = max > 0 && !groups.empty() && !groups.back().empty() &&
                      (in_group > max || out_bytes[i] > max - in_group);
    if (groups.empty() || full) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(i);
    in_group += out_bytes[i];
  }
  if (groups.empty()) groups.emplace_back();  // an empty checkpoint exports one empty file

  const size_t nfiles = groups.size();
  ExportProgress progress;
  progress.bytes_total = result.total_size;
  progress.num_files = nfiles;
  auto report = [&] {
    if (options.progress) options.progress(progress);
  };
  WriteOptions wopts;
  wopts.fsync = options.fsync;
  remove_dead_staging(out_dir);
  const std::string stage = detail::temp_path_for(detail::join_path(out_dir, "fsdp_ema-export"));
  if (::mkdir(stage.c_str(), 0755) != 0) {
    throw FormatError(stage +
                      ": cannot create the staging directory: " + detail::errno_text(errno));
  }
  try {
    for (size_t g = 0; g < nfiles; ++g) {
      const std::string name = nfiles == 1 ? "model.safetensors" : numbered_name(g + 1, nfiles);
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
        r.fill = [&ckpt, &t, &src, &progress, &report, &options, src_dtype, dst_dtype](
                     uint64_t offset, uint64_t length, void* dst) {
          const uint64_t osz = dtype_size(dst_dtype), isz = dtype_size(src_dtype);
          const uint64_t e0 = offset / osz, e1 = (offset + length) / osz;
          if (src_dtype == dst_dtype) {
            ckpt.read_flat(src, e0, e1, dst, length, options.verify);
          } else {
            std::vector<std::byte> tmp((e1 - e0) * isz);
            ckpt.read_flat(src, e0, e1, tmp.data(), tmp.size(), options.verify);
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
      write_safetensors_file(detail::join_path(stage, name), raw, metadata, wopts);
      result.files.push_back(name);
    }

    if (nfiles > 1) {
      std::string json =
          "{\n  \"metadata\": {\"total_size\": " + std::to_string(result.total_size) +
          "},\n  \"weight_map\": {";
      bool first = true;
      for (size_t g = 0; g < nfiles; ++g) {
        for (size_t i : groups[g]) {
          json += first ? "\n    " : ",\n    ";
          first = false;
          json += json_quote(tensors[i].name) + ": " + json_quote(result.files[g]);
        }
      }
      json += first ? "}\n}\n" : "\n  }\n}\n";
      detail::write_file_atomically(detail::join_path(stage, kHfIndexName), json, options.fsync,
                                    /*replace=*/true);
      result.wrote_index = true;
    }
    switch_to_staged(out_dir, stage, existing, result, options.fsync);
  } catch (...) {
    remove_staging_quietly(stage);
    throw;
  }
  ::rmdir(stage.c_str());
  progress.tensor = {};
  report();
  return result;
}

}  // namespace fsdp_ema::format
