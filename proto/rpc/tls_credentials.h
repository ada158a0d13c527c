#pragma once

// Transport security of the worker's control plane (issue 5, "Remote control
// and security"): the server credentials main.cc listens with, and the
// channel credentials a worker uses to reach its peers' Rendezvous service
// (GrpcStore, server/grpc_store.h).
//
// Policy:
//   - TLS when --tls-cert and --tls-key are given; mutual TLS (the client must
//     present a certificate signed by the CA) when --tls-client-ca is given too.
//     The files are watched (grpc::experimental::FileWatcherCertificateProvider)
//     and re-read every `refresh_interval`, so a rotated Kubernetes secret is
//     picked up without a restart (new connections use the new files).
//   - Plaintext otherwise, but only where it cannot leak: on a loopback listen
//     address (127.0.0.0/8, localhost, [::1]) it is allowed by default, so the
//     embedded local cluster and the tests keep working; on any other address
//     (0.0.0.0, a pod IP, a DNS name) it is refused unless --allow-insecure.
//   - A bearer token (proto/rpc/auth.h) needs TLS: it would travel in clear
//     otherwise.
//
// Thread-safe (pure functions). Source: issue 5; gRPC 1.51
// grpcpp/security/tls_credentials_options.h.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace moe_ep::rpc {

struct ServerSecurityOptions {
  std::string listen;           // host:port the server binds (for the loopback rule)
  std::string tls_cert;         // PEM certificate chain of this worker
  std::string tls_key;          // PEM private key of tls_cert
  std::string tls_client_ca;    // PEM CA bundle; when set, clients must present a cert it signed
  std::string tls_peer_ca;      // PEM CA bundle that signed the peers' server certificates;
                                // empty = tls_client_ca
  bool allow_insecure = false;  // plaintext on a non-loopback address
  bool auth_token = false;      // a bearer token is configured (needs TLS)
  absl::Duration refresh_interval = absl::Seconds(10);
};

// True for "localhost", "127.x.y.z" and "::1" / "[::1]" (the host part of a
// listen address, without the port).
bool IsLoopbackHost(absl::string_view host);

// The credentials the server listens with.
// Errors:
//   kInvalidArgument    only one of tls_cert / tls_key; tls_client_ca without
//                       TLS; a file that cannot be read or is empty (names the
//                       flag and path); refresh_interval < 1 s.
//   kFailedPrecondition plaintext on a non-loopback address without
//                       allow_insecure; auth_token without TLS.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerSecurityOptions& options);

// The channel credentials a worker uses to call its peers: insecure for a
// plaintext server; with TLS, server verification against tls_peer_ca (or
// tls_client_ca) and this worker's own cert/key as client certificate (for
// peers that require mTLS); a bearer token (already read, may be empty) is
// attached to every call. Without tls_peer_ca and tls_client_ca the peers'
// certificates are checked against the system's root store.
// Errors: kInvalidArgument as MakeServerCredentials for the files;
// kFailedPrecondition for a token over plaintext.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakePeerChannelCredentials(
    const ServerSecurityOptions& options, const std::string& bearer_token);

}  // namespace moe_ep::rpc
