// A fuzz smoke run without libFuzzer, for the default (any compiler) build: every corpus input,
// every truncation of it, and seeded random mutations (byte flips, insertions, deletions,
// splices with other inputs) through the same LLVMFuzzerTestOneInput. A broken invariant traps
// (the process dies), an escaped exception terminates it: either fails the ctest.
//   usage: fsdp_ema_fuzz_replay [--mutations N] CORPUS_DIR_OR_FILE...
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

using Bytes = std::vector<uint8_t>;

void run(const Bytes& b) { LLVMFuzzerTestOneInput(b.data(), b.size()); }

Bytes read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  long mutations = 300;
  std::vector<Bytes> inputs;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mutations") == 0 && i + 1 < argc) {
      mutations = std::atol(argv[++i]);
      continue;
    }
    const std::filesystem::path p(argv[i]);
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(p)) {
        if (e.is_regular_file()) inputs.push_back(read_file(e.path()));
      }
    } else {
      inputs.push_back(read_file(p));
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "fsdp_ema_fuzz_replay: no corpus inputs given\n");
    return 2;
  }
  std::mt19937_64 rng(20261201);
  long runs = 0;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Bytes& seed = inputs[k];
    run(seed);
    ++runs;
    for (size_t n = 0; n < seed.size() && n < 4096; ++n) {  // every truncation
      run(Bytes(seed.begin(), seed.begin() + static_cast<std::ptrdiff_t>(n)));
      ++runs;
    }
    for (long m = 0; m < mutations; ++m) {
      Bytes b = seed;
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits; ++e) {
        const size_t pos = b.empty() ? 0 : rng() % b.size();
        switch (rng() % 5) {
          case 0:  // flip bits
            if (!b.empty()) b[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
            break;
          case 1: {  // a byte JSON and the header parser care about
            static constexpr char kSpecial[] = "{}[]\",:0123456789-.eE\\u\x00\xff";
            if (!b.empty()) b[pos] = static_cast<uint8_t>(kSpecial[rng() % (sizeof(kSpecial) - 1)]);
            break;
          }
          case 2:  // insert
            b.insert(b.begin() + static_cast<std::ptrdiff_t>(pos), static_cast<uint8_t>(rng()));
            break;
          case 3:  // delete
            if (!b.empty()) b.erase(b.begin() + static_cast<std::ptrdiff_t>(pos));
            break;
          default: {  // splice the tail of another input
            const Bytes& other = inputs[rng() % inputs.size()];
            const size_t from = other.empty() ? 0 : rng() % other.size();
            b.resize(pos);
            b.insert(b.end(), other.begin() + static_cast<std::ptrdiff_t>(from), other.end());
          }
        }
      }
      run(b);
      ++runs;
    }
  }
  std::printf("fsdp_ema_fuzz_replay: %zu corpus inputs, %ld runs, no failure\n", inputs.size(),
              runs);
  return 0;
}
