// The ops that do the Python front's file-system work on checkpoint directories (every rule is
// format/'s, fsdp_ema/format/layout.h): is_committed, prepare_checkpoint, write_sidecar,
// committed_checkpoints, remove_checkpoint.
#pragma once

#include <c10/util/string_view.h>

#include <string>
#include <vector>

namespace fsdp_ema::ops {

// Whether `directory` holds a committed checkpoint (format::is_committed); creates nothing.
bool is_committed(c10::string_view directory);
// Creates `directory` (and parents) if missing; true when it holds a committed checkpoint already
// (format::prepare_checkpoint_dir).
bool prepare_checkpoint(c10::string_view directory);
// A small file beside the shard files, written atomically (format::write_sidecar).
void write_sidecar(c10::string_view directory, c10::string_view name, c10::string_view content,
                   bool fsync);
// Names of the committed checkpoint directories in `root`, in name order.
std::vector<std::string> committed_checkpoints(c10::string_view root, bool follow_links);
// Removes a checkpoint directory, index first (format::remove_checkpoint).
void remove_checkpoint(c10::string_view directory);
// .first: the same, the files named in `first` (other writers' commit markers) gone with the index,
// durably, before anything else.
void remove_checkpoint_first(c10::string_view directory, const std::vector<std::string>& first);

}  // namespace fsdp_ema::ops
