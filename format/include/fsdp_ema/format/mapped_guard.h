// Internal: reading the bytes of a file mapping (ShardFile::map) in our own loops without dying of
// the file shrinking under it.
//
// A page of a mapping that lies past the end of its file (the file was truncated after the
// mapping was made, by another process or this one) or that the kernel cannot read (an I/O error)
// raises SIGBUS on the thread that touches it, and SIGBUS kills the process. The loops of a
// zero-copy load that verify its views through the mapping read it only through touch_mapped,
// which turns such a SIGBUS into a return value the caller raises as an error naming the file.
// The views a load hands out are the caller's: touching one after its file shrank is a SIGBUS
// in the caller's code, which this does not catch (docs/FORMAT.md §4.2).
//
// How: one process-wide SIGBUS handler, installed at the first call (and by ensure_guard, at
// every mapping, again wherever SIGBUS went back to the default action since). A call
// publishes (this thread, its byte range, a sigjmp_buf) in a lock-free table; the handler jumps
// back into the call when the fault is this thread's, at an address of that range (a SIGBUS the
// process sent itself on such a thread is taken as the fault a handler installed later re-raised,
// as Python's faulthandler does). Every other SIGBUS goes to the handler that was there before
// (Python's faulthandler, a sanitizer's, torch's), or takes the default action. SIGSEGV is never
// touched: a mapping raises it only for memory that is not mapped, a bug that must still crash.
#pragma once

#include <cstddef>

namespace fsdp_ema::format::detail {

// Installs the handler, or installs it again where SIGBUS went back to SIG_DFL since (a
// one-shot handler ours passed a fault to, faulthandler.disable()). ShardFile::map calls it.
void ensure_guard();

// Calls touch(context), which may read any byte of [begin, begin + length). Returns true when it
// ran to its end, false when a SIGBUS this thread took at an address of that range stopped it.
// touch is abandoned where it faulted (its frames are jumped over), so it must be plain code:
// no object with a destructor, no lock, no allocation, no exception; compute into the context
// and judge after the call. Thread-safe; any number of threads at once.
bool touch_mapped(const void* begin, size_t length, void (*touch)(void*), void* context) noexcept;

// The same with a callable (called once, by reference).
template <typename F>
bool touch_mapped(const void* begin, size_t length, F& touch) noexcept {
  return touch_mapped(
      begin, length, [](void* f) { (*static_cast<F*>(f))(); },
      const_cast<void*>(static_cast<const void*>(&touch)));
}

}  // namespace fsdp_ema::format::detail
