// The one exception type of the checkpoint format code.
#pragma once

#include <stdexcept>
#include <string>

namespace fsdp_ema::format {

// Thrown for every malformed file, bad argument or I/O failure. The message names the file and
// the tensor involved (when there is one) and says what is wrong, e.g.
//   "/ckpt/shard-00001-of-00002.safetensors: tensor 'w': data_offsets [0, 12] hold 12 bytes but
//    shape [4] of F32 needs 16".
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace fsdp_ema::format
