#include "core/expert_load_file.h"

#include <cmath>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace moe_ep::core {

absl::StatusOr<std::vector<std::vector<double>>> ReadExpertLoadFile(const std::string& path) {
  using json = nlohmann::json;
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("load file ", path, ": cannot open"));
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("load file ", path, ": not JSON: ", e.what()));
  }
  if (!doc.is_object() || !doc.contains("logical_count") || !doc["logical_count"].is_array() ||
      doc["logical_count"].empty()) {
    return absl::DataLossError(absl::StrCat(
        "load file ", path, ": expected {\"logical_count\": [[counts per expert] per layer]}"));
  }
  const json& rows = doc["logical_count"];
  std::vector<std::vector<double>> out;
  out.reserve(rows.size());
  size_t n = 0;
  for (size_t l = 0; l < rows.size(); ++l) {
    const json& row = rows[l];
    if (!row.is_array() || row.empty() || (n != 0 && row.size() != n)) {
      return absl::DataLossError(absl::StrFormat(
          "load file %s: logical_count[%d]: expected an array of %d counts", path, l, n));
    }
    n = row.size();
    std::vector<double> counts(n);
    for (size_t e = 0; e < n; ++e) {
      if (!row[e].is_number() || !std::isfinite(row[e].get<double>()) || row[e].get<double>() < 0) {
        return absl::DataLossError(absl::StrFormat(
            "load file %s: logical_count[%d][%d]: expected a count >= 0", path, l, e));
      }
      counts[e] = row[e].get<double>();
    }
    out.push_back(std::move(counts));
  }
  return out;
}

}  // namespace moe_ep::core
