#include "proto/rpc/auth.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace moe_ep::rpc {
namespace {

constexpr absl::string_view kBearerPrefix = "Bearer ";

// Compares without an early exit, so the time taken does not tell an
// attacker how many leading characters of a guess were right.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-token-file: cannot read \"", path, "\""));
  }
  std::stringstream text;
  text << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(text.str()));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-token-file: \"", path, "\" holds no token (empty file)"));
  }
  return token;
}

absl::StatusOr<std::shared_ptr<BearerTokenAuth>> BearerTokenAuth::Create(const std::string& path) {
  absl::StatusOr<std::string> token = ReadTokenFile(path);
  if (!token.ok()) return token.status();
  std::shared_ptr<BearerTokenAuth> auth(new BearerTokenAuth(path));
  absl::MutexLock lock(&auth->mu_);
  auth->RefreshLocked();
  if (auth->token_.empty()) auth->token_ = *token;
  return auth;
}

void BearerTokenAuth::RefreshLocked() {
  struct stat info = {};
  if (stat(path_.c_str(), &info) != 0) return;
  if (info.st_size == size_ && info.st_mtim.tv_sec == mtime_.tv_sec &&
      info.st_mtim.tv_nsec == mtime_.tv_nsec) {
    return;
  }
  absl::StatusOr<std::string> token = ReadTokenFile(path_);
  if (!token.ok()) {
    spdlog::warn("keeping the previous bearer token: {}", std::string(token.status().message()));
    return;
  }
  if (!token_.empty() && *token != token_) spdlog::info("bearer token reloaded from {}", path_);
  token_ = *token;
  mtime_ = info.st_mtim;
  size_ = info.st_size;
}

std::string BearerTokenAuth::CurrentToken() {
  absl::MutexLock lock(&mu_);
  RefreshLocked();
  return token_;
}

grpc::Status BearerTokenAuth::Process(const InputMetadata& auth_metadata,
                                      grpc::AuthContext* /*context*/,
                                      OutputMetadata* consumed_auth_metadata,
                                      OutputMetadata* /*response_metadata*/) {
  const auto it = auth_metadata.find("authorization");
  if (it == auth_metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing \"authorization: Bearer <token>\" metadata");
  }
  const absl::string_view value(it->second.data(), it->second.size());
  if (!absl::StartsWith(value, kBearerPrefix)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "authorization metadata: expected \"Bearer <token>\"");
  }
  const std::string expected = CurrentToken();
  if (!ConstantTimeEquals(value.substr(kBearerPrefix.size()), expected)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bearer token does not match");
  }
  consumed_auth_metadata->insert(
      std::make_pair(std::string(it->first.data(), it->first.size()), std::string(value)));
  return grpc::Status::OK;
}

}  // namespace moe_ep::rpc
