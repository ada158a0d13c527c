#include "server/health.h"

#include "grpcpp/server.h"

namespace moe_ep::server {

void EnableDefaultHealthService() { grpc::EnableDefaultHealthCheckService(true); }

void HealthReporter::Attach(grpc::HealthCheckServiceInterface* service) {
  absl::MutexLock lock(&mu_);
  service_ = service;
  ApplyLocked();
}

void HealthReporter::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  serving_ = serving;
  ApplyLocked();
}

void HealthReporter::Shutdown() {
  absl::MutexLock lock(&mu_);
  serving_ = false;
  ApplyLocked();
  shut_down_ = true;
  // The default service's Shutdown() sets every name NOT_SERVING and ignores
  // later updates, so a draining server never reports SERVING again.
  if (service_ != nullptr) service_->Shutdown();
}

bool HealthReporter::serving() const {
  absl::MutexLock lock(&mu_);
  return serving_;
}

void HealthReporter::ApplyLocked() {
  if (service_ == nullptr || shut_down_) return;
  service_->SetServingStatus("", serving_);
  service_->SetServingStatus(kWorkerServiceName, serving_);
}

}  // namespace moe_ep::server
