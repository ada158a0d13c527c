#pragma once

// Host memory this process may use: the machine's and, inside a container
// (a Kubernetes pod), its cgroup's. One reader for the worker's default
// memory cap (server/memory_limit.h), the status memory column
// (server/device_info.h) and the client's memory preflight
// (client/memory_budget.h), so that a pod's limit is seen everywhere, not
// only /proc/meminfo. Source: issue 12 item 8, issue 13 item 2.
//
// Every function reads files only and is thread-safe.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace moe_ep::core {

// The cgroup root of this process's memory controller as mounted in a
// container (v2 unified, or v1 with memory/ below it).
inline constexpr char kDefaultCgroupRoot[] = "/sys/fs/cgroup";

// CgroupMemoryLimitBytes()
//
// The memory limit of the cgroup under `cgroup_root`: v2 "memory.max"
// ("max" = none), else v1 "memory/memory.limit_in_bytes" (values >= 2^60 =
// none). nullopt when there is no limit or the files are absent/unreadable.
std::optional<int64_t> CgroupMemoryLimitBytes(const std::string& cgroup_root);

// CgroupMemoryUsageBytes()
//
// What the cgroup uses now: v2 "memory.current", else v1
// "memory/memory.usage_in_bytes"; nullopt when neither can be read.
std::optional<int64_t> CgroupMemoryUsageBytes(const std::string& cgroup_root);

// PhysicalMemoryBytes()
//
// The machine's physical memory (sysconf pages * page size); 0 when unknown.
int64_t PhysicalMemoryBytes();

// TotalMemoryBytes()
//
// min(physical_bytes, CgroupMemoryLimitBytes(cgroup_root)); physical_bytes
// <= 0 means unknown: the cgroup limit alone, or 0 when there is none.
int64_t TotalMemoryBytes(const std::string& cgroup_root, int64_t physical_bytes);

// AvailableMemoryBytes()
//
// Bytes a new allocation may still take: MemAvailable of the meminfo file
// `meminfo_path` ("/proc/meminfo" format), lowered to the cgroup's headroom
// (limit - usage, at least 0) when the cgroup under `cgroup_root` has a
// limit. Errors: those of reading MemAvailable (kNotFound: the file cannot
// be read or has no MemAvailable line, naming the path; kInvalidArgument: a
// value that is not "<integer> kB"); a cgroup without a readable usage
// counts its whole limit as headroom.
absl::StatusOr<int64_t> AvailableMemoryBytes(const std::string& meminfo_path = "/proc/meminfo",
                                             const std::string& cgroup_root = kDefaultCgroupRoot);

// ParseMemAvailableBytes()
//
// The MemAvailable line of /proc/meminfo text ("MemAvailable:  123 kB"), in
// bytes. Errors: kNotFound when there is no such line (kernels before
// 3.14); kInvalidArgument when its value is not "<integer> kB".
absl::StatusOr<int64_t> ParseMemAvailableBytes(const std::string& meminfo);

}  // namespace moe_ep::core
