#include "core/fingerprint.h"

#include <cstdio>

namespace moe_ep::core {

uint64_t Fingerprint64(absl::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

std::string Hex64(uint64_t value) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(value));
  return std::string(hex);
}

}  // namespace moe_ep::core
