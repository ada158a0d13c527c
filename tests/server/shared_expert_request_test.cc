#include "server/shared_expert_request.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

// The shared expert is read from the canonical path the policy resolved
// (server/path_policy.h), never from the request's own path: here the
// request names a path that does not exist and the load still succeeds from
// the canonical one, with the file's bits.
TEST(MakeSharedExpert, ReadsTheCanonicalPathNotTheRequestsPath) {
  constexpr int64_t kH = 8;
  constexpr int64_t kI = 4;
  auto src = core::SharedExpert::Generate(3, 2, kH, kI, false);
  ASSERT_TRUE(src.ok());
  const core::SwiGluWeights& w = src->experts().swiglu_weights(0);
  std::vector<core::SafetensorsTensor> tensors;
  const std::pair<const char*, const std::vector<uint16_t>*> parts[3] = {
      {"gate_proj", &w.gate}, {"up_proj", &w.up}, {"down_proj", &w.down}};
  for (const auto& [proj, values] : parts) {
    core::SafetensorsTensor t;
    t.name = std::string("model.layers.2.mlp.shared_experts.") + proj + ".weight";
    t.dtype = core::SafetensorsDType::kBF16;
    t.shape = std::string(proj) == "down_proj" ? std::vector<int64_t>{kH, kI}
                                               : std::vector<int64_t>{kI, kH};
    t.data.resize(values->size() * 2);
    std::memcpy(t.data.data(), values->data(), t.data.size());
    tensors.push_back(std::move(t));
  }
  const std::string canonical =
      (std::filesystem::path(::testing::TempDir()) / "shared_expert_request.safetensors").string();
  ASSERT_TRUE(core::WriteSafetensors(canonical, tensors).ok());

  v1::LoadExpertsRequest request;
  request.set_layer(2);
  request.set_kind(v1::EXPERT_KIND_SWIGLU);
  request.set_safetensors_path("/nonexistent/moe_ep/swapped-link.safetensors");
  request.mutable_shared_expert()->set_intermediate_size(kI);
  request.mutable_shared_expert()->set_name_pattern(
      "model.layers.{layer}.mlp.shared_experts.{proj}.weight");
  auto shared = MakeSharedExpert(request, canonical, kH, 0, 0);
  ASSERT_TRUE(shared.ok()) << shared.status();
  ASSERT_TRUE(shared->has_value());
  EXPECT_EQ((*shared)->experts().swiglu_weights(0).gate, w.gate);
  EXPECT_EQ((*shared)->experts().swiglu_weights(0).down, w.down);

  // A canonical path that is missing is what the error names.
  auto missing = MakeSharedExpert(request, canonical + ".gone", kH, 0, 0);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(canonical + ".gone"));
  std::filesystem::remove(canonical);
}

TEST(MakeSharedExpert, NoSharedExpertIsNullopt) {
  v1::LoadExpertsRequest request;
  request.set_kind(v1::EXPERT_KIND_SWIGLU);
  auto shared = MakeSharedExpert(request, "", 8, 0, 0);
  ASSERT_TRUE(shared.ok());
  EXPECT_FALSE(shared->has_value());
}

}  // namespace
}  // namespace moe_ep::server
