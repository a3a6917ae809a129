#include "tools/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>

#include "tools/terminal_text.h"

namespace fsdp_ema::tools {

std::string human_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%" PRIu64 " B", bytes);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[u]);
  }
  return buf;
}

Progress::Mode Progress::pick_mode(std::FILE* out, bool quiet) {
  if (quiet) return Mode::kQuiet;
  return ::isatty(::fileno(out)) ? Mode::kBar : Mode::kLines;
}

Progress::Progress(std::FILE* out, Mode mode, std::string label)
    : out_(out),
      mode_(mode),
      label_(std::move(label)),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void Progress::update(uint64_t done, uint64_t total, std::string_view detail) {
  if (mode_ == Mode::kQuiet) return;
  if (mode_ == Mode::kLines && done >= total) return;  // finish() prints the last line
  const auto now = std::chrono::steady_clock::now();
  if (now - start_ < kQuietFor) return;
  const int decile = total == 0 ? 10 : static_cast<int>(done * 10 / std::max<uint64_t>(total, 1));
  if (mode_ == Mode::kBar) {
    if (drawn_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  } else {
    if (decile == last_decile_ && now - last_draw_ < std::chrono::seconds(5)) return;
    last_decile_ = decile;
  }
  last_draw_ = now;
  draw(done, total, detail, false);
}

void Progress::finish(uint64_t done, uint64_t total) {
  if (mode_ == Mode::kQuiet) return;
  if (!drawn_ && std::chrono::steady_clock::now() - start_ < kQuietFor) return;
  draw(done, total, {}, true);
}

void Progress::draw(uint64_t done, uint64_t total, std::string_view detail, bool final) {
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double frac = total == 0 ? 1.0 : static_cast<double>(done) / static_cast<double>(total);
  const std::string rate =
      secs > 0 ? human_bytes(static_cast<uint64_t>(static_cast<double>(done) / secs)) + "/s"
               : std::string("-");
  if (mode_ == Mode::kBar) {
    constexpr int kWidth = 30;
    const int filled = std::clamp(static_cast<int>(frac * kWidth), 0, kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(kWidth - filled), '.');
    // The detail is a tensor name from the checkpoint: escaped before it reaches the terminal.
    std::string d = printable(detail).substr(0, 40);
    std::fprintf(out_, "\r%s [%s] %5.1f%%  %s / %s  %s  %-40s", label_.c_str(), bar.c_str(),
                 frac * 100.0, human_bytes(done).c_str(), human_bytes(total).c_str(), rate.c_str(),
                 d.c_str());
    if (final) std::fputc('\n', out_);
  } else {
    std::fprintf(out_, "%s: %.0f%% (%s of %s, %s)%s\n", label_.c_str(), frac * 100.0,
                 human_bytes(done).c_str(), human_bytes(total).c_str(), rate.c_str(),
                 final ? " done" : "");
  }
  std::fflush(out_);
  drawn_ = true;
}

}  // namespace fsdp_ema::tools
