#include "proto/rpc/tls_credentials.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace moe_ep::rpc {
namespace {

using grpc::experimental::FileWatcherCertificateProvider;

// "host:port" -> host, without IPv6 brackets.
std::string HostPart(absl::string_view address) {
  const size_t colon = address.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  }
  return std::string(host);
}

// A PEM file must be readable and hold at least one PEM block; gRPC's file
// watcher would otherwise fail every handshake later without saying why.
absl::Status CheckPemFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read \"", path, "\""));
  std::stringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path, "\" holds no PEM block (-----BEGIN ...)"));
  }
  return absl::OkStatus();
}

bool TlsOn(const ServerSecurityOptions& options) { return !options.tls_cert.empty(); }

absl::Status Validate(const ServerSecurityOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert and --tls-key go together: got --tls-cert \"", options.tls_cert,
                     "\" and --tls-key \"", options.tls_key, "\""));
  }
  if (!TlsOn(options) && !options.tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls-client-ca (mutual TLS) needs TLS: give --tls-cert and --tls-key too");
  }
  if (options.refresh_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat("TLS refresh interval: expected >= 1 s, got ",
                                                   absl::FormatDuration(options.refresh_interval)));
  }
  if (TlsOn(options)) {
    if (absl::Status s = CheckPemFile("--tls-cert", options.tls_cert); !s.ok()) return s;
    if (absl::Status s = CheckPemFile("--tls-key", options.tls_key); !s.ok()) return s;
    if (!options.tls_client_ca.empty()) {
      if (absl::Status s = CheckPemFile("--tls-client-ca", options.tls_client_ca); !s.ok())
        return s;
    }
    if (!options.tls_peer_ca.empty()) {
      if (absl::Status s = CheckPemFile("--tls-peer-ca", options.tls_peer_ca); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (options.auth_token) {
    return absl::FailedPreconditionError(
        "--auth-token-file needs TLS (--tls-cert, --tls-key): a bearer token over plaintext "
        "could be read by anyone on the path");
  }
  const std::string host = HostPart(options.listen);
  if (!IsLoopbackHost(host) && !options.allow_insecure) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--listen ", options.listen, ": \"", host,
        "\" is not a loopback address, so plaintext is refused; give --tls-cert and --tls-key, "
        "or pass --allow-insecure to serve plaintext anyway"));
  }
  return absl::OkStatus();
}

unsigned int RefreshSeconds(const ServerSecurityOptions& options) {
  return static_cast<unsigned int>(absl::ToInt64Seconds(options.refresh_interval));
}

}  // namespace

bool IsLoopbackHost(absl::string_view host) {
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost" || host == "::1") return true;
  const std::vector<absl::string_view> octets = absl::StrSplit(host, '.');
  if (octets.size() != 4 || octets[0] != "127") return false;
  for (absl::string_view octet : octets) {
    int value = 0;
    if (!absl::SimpleAtoi(octet, &value) || value < 0 || value > 255) return false;
  }
  return true;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerSecurityOptions& options) {
  if (absl::Status s = Validate(options); !s.ok()) return s;
  if (!TlsOn(options)) return grpc::InsecureServerCredentials();
  auto provider = std::make_shared<FileWatcherCertificateProvider>(
      options.tls_key, options.tls_cert, options.tls_client_ca, RefreshSeconds(options));
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (options.tls_client_ca.empty()) {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  std::shared_ptr<grpc::ServerCredentials> credentials =
      grpc::experimental::TlsServerCredentials(tls);
  if (credentials == nullptr) {
    return absl::InternalError("gRPC refused the TLS server credentials options");
  }
  return credentials;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakePeerChannelCredentials(
    const ServerSecurityOptions& options, const std::string& bearer_token) {
  if (absl::Status s = Validate(options); !s.ok()) return s;
  if (!TlsOn(options)) {
    if (!bearer_token.empty()) {
      return absl::FailedPreconditionError("a bearer token for peers needs TLS");
    }
    return grpc::InsecureChannelCredentials();
  }
  const std::string& ca = options.tls_peer_ca.empty() ? options.tls_client_ca : options.tls_peer_ca;
  auto provider = std::make_shared<FileWatcherCertificateProvider>(
      options.tls_key, options.tls_cert, ca, RefreshSeconds(options));
  grpc::experimental::TlsChannelCredentialsOptions tls;
  tls.set_certificate_provider(provider);
  tls.watch_identity_key_cert_pairs();
  if (!ca.empty()) tls.watch_root_certs();
  std::shared_ptr<grpc::ChannelCredentials> channel = grpc::experimental::TlsCredentials(tls);
  if (channel == nullptr) {
    return absl::InternalError("gRPC refused the TLS channel credentials options");
  }
  if (bearer_token.empty()) return channel;
  return grpc::CompositeChannelCredentials(channel, grpc::AccessTokenCredentials(bearer_token));
}

}  // namespace moe_ep::rpc
