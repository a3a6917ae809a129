// Zero-copy reads verified through a file's mapping (ShardFile::map, execute_reads with
// ExecOptions::mapped) when the file shrinks under the mapping: the verification's SIGBUS is a
// FormatError naming the file (mapped_guard.h), on every check (block checksums, whole-piece
// checksums hashed in order on several threads, the BOOL check of an unverified read), and the
// process and the guard go on working. A SIGBUS that is not the guard's (another thread's, or
// outside a guarded loop) still reaches the handler installed before the guard, or kills.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fsdp_ema/format/mapped_guard.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/read_exec.h"
#include "fsdp_ema/format/read_plan.h"
#include "fsdp_ema/format/shard_file.h"
#include "tests/format/fixture_model.h"
#include "tests/format/test_util.h"

// Under AddressSanitizer its own SIGBUS handler is the one before the guard (it reports, then
// exits with 1): the default action cannot be seen there.
#if defined(__SANITIZE_ADDRESS__)
#define FSDP_EMA_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FSDP_EMA_TEST_ASAN 1
#endif
#endif
#ifndef FSDP_EMA_TEST_ASAN
#define FSDP_EMA_TEST_ASAN 0
#endif

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using testing::error_of;
using ::testing::HasSubstr;
using testing::RefTensor;
using testing::TempDir;

// "big" over three 8 MiB read chunks and an odd tail, then a BOOL tensor (file order is name
// order: "big", then "mask").
std::vector<RefTensor> model() {
  return {testing::make_ref("big", DType::kF32,
                            {(3 * static_cast<int64_t>(kReadChunkBytes)) / 12 + 7, 3}, 41),
          testing::make_ref("mask", DType::kBool, {3001}, 42)};
}

WriteOptions blocks(uint64_t block_bytes) {
  WriteOptions o;
  o.fsync = false;
  o.checksum_block_bytes = block_bytes;
  return o;
}

// Runs the file's whole-file plan through `mapping` (nothing placed: what a zero-copy load does).
void verify_mapped(const ShardFile& file, const ShardMapping& mapping, bool verify,
                   size_t threads) {
  const ReadPlan plan = plan_file_reads(file, verify);
  const std::vector<std::byte*> none(file.tensors().size(), nullptr);
  execute_reads(plan, none,
                {threads, [&](const ShardFile&) -> const ShardMapping& { return mapping; }});
}

void truncate_to(const std::string& path, uint64_t bytes) {
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(bytes)), 0);
}

// The file's data offset of tensor `name`.
uint64_t data_offset(const ShardFile& f, const std::string& name) {
  return f.tensor(name).data_offset;
}

TEST(MappedReads, AFileTruncatedUnderTheMappingIsAnErrorNamingTheFile) {
  const auto ref = model();
  // Whole-piece checksums only (a lane hashes "big" in order, on several threads), and blocks.
  for (const uint64_t block : {uint64_t{0}, kChecksumBlockBytes}) {
    TempDir dir;
    testing::write_checkpoint(dir.path(), ref, 1, blocks(block));
    const std::string path = dir.file(shard_file_name(0, 1));
    const std::vector<std::byte> whole = testing::read_bytes(path);
    const ShardFile file = ShardFile::open(path);
    for (const size_t threads : {size_t{1}, size_t{3}}) {
      // Inside "big" (its later chunks past the end), then nothing left (the BOOL check of an
      // unverified read faults too).
      for (const uint64_t cut : {data_offset(file, "big") + 4096 * 3, uint64_t{0}}) {
        for (const bool verify : {true, false}) {
          const auto mapping = file.map();
          truncate_to(path, cut);
          const std::string where = "block " + std::to_string(block) + " threads " +
                                    std::to_string(threads) + " cut " + std::to_string(cut) +
                                    " verify " + std::to_string(verify);
          if (!verify && cut > 0) {
            // Unverified: only the BOOL bytes are read, and they lie past the cut too.
            ASSERT_GT(data_offset(file, "mask"), cut);
          }
          const std::string e = error_of([&] { verify_mapped(file, *mapping, verify, threads); });
          EXPECT_THAT(e, AllOf(HasSubstr(path),
                               HasSubstr("could not be read through the file's "
                                         "mapping (SIGBUS)"),
                               HasSubstr("the file shrank")))
              << where;
          EXPECT_THAT(e, HasSubstr(verify ? "tensor \"" : "tensor \"mask\"")) << where;
          // Whole again: a new mapping verifies, through the same guard.
          testing::write_bytes(path, whole);
          verify_mapped(file, *file.map(), verify, threads);
        }
      }
    }
  }
}

