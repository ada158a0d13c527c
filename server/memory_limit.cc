#include "server/memory_limit.h"

#include <algorithm>

#include "core/host_memory.h"

namespace moe_ep::server {

int64_t DefaultMemoryCapBytes() {
  const int64_t total =
      core::TotalMemoryBytes(core::kDefaultCgroupRoot, core::PhysicalMemoryBytes());
  return std::max<int64_t>(1, total / kDefaultCapDenominator * kDefaultCapNumerator);
}

}  // namespace moe_ep::server
