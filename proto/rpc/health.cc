#include "proto/rpc/health.h"

#include "grpcpp/server.h"

namespace moe_ep::rpc {

void EnableDefaultHealthService() { grpc::EnableDefaultHealthCheckService(true); }

void HealthReporter::Attach(grpc::HealthCheckServiceInterface* service) {
  absl::MutexLock lock(&mu_);
  if (service == nullptr) return;
  services_.push_back(service);
  if (shut_down_) {
    // Register both names first, so they answer NOT_SERVING, not NOT_FOUND.
    service->SetServingStatus(kLivenessServiceName, false);
    service->SetServingStatus(kReadinessServiceName, false);
    service->Shutdown();
    return;
  }
  ApplyLocked();
}

void HealthReporter::SetReady(bool ready) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  ready_ = ready;
  ApplyLocked();
}

void HealthReporter::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  ready_ = false;
  shut_down_ = true;
  // The default service's Shutdown() sets every name NOT_SERVING and ignores
  // later updates, so a draining server never reports SERVING again.
  for (grpc::HealthCheckServiceInterface* service : services_) service->Shutdown();
}

bool HealthReporter::ready() const {
  absl::MutexLock lock(&mu_);
  return ready_;
}

bool HealthReporter::live() const {
  absl::MutexLock lock(&mu_);
  return !shut_down_;
}

void HealthReporter::ApplyLocked() {
  for (grpc::HealthCheckServiceInterface* service : services_) {
    service->SetServingStatus(kLivenessServiceName, true);
    service->SetServingStatus(kReadinessServiceName, ready_);
  }
}

}  // namespace moe_ep::rpc
