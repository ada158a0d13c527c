#pragma once

// Channel credentials of the coordinator (`moe-ep --tls-ca ... --tls-cert ...
// --tls-key ... --auth-token-file ...`) for workers that serve TLS, mutual
// TLS and/or a bearer token (proto/rpc/tls_credentials.h, proto/rpc/auth.h).
//
//   - no flag: plaintext (the workers must allow it: loopback, or
//     --allow-insecure);
//   - --tls-ca: TLS, the workers' certificates checked against that CA bundle
//     (and their names against the target host); without it but with
//     --tls-cert, against the system roots;
//   - --tls-cert + --tls-key: the client certificate for mutual TLS;
//   - --auth-token-file: "authorization: Bearer <token>" on every call; needs
//     TLS (a token in clear could be read on the path).
// The TLS files are re-read every 10 s (long-running `moe-ep watch`/`up`).
//
// Thread-safe (pure). Source: issue 5.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"

namespace CLI {
class App;
}

namespace moe_ep::client {

struct ClientSecurityOptions {
  std::string tls_ca;           // PEM CA bundle that signed the workers' certificates
  std::string tls_cert;         // PEM client certificate (mutual TLS)
  std::string tls_key;          // PEM key of tls_cert
  std::string auth_token_file;  // file holding the bearer token
};

// Adds --tls-ca, --tls-cert, --tls-key and --auth-token-file to `cmd`.
void AddSecurityFlags(CLI::App* cmd, ClientSecurityOptions* options);

// Errors: kInvalidArgument for only one of tls_cert / tls_key, a file that
// cannot be read, holds no PEM block or no token (names the flag and path), or
// a token without TLS.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeClientChannelCredentials(
    const ClientSecurityOptions& options);

}  // namespace moe_ep::client
