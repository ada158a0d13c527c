#include "client/credentials.h"

#include <fstream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace moe_ep::client {
namespace {

constexpr unsigned int kRefreshSeconds = 10;

absl::StatusOr<std::string> ReadFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read \"", path, "\""));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::Status CheckPem(absl::string_view flag, const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(flag, path));
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path, "\" holds no PEM block (-----BEGIN ...)"));
  }
  return absl::OkStatus();
}

}  // namespace

void AddSecurityFlags(CLI::App* cmd, ClientSecurityOptions* options) {
  cmd->add_option("--tls-ca", options->tls_ca,
                  "PEM CA bundle that signed the workers' certificates (turns on TLS)");
  cmd->add_option("--tls-cert", options->tls_cert,
                  "PEM client certificate for workers that require mutual TLS");
  cmd->add_option("--tls-key", options->tls_key, "PEM private key of --tls-cert");
  cmd->add_option("--auth-token-file", options->auth_token_file,
                  "file with the bearer token the workers expect (needs TLS)");
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeClientChannelCredentials(
    const ClientSecurityOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert and --tls-key go together: got --tls-cert \"", options.tls_cert,
                     "\" and --tls-key \"", options.tls_key, "\""));
  }
  const bool tls = !options.tls_ca.empty() || !options.tls_cert.empty();
  std::string token;
  if (!options.auth_token_file.empty()) {
    if (!tls) {
      return absl::InvalidArgumentError(
          "--auth-token-file needs TLS (--tls-ca): the token would be sent in clear");
    }
    ASSIGN_OR_RETURN(std::string text, ReadFile("--auth-token-file", options.auth_token_file));
    token = std::string(absl::StripAsciiWhitespace(text));
    if (token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth-token-file: \"", options.auth_token_file, "\" holds no token (empty file)"));
    }
  }
  if (!tls) return grpc::InsecureChannelCredentials();
  if (!options.tls_ca.empty()) RETURN_IF_ERROR(CheckPem("--tls-ca", options.tls_ca));
  if (!options.tls_cert.empty()) {
    RETURN_IF_ERROR(CheckPem("--tls-cert", options.tls_cert));
    RETURN_IF_ERROR(CheckPem("--tls-key", options.tls_key));
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.tls_key, options.tls_cert, options.tls_ca, kRefreshSeconds);
  grpc::experimental::TlsChannelCredentialsOptions tls_options;
  tls_options.set_certificate_provider(provider);
  if (!options.tls_ca.empty()) tls_options.watch_root_certs();
  if (!options.tls_cert.empty()) tls_options.watch_identity_key_cert_pairs();
  std::shared_ptr<grpc::ChannelCredentials> channel =
      grpc::experimental::TlsCredentials(tls_options);
  if (channel == nullptr) {
    return absl::InternalError("gRPC refused the TLS channel credentials options");
  }
  if (token.empty()) return channel;
  return grpc::CompositeChannelCredentials(channel, grpc::AccessTokenCredentials(token));
}

}  // namespace moe_ep::client
