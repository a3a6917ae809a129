// Test helpers: temporary directories, whole-file I/O, capturing FormatError messages.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
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

// The FormatError message `f` throws; a test failure (and "") if it throws nothing or another
// type.
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

}  // namespace fsdp_ema::format::testing
