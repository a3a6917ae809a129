// Progress display for long CLI work: a redrawn bar on a terminal, plain periodic lines otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace fsdp_ema::tools {

// "1.5 GiB", "312 KiB", "17 B".
std::string human_bytes(uint64_t bytes);

class Progress {
 public:
  enum class Mode { kQuiet, kLines, kBar };

  // kBar when `out` is a terminal, kLines otherwise; kQuiet when quiet.
  static Mode pick_mode(std::FILE* out, bool quiet);

  Progress(std::FILE* out, Mode mode, std::string label);
  // Reports `done` of `total` bytes; cheap to call often. Nothing is shown before the work has
  // run for `quiet_for` (short work prints no progress at all); then it redraws at most 10 times
  // a second, a line at most every 5 seconds or 10 percent.
  void update(uint64_t done, uint64_t total, std::string_view detail);
  // Final state and newline (bar mode), when the work took at least `quiet_for`.
  void finish(uint64_t done, uint64_t total);

  // How long work may take before progress is shown.
  static constexpr std::chrono::milliseconds kQuietFor{1000};

 private:
  void draw(uint64_t done, uint64_t total, std::string_view detail, bool final);

  std::FILE* out_;
  Mode mode_;
  std::string label_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  int last_decile_ = -1;
  bool drawn_ = false;
};

}  // namespace fsdp_ema::tools
