#include "core/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moe_ep::core {
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

std::optional<int64_t> PositiveInteger(const std::optional<std::string>& text) {
  int64_t bytes = 0;
  if (text.has_value() && absl::SimpleAtoi(*text, &bytes) && bytes >= 0) return bytes;
  return std::nullopt;
}

}  // namespace

std::optional<int64_t> CgroupMemoryLimitBytes(const std::string& cgroup_root) {
  if (std::optional<std::string> v2 = FirstLine(cgroup_root + "/memory.max")) {
    if (*v2 == "max") return std::nullopt;
    std::optional<int64_t> bytes = PositiveInteger(v2);
    return bytes.has_value() && *bytes > 0 ? bytes : std::nullopt;
  }
  std::optional<int64_t> v1 =
      PositiveInteger(FirstLine(cgroup_root + "/memory/memory.limit_in_bytes"));
  if (v1.has_value() && *v1 > 0 && *v1 < kV1Unlimited) return v1;
  return std::nullopt;
}

std::optional<int64_t> CgroupMemoryUsageBytes(const std::string& cgroup_root) {
  if (std::optional<int64_t> v2 = PositiveInteger(FirstLine(cgroup_root + "/memory.current"))) {
    return v2;
  }
  return PositiveInteger(FirstLine(cgroup_root + "/memory/memory.usage_in_bytes"));
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_bytes = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return 0;
  return static_cast<int64_t>(pages) * page_bytes;
}

int64_t TotalMemoryBytes(const std::string& cgroup_root, int64_t physical_bytes) {
  const std::optional<int64_t> cgroup = CgroupMemoryLimitBytes(cgroup_root);
  if (physical_bytes <= 0) return cgroup.value_or(0);
  return cgroup.has_value() ? std::min(*cgroup, physical_bytes) : physical_bytes;
}

absl::StatusOr<int64_t> ParseMemAvailableBytes(const std::string& meminfo) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemAvailable:")) continue;
    line = absl::StripAsciiWhitespace(line);
    int64_t kib = 0;
    if (!absl::ConsumeSuffix(&line, "kB") ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib) || kib < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("MemAvailable: expected \"<integer> kB\", got \"", line, "\""));
    }
    return kib * 1024;
  }
  return absl::NotFoundError("meminfo: no MemAvailable line (Linux 3.14 or later has one)");
}

absl::StatusOr<int64_t> AvailableMemoryBytes(const std::string& meminfo_path,
                                             const std::string& cgroup_root) {
  std::ifstream file(meminfo_path);
  if (!file) return absl::NotFoundError(absl::StrCat(meminfo_path, ": cannot be read"));
  std::ostringstream text;
  text << file.rdbuf();
  absl::StatusOr<int64_t> available = ParseMemAvailableBytes(text.str());
  if (!available.ok()) {
    return absl::Status(available.status().code(),
                        absl::StrCat(meminfo_path, ": ", available.status().message()));
  }
  // /proc/meminfo shows the host's memory inside a container; the pod may
  // use only its limit minus what it already uses.
  if (std::optional<int64_t> limit = CgroupMemoryLimitBytes(cgroup_root)) {
    const int64_t headroom =
        std::max<int64_t>(0, *limit - CgroupMemoryUsageBytes(cgroup_root).value_or(0));
    return std::min(*available, headroom);
  }
  return *available;
}

}  // namespace moe_ep::core
