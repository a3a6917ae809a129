// Writes the deterministic test checkpoint of fixture_model.h:
//   fsdp_ema_format_make_fixture OUT_DIR [WORLD [REFERENCE_FILE]]
// OUT_DIR gets WORLD shard files and the index; REFERENCE_FILE (outside OUT_DIR) gets the full
// tensors as one plain safetensors file, for checks by other readers (Python, DCP).
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/shard_writer.h"
#include "tests/format/fixture_model.h"

int main(int argc, char** argv) {
  namespace fmt = fsdp_ema::format;
  if (argc < 2 || argc > 4) {
    std::fprintf(stderr, "usage: %s OUT_DIR [WORLD [REFERENCE_FILE]]\n", argv[0]);
    return 2;
  }
  try {
    const std::string dir = argv[1];
    const int64_t world = argc > 2 ? std::atoll(argv[2]) : 2;
    if (world < 1) throw fmt::FormatError("WORLD must be at least 1");
    ::mkdir(dir.c_str(), 0755);
    const auto model = fmt::testing::reference_model();
    fmt::testing::write_checkpoint(dir, model, world);
    if (argc > 3) {
      std::vector<fmt::TensorToWrite> full;
      for (const auto& t : model) {
        full.push_back(fmt::TensorToWrite::full(t.name, t.dtype, t.shape,
                                                t.data.empty() ? nullptr : t.data.data()));
      }
      fmt::write_shard_file(argv[3], std::move(full));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_fixture: %s\n", e.what());
    return 1;
  }
  return 0;
}
