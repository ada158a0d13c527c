#pragma once

// The `--model` argument: a Hugging Face config.json path or a built-in preset
// name (core::BuiltinModelNames()).

#include <string>

#include "absl/status/statusor.h"
#include "core/model_config.h"

namespace moe_ep::client {

// A path that exists (or that looks like one: contains '/' or ends in
// ".json") is loaded with core::LoadModelConfig; anything else is a preset.
// Errors: those of LoadModelConfig; kNotFound for an unknown preset, listing
// the presets.
absl::StatusOr<core::ModelDescription> ResolveModel(const std::string& model);

}  // namespace moe_ep::client