// Several threads verifying mappings of their own at once, each of its own file truncated: every
// thread gets its own error (the guard returns each fault to the thread that took it).
TEST(MappedReads, ThreadsTruncatedAtOnceEachGetTheirOwnError) {
  const auto ref = model();
  constexpr int kThreads = 4;
  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::string> paths;
  std::vector<ShardFile> files;
  for (int i = 0; i < kThreads; ++i) {
    dirs.push_back(std::make_unique<TempDir>());
    testing::write_checkpoint(dirs.back()->path(), ref, 1, blocks(0));
    paths.push_back(dirs.back()->file(shard_file_name(0, 1)));
    files.push_back(ShardFile::open(paths.back()));
  }
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      const auto mapping = files[i].map();
      ::truncate(paths[i].c_str(), static_cast<off_t>(data_offset(files[i], "big") + 8192));
      try {
        verify_mapped(files[i], *mapping, true, 1);
      } catch (const FormatError& e) {
        errors[i] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_THAT(errors[i], AllOf(HasSubstr(paths[i]), HasSubstr("the file shrank"))) << i;
  }
}

// A plan with a stream session is not mapped: a session hashes what it is fed unguarded.
TEST(MappedReads, AMappedPlanWithAStreamSessionIsRefused) {
  TempDir dir;
  testing::write_checkpoint(dir.path(), model(), 1, blocks(0));
  const ShardFile file = ShardFile::open(dir.file(shard_file_name(0, 1)));
  const auto mapping = file.map();
  ReadPlan plan = plan_file_reads(file, true);
  plan.session = std::make_shared<ReadSession>();
  const std::vector<std::byte*> none(file.tensors().size(), nullptr);
  EXPECT_THAT(error_of([&] {
                execute_reads(plan, none, {1, [&](const ShardFile&) -> const ShardMapping& {
                                             return *mapping;
                                           }});
              }),
              HasSubstr("a mapped plan streams nothing"));
}

// --- SIGBUS that is not the guard's -------------------------------------------------------------

// A page of a file, mapped, then truncated away: touching it raises SIGBUS.
const volatile char* page_past_the_end(const std::string& path) {
  testing::write_bytes(path, std::vector<std::byte>(8192, std::byte{1}));
  const int fd = ::open(path.c_str(), O_RDONLY);
  void* p = ::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) ::_exit(3);
  truncate_to(path, 0);
  return static_cast<const volatile char*>(p);
}

void exit_42(int) { ::_exit(42); }

// The guard installed (a guarded call ran) over a handler of the program's own.
void guard_over(void (*handler)(int), int flags = 0) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  sa.sa_flags = flags;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
  char byte = 0;
  auto touch = [&] { byte = 1; };
  if (!detail::touch_mapped(&byte, 1, touch) || byte != 1) ::_exit(4);
}

// In a death test's child: the guard installed over `handler`, then a SIGBUS outside any guarded
// loop (with `other_thread_guards`, inside the range another thread's guarded loop covers, while
// that thread is in it). Exits 0 if the fault was swallowed, dies of SIGALRM if it hangs.
void fault_outside_the_guard(void (*handler)(int), const std::string& path,
                             bool other_thread_guards, int flags = 0) {
  ::alarm(20);  // a fault jumped into the wrong thread's loop may hang: fail, do not wait
  guard_over(handler, flags);
  const volatile char* p = page_past_the_end(path);
  std::atomic<bool> inside{false};
  if (other_thread_guards) {
    std::thread([&] {
      auto wait = [&] {
        inside = true;
        for (;;) std::this_thread::yield();  // never returns: the process exits
      };
      detail::touch_mapped(const_cast<const char*>(p), 8192, wait);
    }).detach();
    while (!inside) std::this_thread::yield();
  }
  (void)p[100];
  ::_exit(0);
}

class MappedGuardDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
  TempDir dir_;
};

TEST_F(MappedGuardDeathTest, AFaultOutsideAGuardedLoopReachesThePreviousHandler) {
  EXPECT_EXIT(fault_outside_the_guard(&exit_42, dir_.file("f.bin"), false),
              ::testing::ExitedWithCode(42), "");
}

// Another thread's fault inside the range a guarded loop covers is not the loop's: it reaches the
// previous handler, while the guarded thread is still inside its loop.
TEST_F(MappedGuardDeathTest, AnotherThreadsFaultInAGuardedRangeIsNotTheGuards) {
  EXPECT_EXIT(fault_outside_the_guard(&exit_42, dir_.file("f.bin"), true),
              ::testing::ExitedWithCode(42), "");
}

void return_at_once(int) {}

#if !FSDP_EMA_TEST_ASAN
// A one-shot handler before the guard (SA_RESETHAND) that returns: as the kernel would, the
// guard resets SIGBUS to the default before calling it, so the access faults again and kills
// (passing it on without the reset looped on the fault forever).
TEST_F(MappedGuardDeathTest, AOneShotPreviousHandlerIsResetBeforeItRuns) {
  EXPECT_EXIT(fault_outside_the_guard(&return_at_once, dir_.file("f.bin"), false, SA_RESETHAND),
              ::testing::KilledBySignal(SIGBUS), "");
}

// No handler before the guard: a fault that is not the guard's takes the default action.
TEST_F(MappedGuardDeathTest, AFaultOutsideAGuardedLoopStillKillsByDefault) {
  EXPECT_EXIT(fault_outside_the_guard(SIG_DFL, dir_.file("f.bin"), false),
              ::testing::KilledBySignal(SIGBUS), "");
}
#endif

}  // namespace
}  // namespace fsdp_ema::format
