#include "client/model_source.h"

#include <filesystem>

#include "absl/strings/match.h"

namespace moe_ep::client {

absl::StatusOr<core::ModelDescription> ResolveModel(const std::string& model) {
  std::error_code ec;
  if (std::filesystem::exists(model, ec) || absl::StrContains(model, '/') ||
      absl::EndsWith(model, ".json")) {
    return core::LoadModelConfig(model);
  }
  return core::BuiltinModel(model);
}

}  // namespace moe_ep::client
