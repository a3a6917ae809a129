// Every file name of the on-disk layout: shard files, the index, and the consolidated Hugging Face
// export. Writers, the commit, the readers and the Python front all take their names from here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fsdp_ema::format {

// Every data file of a checkpoint ends in this; a name starting with '.' is never one (hidden
// files and our temporaries, which start with '.').
inline constexpr std::string_view kSafetensorsSuffix = ".safetensors";
// True for a file a reader opens as data: "<not starting with '.'>...safetensors".
bool is_safetensors_file_name(std::string_view name);

// The commit marker of a checkpoint directory (index.h describes its contents).
inline constexpr std::string_view kIndexFileName = "fsdp_ema.index.json";
// The pickled metadata of a native torch.distributed.checkpoint directory: recognized, to refuse
// the directory by name (pickle is never loaded).
inline constexpr std::string_view kDcpMetadataFileName = ".metadata";

// "shard-00003-of-00008.safetensors" (5-digit rank and world size, wider if needed).
std::string shard_file_name(int64_t rank, int64_t world_size);
// "shard-00003-of-00008.b.safetensors": the name an overwrite writes when the committed index
// references the plain one (see layout.h), so the old checkpoint stays whole until the new index
// replaces it.
std::string alternate_shard_file_name(int64_t rank, int64_t world_size);
// True for the names our writers give shard files: shard-<digits>-of-<digits>[.b].safetensors.
bool is_shard_file_name(std::string_view name);
// The rank and world size a shard file name says (numbers of at most 18 digits), nullopt for
// any other name.
struct ShardFileName {
  int64_t rank = 0;
  int64_t world_size = 0;
  bool alternate = false;  // the ".b" name of an overwrite
};
std::optional<ShardFileName> parse_shard_file_name(std::string_view name);

// The consolidated export (export.h): one file, or numbered files plus the index.
inline constexpr std::string_view kExportSingleFileName = "model.safetensors";
inline constexpr std::string_view kExportIndexFileName = "model.safetensors.index.json";
// "model-00002-of-00005.safetensors" for k = 2 of n = 5 (k counts from 1).
std::string export_file_name(size_t k, size_t n);
// A file an export writes (what an overwrite replaces): the single file, the index, or
// model-*.safetensors.
bool is_export_file_name(std::string_view name);

// The tensors of a training-state checkpoint (python/fsdp_ema/store/training_state.py): the uint8
// tensor holding its JSON document (rank 0's file), and the prefixes of the EMA's and the model's
// tensors. `fsdp-ema export` recognizes a training state by the first and exports its EMA.
inline constexpr std::string_view kTrainingStateDocTensor = "meta.training_state";
inline constexpr std::string_view kTrainingStateEmaPrefix = "ema.";
inline constexpr std::string_view kTrainingStateModelPrefix = "model.";

// Names DCP's HuggingFaceStorageWriter gives its files: "shard-<S>-model-<M>-of-<N>.safetensors"
// (save_distributed: S = rank + 1) or "model-<M>-of-<N>.safetensors". Fields are 0 when absent.
struct DcpFileName {
  int64_t shard = 0;
  int64_t model = 0;
  int64_t of = 0;
};
// nullopt unless `name` is one of those (numbers of at most 9 digits, 1 <= M <= N).
std::optional<DcpFileName> parse_dcp_file_name(std::string_view name);

// The prefix of the temporaries written for `name`: ".<name>.tmp-", followed by
// "<pid>-<random>" (file_util.h's temp_path_for; the export's staging directory uses
// "fsdp_ema-export" as its name). A leading '.' keeps every temporary out of the data files.
std::string temporary_name_prefix(std::string_view name);
// The writer's pid recorded in a temporary's name that starts with `prefix`, or 0.
long temporary_owner_pid(std::string_view temporary, std::string_view prefix);

}  // namespace fsdp_ema::format
