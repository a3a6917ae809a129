// Test helpers: temporary directories, whole-file I/O, capturing FormatError messages.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "fsdp_ema/format/error.h"

namespace fsdp_ema::format::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base != nullptr && *base != '\0' ? base : "/tmp") +
                       "/fsdp_ema_format_test.XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  // A new subdirectory.
  std::string subdir(const std::string& name) const {
    const std::string p = file(name);
    std::filesystem::create_directories(p);
    return p;
  }

 private:
  std::string path_;
};

inline std::vector<std::byte> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(chars.size());
  std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) throw std::runtime_error("cannot write " + path);
}
inline void write_bytes(const std::string& path, const std::vector<std::byte>& data) {
  write_bytes(path, data.data(), data.size());
}
inline void write_text(const std::string& path, const std::string& text) {
  write_bytes(path, text.data(), text.size());
}

// The names in a directory, sorted.
inline std::vector<std::string> list_names(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Every file of `dir` (hidden ones included) by name, with its bytes.
inline std::map<std::string, std::vector<std::byte>> files_of(const std::string& dir) {
  std::map<std::string, std::vector<std::byte>> out;
  for (const std::string& n : list_names(dir)) out[n] = read_bytes(dir + "/" + n);
  return out;
}

// A second writer of `path`, as another process would be: from construction to destruction a
// thread of its own flips random bytes of [begin, begin + length) in place and restores each,
// by pwrite or through a MAP_SHARED mapping whose first page it dirties first (a write to a dirty
// shared page moves neither mtime nor ctime). `hold`: how long each change stays before it is
// restored (and before the next), so that it can fall between a verification and a later read.
class InPlaceWriter {
 public:
  InPlaceWriter(const std::string& path, uint64_t begin, uint64_t length, bool mapped,
                std::chrono::microseconds hold = std::chrono::microseconds(0))
      : thread_([this, path, begin, length, mapped, hold] {
          const int fd = ::open(path.c_str(), O_RDWR);
          EXPECT_GE(fd, 0) << path;
          if (fd < 0) return;
          const auto size = static_cast<size_t>(::lseek(fd, 0, SEEK_END));
          auto* map = static_cast<unsigned char*>(
              ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
          EXPECT_NE(map, MAP_FAILED) << path;
          if (map != MAP_FAILED) {
            map[0] = map[0];  // dirty the first page: later writes to it move no time stamp
            uint64_t x = 7;
            while (!stop_.load()) {
              x = x * 6364136223846793005u + 1442695040888963407u;
              const uint64_t at = begin + (x >> 20) % length;
              flip(fd, map, at, mapped);
              if (hold.count() > 0) std::this_thread::sleep_for(hold);
              flip(fd, map, at, mapped);
              if (hold.count() > 0) std::this_thread::sleep_for(hold);
            }
            ::munmap(map, size);
          }
          ::close(fd);
        }) {}
  ~InPlaceWriter() {
    stop_ = true;
    thread_.join();
  }
  InPlaceWriter(const InPlaceWriter&) = delete;
  InPlaceWriter& operator=(const InPlaceWriter&) = delete;

 private:
  static void flip(int fd, unsigned char* map, uint64_t at, bool mapped) {
    if (mapped) {
      map[at] ^= 0x40;
      return;
    }
    unsigned char c = 0;
    EXPECT_EQ(::pread(fd, &c, 1, static_cast<off_t>(at)), 1);
    c ^= 0x40;
    EXPECT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(at)), 1);
  }

  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: started once stop_ exists
};

// The FormatError message `f` throws; a test failure (and "") if it throws nothing or another
// type.
// Flips one byte of a file in place (same inode, like disk corruption would).
inline void flip_byte(const std::string& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char c;
  ASSERT_EQ(::pread(fd, &c, 1, static_cast<off_t>(offset)), 1);
  c ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const FormatError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected FormatError, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected FormatError, nothing was thrown";
  return "";
}

// A safetensors file from a raw JSON header (padded to a multiple of 8 like the reference
// writer) and `data_bytes` bytes of data.
inline std::vector<std::byte> raw_safetensors(const std::string& json, size_t data_bytes,
                                              uint8_t fill = 0xab) {
  std::string header = json;
  while ((8 + header.size()) % 8 != 0) header += ' ';
  std::vector<std::byte> out(8 + header.size() + data_bytes, std::byte{fill});
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = std::byte((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

// n distinct 24-byte ASCII names (bytes 0x01-0x7f; write them into JSON with json_quote) that
// all have one std::hash<std::string_view> under libstdc++: 64-bit MurmurHash2 with a fixed seed,
// invertible per 8-byte block. The first two blocks are random, the third is solved for a fixed
// state and kept when it is ASCII without NUL (about 1 try in 270). What a crafted file does to a
// table keyed by the unseeded hash; callers check the collision with std::hash itself.
inline std::vector<std::string> names_colliding_under_std_hash(size_t n, uint64_t seed = 1) {
  constexpr uint64_t kMul = 0xc6a4a7935bd1e995ULL;
  constexpr uint64_t kLibstdcxxSeed = 0xc70f6907ULL;
  uint64_t inv = kMul;  // Newton's iteration for the inverse of an odd number mod 2^64
  for (int i = 0; i < 6; ++i) inv *= 2 - kMul * inv;
  auto shift_mix = [](uint64_t v) { return v ^ (v >> 47); };  // its own inverse (47 > 32)
  auto mix = [&](uint64_t block) { return shift_mix(block * kMul) * kMul; };
  auto unmix = [&](uint64_t v) { return shift_mix(v * inv) * inv; };
  uint64_t state = seed * 0x9e3779b97f4a7c15ULL + 1;
  auto block = [&] {  // 8 random bytes in '@'..DEL
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (state & 0x3f3f3f3f3f3f3f3fULL) | 0x4040404040404040ULL;
  };
  auto ascii_no_nul = [](uint64_t b) {
    constexpr uint64_t kLow = 0x0101010101010101ULL, kHigh = 0x8080808080808080ULL;
    return (b & kHigh) == 0 && ((b - kLow) & ~b & kHigh) == 0;
  };
  const uint64_t start = kLibstdcxxSeed ^ (24 * kMul);
  // The state after the third block that every name reaches (that of one random name).
  const uint64_t target =
      (((start ^ mix(block())) * kMul ^ mix(block())) * kMul ^ mix(block())) * kMul;
  std::vector<std::string> out;
  out.reserve(n);
  while (out.size() < n) {
    const uint64_t b1 = block();
    const uint64_t s1 = (start ^ mix(b1)) * kMul;
    for (int tries = 0; tries < 4096 && out.size() < n; ++tries) {
      const uint64_t b2 = block();
      const uint64_t b3 = unmix((target * inv) ^ ((s1 ^ mix(b2)) * kMul));
      if (!ascii_no_nul(b3)) continue;
      std::string name(24, '\0');
      for (int k = 0; k < 8; ++k) {
        name[k] = static_cast<char>((b1 >> (8 * k)) & 0xff);
        name[8 + k] = static_cast<char>((b2 >> (8 * k)) & 0xff);
        name[16 + k] = static_cast<char>((b3 >> (8 * k)) & 0xff);
      }
      out.push_back(std::move(name));
    }
  }
  return out;
}

}  // namespace fsdp_ema::format::testing
