#include "fsdp_ema/format/mapped_guard.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>

namespace fsdp_ema::format::detail {
namespace {

// One call of touch_mapped in progress: its thread, the range it may fault in, where to return.
struct Armed {
  pthread_t thread;
  uintptr_t begin;
  uintptr_t end;
  sigjmp_buf jump;
};

// Every call in progress, on any thread. A table rather than a thread_local: the handler reads it,
// and a thread_local of a library loaded with dlopen (torch loads libfsdp_ema.so so) may be
// allocated on its first access, which a signal handler must not do. More calls at once than
// slots (more threads verifying at once than this) run the rest unguarded, as before the guard.
constexpr size_t kSlots = 1024;
std::atomic<Armed*> g_armed[kSlots];
static_assert(std::atomic<Armed*>::is_always_lock_free);

// The SIGBUS action before ours, written once before ours is installed.
struct sigaction g_previous;

// What the process did with SIGBUS before our handler: its handler, or the default action
// (restored, so that a fault runs into it when the instruction runs again, and a sent signal is
// sent again).
void pass_on(int signo, siginfo_t* info, void* context) {
  const struct sigaction p = g_previous;
  const bool sent = info == nullptr || info->si_code <= 0;
  if (p.sa_handler != SIG_DFL && p.sa_handler != SIG_IGN) {
    // As the kernel would have run it: reset first when it is one-shot (SA_RESETHAND: a fault
    // that comes back then takes the default action, not this handler again), with its mask.
    if ((p.sa_flags & SA_RESETHAND) != 0) {
      struct sigaction reset {};
      reset.sa_handler = SIG_DFL;
      sigemptyset(&reset.sa_mask);
      sigaction(signo, &reset, nullptr);
    }
    sigset_t mask = p.sa_mask, was;
    if ((p.sa_flags & SA_NODEFER) == 0) sigaddset(&mask, signo);
    pthread_sigmask(SIG_BLOCK, &mask, &was);
    if ((p.sa_flags & SA_SIGINFO) != 0) {
      p.sa_sigaction(signo, info, context);
    } else {
      p.sa_handler(signo);
    }
    pthread_sigmask(SIG_SETMASK, &was, nullptr);
    return;
  }
  if (p.sa_handler == SIG_IGN && sent) return;  // ignored, as it was (a fault cannot be)
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(signo, &fallback, nullptr);
  if (sent) raise(signo);
}

// Async-signal-safe: atomics, pthread_self (a register read in glibc), getpid, siglongjmp, and
// pass_on's sigaction and raise.
void on_sigbus(int signo, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  const pthread_t self = pthread_self();
  const bool fault = info != nullptr && info->si_code > 0;  // from the kernel: si_addr is set
  const bool resent = info != nullptr && (info->si_code == SI_TKILL || info->si_code == SI_USER) &&
                      info->si_pid == getpid();
  const uintptr_t at = fault ? reinterpret_cast<uintptr_t>(info->si_addr) : 0;
  for (std::atomic<Armed*>& slot : g_armed) {
    Armed* a = slot.load(std::memory_order_acquire);
    if (a == nullptr || pthread_equal(a->thread, self) == 0) continue;
    if ((fault && at >= a->begin && at < a->end) || resent) {
      errno = saved_errno;
      siglongjmp(a->jump, 1);
    }
  }
  errno = saved_errno;
  pass_on(signo, info, context);
}

// A forked child has only the thread that forked, which was not inside touch_mapped.
void forget_all_in_child() {
  for (std::atomic<Armed*>& slot : g_armed) slot.store(nullptr, std::memory_order_relaxed);
}

bool is_ours(const struct sigaction& a) {
  return (a.sa_flags & SA_SIGINFO) != 0 && a.sa_sigaction == &on_sigbus;
}

// Ours in place of the default action: at the first call, and again wherever SIGBUS went back to
// SIG_DFL since (a one-shot handler we passed a fault on, Python's faulthandler.disable()
// restoring the default it found before us). A handler installed over ours is left alone: it
// may pass faults on to ours (faulthandler re-raises them), and stacking ours over it again
// would loop.
void install() {
  static std::mutex mu;
  const std::lock_guard lock(mu);
  static bool first = true;
  struct sigaction now {};
  sigaction(SIGBUS, nullptr, &now);
  if (is_ours(now) || (!first && now.sa_handler != SIG_DFL)) return;
  g_previous = now;
  struct sigaction ours {};
  ours.sa_sigaction = &on_sigbus;
  // SA_NODEFER: SIGBUS stays unblocked in the handler, so the jump back (sigsetjmp without the
  // mask, no system call per guarded loop) leaves the thread's mask as it was.
  ours.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&ours.sa_mask);
  sigaction(SIGBUS, &ours, nullptr);
  if (first) pthread_atfork(nullptr, nullptr, &forget_all_in_child);
  first = false;
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] { install(); });
}

std::atomic<Armed*>* claim(Armed* armed) {
  // Threads start apart (pthread_t is an address: its low bits are alike, so mix them first).
  const size_t start =
      static_cast<size_t>((static_cast<uint64_t>(armed->thread) * 0x9E3779B97F4A7C15u) >> 32) %
      kSlots;
  for (size_t i = 0; i < kSlots; ++i) {
    std::atomic<Armed*>& slot = g_armed[(start + i) % kSlots];
    Armed* empty = nullptr;
    if (slot.load(std::memory_order_relaxed) == nullptr &&
        slot.compare_exchange_strong(empty, armed, std::memory_order_acq_rel)) {
      return &slot;
    }
  }
  return nullptr;
}

}  // namespace

void ensure_guard() { install(); }

bool touch_mapped(const void* begin, size_t length, void (*touch)(void*), void* context) noexcept {
  install_once();
  Armed armed;
  armed.thread = pthread_self();
  armed.begin = reinterpret_cast<uintptr_t>(begin);
  armed.end = armed.begin + length;
  std::atomic<Armed*>* const slot = claim(&armed);
  if (slot == nullptr) {
    touch(context);
    return true;
  }
  // Nothing set below is read after the jump back: only `slot`, set before.
  if (sigsetjmp(armed.jump, 0) != 0) {
    slot->store(nullptr, std::memory_order_release);
    return false;
  }
  touch(context);
  slot->store(nullptr, std::memory_order_release);
  return true;
}

}  // namespace fsdp_ema::format::detail
