// Every file name of the on-disk layout: shard files, the index, and the consolidated Hugging Face
// export. Writers, the commit, the readers and the Python front all take their names from here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace fsdp_ema::format {

// The commit marker of a checkpoint directory (index.h describes its contents).
inline constexpr std::string_view kIndexFileName = "fsdp_ema.index.json";

// "shard-00003-of-00008.safetensors" (5-digit rank and world size, wider if needed).
std::string shard_file_name(int64_t rank, int64_t world_size);
// "shard-00003-of-00008.b.safetensors": the name an overwrite writes when the committed index
// references the plain one (see layout.h), so the old checkpoint stays whole until the new index
// replaces it.
std::string alternate_shard_file_name(int64_t rank, int64_t world_size);
// True for the names our writers give shard files: shard-<digits>-of-<digits>[.b].safetensors.
bool is_shard_file_name(std::string_view name);

// The consolidated export (export.h): one file, or numbered files plus the index.
inline constexpr std::string_view kExportSingleFileName = "model.safetensors";
inline constexpr std::string_view kExportIndexFileName = "model.safetensors.index.json";
// "model-00002-of-00005.safetensors" for k = 2 of n = 5 (k counts from 1).
std::string export_file_name(size_t k, size_t n);
// A file an export writes (what an overwrite replaces): the single file, the index, or
// model-*.safetensors.
bool is_export_file_name(std::string_view name);

}  // namespace fsdp_ema::format
