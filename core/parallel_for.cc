#include "core/parallel_for.h"

#include <algorithm>
#include <exception>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace moe_ep::core {

int DefaultParallelism() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

int ParallelFor(int64_t num_items, int64_t min_items_per_thread,
                const std::function<void(int64_t begin, int64_t end)>& fn, int max_threads) {
  if (num_items <= 0) return 0;
  const int64_t limit = max_threads > 0 ? max_threads : DefaultParallelism();
  const int64_t by_size = num_items / std::max<int64_t>(1, min_items_per_thread);
  const int64_t ranges = std::clamp<int64_t>(std::min(limit, by_size), 1, num_items);
  // Range r is [r * q + min(r, rem), ...): the first `rem` ranges get one more.
  const int64_t q = num_items / ranges;
  const int64_t rem = num_items % ranges;
  const auto begin_of = [&](int64_t r) { return r * q + std::min(r, rem); };
  // An exception of `fn` (std::bad_alloc of a request-sized buffer, say)
  // is caught on its thread, every thread is joined, and the first one is
  // rethrown on the caller's: it never terminates the process (issue 13).
  std::vector<std::exception_ptr> errors(ranges);
  const auto run = [&fn, &errors](int64_t r, int64_t b, int64_t e) {
    try {
      fn(b, e);
    } catch (...) {
      errors[r] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  std::vector<std::pair<int64_t, int64_t>> inline_ranges;
  threads.reserve(ranges - 1);
  for (int64_t r = 1; r < ranges; ++r) {
    const int64_t b = begin_of(r), e = begin_of(r + 1);
    try {
      threads.emplace_back(run, r, b, e);
    } catch (const std::system_error&) {
      inline_ranges.emplace_back(r, b);
    }
  }
  run(0, 0, begin_of(1));
  for (const auto& [r, b] : inline_ranges) run(r, b, begin_of(r + 1));
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  return static_cast<int>(ranges);
}

}  // namespace moe_ep::core
