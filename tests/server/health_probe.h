#pragma once

// Test helper: calls grpc.health.v1.Health/Check through a generic stub with a
// hand-encoded HealthCheckRequest {string service = 1} and decodes the
// HealthCheckResponse {ServingStatus status = 1} (Debian's gRPC ships no C++
// message classes for the health proto).

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"

namespace moe_ep::server {

inline constexpr int kServing = 1;
inline constexpr int kNotServing = 2;

// Returns the ServingStatus (0 UNKNOWN, 1 SERVING, 2 NOT_SERVING), or -1 - code on an RPC error.
inline int ProbeHealth(const std::string& address, const std::string& service) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::TemplatedGenericStub<grpc::ByteBuffer, grpc::ByteBuffer> stub(channel);
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0a);
    request.push_back(static_cast<char>(service.size()));  // names here are < 128 bytes
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer send(&slice, 1);
  grpc::ByteBuffer recv;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status status;
  bool done = false;
  std::mutex mu;
  std::condition_variable cv;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &send, &recv,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = s;
                   done = true;
                   cv.notify_one();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return -1 - status.error_code();
  std::vector<grpc::Slice> slices;
  recv.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes.size() >= 2 && bytes[0] == 0x08) return bytes[1];
  return 0;
}

}  // namespace moe_ep::server
