#include "server/memory_limit.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"

namespace moe_ep::server {
namespace {

// v1 reports "no limit" as a huge page-rounded number (~2^63).
constexpr int64_t kV1Unlimited = int64_t{1} << 60;

// The first line of `path`, trimmed; nullopt when it cannot be read.
std::optional<std::string> FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return std::string(absl::StripAsciiWhitespace(line));
}

// The cgroup's memory limit in bytes, or nullopt for none / unknown.
std::optional<int64_t> CgroupLimit(const std::string& root) {
  if (std::optional<std::string> v2 = FirstLine(root + "/memory.max")) {
    int64_t bytes = 0;
    if (*v2 != "max" && absl::SimpleAtoi(*v2, &bytes) && bytes > 0) return bytes;
    return std::nullopt;
  }
  if (std::optional<std::string> v1 = FirstLine(root + "/memory/memory.limit_in_bytes")) {
    int64_t bytes = 0;
    if (absl::SimpleAtoi(*v1, &bytes) && bytes > 0 && bytes < kV1Unlimited) return bytes;
  }
  return std::nullopt;
}

}  // namespace

int64_t AvailableMemoryBytes(const std::string& cgroup_root, int64_t physical_bytes) {
  const std::optional<int64_t> cgroup = CgroupLimit(cgroup_root);
  if (physical_bytes <= 0) return cgroup.value_or(0);
  return cgroup.has_value() ? std::min(*cgroup, physical_bytes) : physical_bytes;
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_bytes = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return 0;
  return static_cast<int64_t>(pages) * page_bytes;
}

int64_t DefaultMemoryCapBytes() {
  const int64_t available = AvailableMemoryBytes("/sys/fs/cgroup", PhysicalMemoryBytes());
  return std::max<int64_t>(1, available / kDefaultCapDenominator * kDefaultCapNumerator);
}

}  // namespace moe_ep::server
