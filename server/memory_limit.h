#pragma once

// The default memory cap of a worker started without --memory-cap-bytes
// (issue 13 item 2): a share of the memory this process may use, the
// smaller of the machine's physical memory and its cgroup's limit (cgroup v2
// memory.max, or v1 memory.limit_in_bytes), so that a request the worker
// cannot hold is refused with RESOURCE_EXHAUSTED instead of failing an
// allocation (or meeting the OOM killer). Source: DESIGN §10; issue 13.

#include <cstdint>
#include <string>

namespace moe_ep::server {

// The share of the available memory the default cap allows: 3/4 (the rest
// for the process itself, gRPC buffers and the Rendezvous store).
inline constexpr int64_t kDefaultCapNumerator = 3;
inline constexpr int64_t kDefaultCapDenominator = 4;

// DefaultMemoryCapBytes()
//
// 3/4 of core::TotalMemoryBytes (the smaller of physical memory and the
// cgroup's limit, core/host_memory.h), at least 1 byte (a cap of 0 would
// mean unlimited). Reads files only; thread-safe.
int64_t DefaultMemoryCapBytes();

}  // namespace moe_ep::server
