#include "format/export.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <memory>

#include "format/checkpoint_dir.h"
#include "format/dtype_cast.h"
#include "format/error.h"
#include "format/file_util.h"
#include "format/json_strict.h"
#include "format/safetensors_writer.h"

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
  {
    std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(out_dir.c_str()), &::closedir);
    if (!d) throw FormatError(out_dir + ": cannot list: " + detail::errno_text(errno));
    while (const dirent* e = ::readdir(d.get())) {
      if (is_model_file(e->d_name)) existing.emplace_back(e->d_name);
    }
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
    write_safetensors_file(detail::join_path(out_dir, name), raw, metadata, wopts);
    result.files.push_back(name);
  }

  const std::string index_path = detail::join_path(out_dir, kHfIndexName);
  if (nfiles > 1) {
    std::string json = "{\n  \"metadata\": {\"total_size\": " + std::to_string(result.total_size) +
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
    detail::write_file_atomically(index_path, json, options.fsync, /*replace=*/true);
    result.wrote_index = true;
  }
  // Files of an earlier export that this one did not rewrite would be read as part of it.
  for (const std::string& old : existing) {
    const bool ours =
        (old == kHfIndexName && result.wrote_index) ||
        std::find(result.files.begin(), result.files.end(), old) != result.files.end();
    if (!ours) detail::remove_quietly(detail::join_path(out_dir, old));
  }
  progress.tensor = {};
  report();
  return result;
}

}  // namespace fsdp_ema::format
