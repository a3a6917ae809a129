#include "ops/checkpoint/directory.h"

#include <string>
#include <string_view>

#include "fsdp_ema/format/layout.h"
#include "ops/common/format_bridge.h"

namespace fsdp_ema::ops {

bool is_committed(c10::string_view directory) {
  return translate_errors("fsdp_ema::is_committed: ",
                          [&] { return format::is_committed(std::string(directory)); });
}

bool prepare_checkpoint(c10::string_view directory) {
  return translate_errors("fsdp_ema::prepare_checkpoint: ",
                          [&] { return format::prepare_checkpoint_dir(std::string(directory)); });
}

void write_sidecar(c10::string_view directory, c10::string_view name, c10::string_view content,
                   bool fsync) {
  translate_errors("fsdp_ema::write_sidecar: ", [&] {
    format::write_sidecar(std::string(directory), std::string_view(name.data(), name.size()),
                          std::string_view(content.data(), content.size()), fsync);
  });
}

std::vector<std::string> committed_checkpoints(c10::string_view root, bool follow_links) {
  return translate_errors("fsdp_ema::committed_checkpoints: ", [&] {
    return format::committed_checkpoints(std::string(root), follow_links);
  });
}

void remove_checkpoint(c10::string_view directory) { remove_checkpoint_first(directory, {}); }

void remove_checkpoint_first(c10::string_view directory, const std::vector<std::string>& first) {
  translate_errors("fsdp_ema::remove_checkpoint: ",
                   [&] { format::remove_checkpoint(std::string(directory), first); });
}

}  // namespace fsdp_ema::ops
