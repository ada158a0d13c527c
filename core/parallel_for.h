#pragma once

// Splitting a large, evenly divisible host loop over the machine's cores:
// seeded weight generation and bf16 -> fp32 widening of expert weights
// (core/experts.cc), which would otherwise run on one core while the BLAS
// GEMMs around them use all of them.

#include <cstdint>
#include <functional>

namespace moe_ep::core {

// ParallelFor()
//
// Calls fn(begin, end) on disjoint contiguous ranges that cover
// [0, num_items) exactly once, on up to `max_threads` threads (0: the
// machine's hardware concurrency), with at least `min_items_per_thread`
// items per range (so small loops run inline on the calling thread), and
// returns when every call has returned. The calling thread runs the first
// range. A thread that cannot be started (std::system_error) has its range
// run on the calling thread instead, so the loop always completes.
//
// `fn` must be safe to call concurrently on disjoint ranges. If it throws
// (e.g. std::bad_alloc), every range still runs to its end or its throw,
// all threads are joined, and the first range's exception (in range order)
// is rethrown to the caller (issue 13: never std::terminate). Returns the number of ranges
// (threads) used, >= 1 when num_items > 0, 0 when num_items <= 0 (fn not called). Example:
// num_items 10, min 3, 8 cores -> 3 ranges [0, 4) [4, 7) [7, 10).
int ParallelFor(int64_t num_items, int64_t min_items_per_thread,
                const std::function<void(int64_t begin, int64_t end)>& fn, int max_threads = 0);

// Threads ParallelFor uses for max_threads = 0: std::thread's
// hardware_concurrency, or 1 when unknown.
int DefaultParallelism();

}  // namespace moe_ep::core
