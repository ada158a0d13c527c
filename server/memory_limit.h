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

// AvailableMemoryBytes()
//
// min(physical_bytes, the cgroup limit read under `cgroup_root`) where the
// root holds "memory.max" (v2; "max" = no limit) or
// "memory/memory.limit_in_bytes" (v1; values >= 2^60 = no limit); files
// that are absent or unreadable are skipped. physical_bytes <= 0 means
// "unknown": the cgroup limit alone, or 0 when there is none either.
// Reads files only; thread-safe.
int64_t AvailableMemoryBytes(const std::string& cgroup_root, int64_t physical_bytes);

// PhysicalMemoryBytes()
//
// The machine's physical memory (sysconf pages * page size); 0 when unknown.
int64_t PhysicalMemoryBytes();

// DefaultMemoryCapBytes()
//
// 3/4 of AvailableMemoryBytes("/sys/fs/cgroup", PhysicalMemoryBytes()),
// at least 1 byte (a cap of 0 would mean unlimited).
int64_t DefaultMemoryCapBytes();

}  // namespace moe_ep::server
