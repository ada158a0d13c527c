#include "core/command_line.h"

#include <cmath>
#include <string>
#include <string_view>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#ifndef MOE_EP_VERSION
#error "MOE_EP_VERSION must be defined by the build (core/CMakeLists.txt)"
#endif

namespace moe_ep::core {

std::string_view Version() { return MOE_EP_VERSION; }

std::string CheckAtLeast(std::string_view text, double min, bool strict) {
  const std::string given(text);  // Debian's absl::string_view is not std::string_view
  double value = 0;
  const bool parsed = absl::SimpleAtod(given, &value) && !std::isnan(value);
  if (parsed && (strict ? value > min : value >= min)) return "";
  const std::string bound =
      min == std::floor(min) ? absl::StrCat(static_cast<long long>(min)) : absl::StrCat(min);
  return absl::StrCat("expected a number ", strict ? "> " : ">= ", bound, ", got ", given);
}

std::string UnderscoreSpelling(std::string_view kebab_name) {
  std::string name(kebab_name);
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

}  // namespace moe_ep::core
