// Work split over OpenMP threads in a way a busy host cannot stall for long.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>

namespace kvexport::runtime {

// Runs body(i) for every i in [0, total) on the calling thread plus up to threads - 1 OpenMP
// threads (on the calling thread alone when threads <= 1, or when the file is built without
// OpenMP). Items are claimed one by one from a shared counter rather than split in fixed shares,
// so a thread that the OS does not schedule delays the call by at most the item it holds, and
// unequal items balance. They are claimed from the end: callers put their costliest items last.
// An exception thrown by body stops the claiming and is rethrown on the calling thread.
template <typename F>
void for_each_item(int64_t total, int64_t threads, const F& body) {
  if (threads > total) threads = total;
  if (threads <= 1) {
    for (int64_t i = total - 1; i >= 0; --i) body(i);
    return;
  }
  std::atomic<int64_t> next{total};
  std::exception_ptr error;  // an exception must not leave the parallel region
  std::mutex error_mutex;
#pragma omp parallel num_threads(static_cast <int>(threads))
  {
    try {
      for (int64_t i; (i = next.fetch_sub(1, std::memory_order_relaxed) - 1) >= 0;) body(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next.store(0, std::memory_order_relaxed);
    }
  }
  if (error) std::rethrow_exception(error);
}

// Requests with at least this many prefix tokens check and compare them on several threads (one
// user an item): below it, waking helper threads costs more than the pass over the tokens, which
// takes tens of microseconds on one core.
constexpr int64_t kParallelTokens = int64_t{1} << 15;

}  // namespace kvexport::runtime
