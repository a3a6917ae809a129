#pragma once

// Independent jobs of one header, index or directory run on the machine's cores. Headers of
// 100,000+ tensors hold several large documents (three metadata strings, the index, one header
// per rank) whose parses do not depend on each other.

#include <cstddef>
#include <exception>
#include <functional>
#include <vector>

namespace fsdp_ema::format::detail {

// Runs job(0) .. job(n - 1) on up to `threads` threads (the caller's among them; 0 means the
// machine's core count) and returns what each job threw (null where it succeeded), so that a
// caller reports errors in the order a sequential run would have. Nothing is started when
// n <= 1 or threads == 1.
std::vector<std::exception_ptr> run_jobs(size_t n, const std::function<void(size_t)>& job,
                                         size_t threads = 0);

// Rethrows the first error of run_jobs' result, if any.
void rethrow_first(const std::vector<std::exception_ptr>& errors);

// Below this many bytes of text a parse runs on the caller's thread: starting threads costs more.
inline constexpr size_t kParallelParseBytes = 1 << 20;

}  // namespace fsdp_ema::format::detail
