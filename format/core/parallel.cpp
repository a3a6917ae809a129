#include "fsdp_ema/format/parallel.h"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>

namespace fsdp_ema::format::detail {

std::vector<std::exception_ptr> run_jobs(size_t n, const std::function<void(size_t)>& job,
                                         size_t threads) {
  std::vector<std::exception_ptr> errors(n);
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, n);
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < n; i = next++) {
      try {
        job(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads > 0 ? threads - 1 : 0);
  try {
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  } catch (const std::system_error&) {
    // No more threads to be had: the ones started and this one do all the jobs.
  }
  worker();
  for (std::thread& t : pool) t.join();
  return errors;
}

void rethrow_first(const std::vector<std::exception_ptr>& errors) {
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace fsdp_ema::format::detail
