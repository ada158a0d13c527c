#include "client/group_keeper.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/desired_state.h"
#include "client/grpc_status.h"
#include "core/status_macros.h"
#include "grpcpp/client_context.h"
#include "spdlog/spdlog.h"

namespace moe_ep::client {
namespace {

constexpr size_t kHistorySize = 256;
// How often the targets are resolved again while some rank does not answer
// (a replaced pod may have come back under a new address).
constexpr absl::Duration kResolveInterval = absl::Seconds(1);
// How long the first formation waits for every health Watch to open before
// it gives up adopting a running group.
constexpr absl::Duration kAdoptionWait = absl::Seconds(2);
// How soon a resolution that failed is tried again.
constexpr absl::Duration kResolveRetry = absl::Milliseconds(200);

int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

bool Lost(v1::RankState s) {
  return s == v1::RANK_STATE_UNREACHABLE || s == v1::RANK_STATE_UNRESPONSIVE;
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

GroupKeeper::GroupKeeper(GroupKeeperOptions options)
    : options_(std::move(options)), backoff_(options_.backoff_initial) {}

absl::StatusOr<std::unique_ptr<GroupKeeper>> GroupKeeper::Start(
    GroupKeeperOptions options, std::optional<v1::DesiredState> initial) {
  for (const auto& [name, value] : {std::pair{"probe_interval", options.probe_interval},
                                    std::pair{"probe_timeout", options.probe_timeout},
                                    std::pair{"backoff_initial", options.backoff_initial},
                                    std::pair{"settle_timeout", options.settle_timeout}}) {
    if (value <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected > 0, got ", absl::FormatDuration(value)));
    }
  }
  if (options.probe_failure_threshold < 1) {
    return absl::InvalidArgumentError(absl::StrCat("probe_failure_threshold: expected >= 1, got ",
                                                   options.probe_failure_threshold));
  }
  if (options.backoff_max < options.backoff_initial) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backoff_max: expected >= backoff_initial (", absl::FormatDuration(options.backoff_initial),
        "), got ", absl::FormatDuration(options.backoff_max)));
  }
  if (initial.has_value()) RETURN_IF_ERROR(ValidateDesiredState(*initial));
  if (options.rank_loss == v1::RANK_LOSS_POLICY_UNSPECIFIED) {
    options.rank_loss = v1::RANK_LOSS_MASK_COVERED;
  }
  if (!v1::RankLossPolicy_IsValid(options.rank_loss)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank_loss: expected a RankLossPolicy, got ", options.rank_loss));
  }
  if (options.resolver == nullptr) options.resolver = std::make_shared<DefaultTargetResolver>();
  // A restarted worker must be reached again quickly, not after gRPC's
  // reconnect back-off of up to 120 s.
  if (options.channel.max_reconnect_backoff <= absl::ZeroDuration()) {
    options.channel.max_reconnect_backoff = options.probe_interval;
  }
  std::unique_ptr<GroupKeeper> keeper(new GroupKeeper(std::move(options)));
  if (initial.has_value()) {
    std::lock_guard<std::mutex> lock(keeper->mu_);
    keeper->desired_ = *initial;
    keeper->has_desired_ = true;
    keeper->desired_version_ = 1;
    keeper->RecordLocked("applied", -1, "initial desired state");
  }
  keeper->loop_ = std::thread(&GroupKeeper::Loop, keeper.get());
  return keeper;
}

GroupKeeper::~GroupKeeper() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  loop_.join();
  std::vector<std::unique_ptr<RankWatcher>> watchers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watchers.swap(watchers_);
  }
  watchers.clear();  // joins their threads, which may call OnRankChange (takes mu_)
  // Given back (issue 31 item 2): another client need not wait out the TTL;
  // a coordinator that restarts takes it again (and adopts the group).
  std::unique_ptr<LeaseRenewer> lease;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lease.swap(lease_);
  }
  lease.reset();  // stops renewing, then releases on every rank
}

absl::StatusOr<v1::ApplyResponse> GroupKeeper::Apply(const v1::DesiredState& desired) {
  RETURN_IF_ERROR(ValidateDesiredState(desired));
  v1::ApplyResponse response;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool same = has_desired_ && SameDesiredState(desired_, desired) && !drained_;
    if (!same) {
      desired_ = desired;
      has_desired_ = true;
      ++desired_version_;
      drained_ = false;
      next_attempt_ = absl::InfinitePast();
      backoff_ = options_.backoff_initial;
      RecordLocked("applied", -1, absl::StrCat("desired state version ", desired_version_));
      SetReadyLocked(false, absl::Now());
      lost_at_ = absl::InfinitePast();  // a new state is not a loss to recover from
      wake_ = true;
    }
    response.set_desired_version(desired_version_);
    response.set_changed(!same);
  }
  cv_.notify_all();
  return response;
}

v1::DrainResponse GroupKeeper::Drain() {
  std::lock_guard<std::mutex> formation(formation_mu_);
  std::vector<std::string> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drained_ = true;
    formed_version_ = -1;
    settled_ = false;
    degraded_ = false;
    masks_ = false;
    masked_.clear();
    SetReadyLocked(false, absl::Now());
    targets = targets_;
  }
  v1::DrainResponse response;
  std::vector<std::string> errors(targets.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < targets.size(); ++r) {
    threads.emplace_back([&, r] {
      auto stub = v1::Worker::NewStub(MakeWorkerChannel(targets[r], options_.channel));
      const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(10);
      grpc::ClientContext status_context;
      status_context.set_deadline(deadline);
      v1::GetStatusResponse status;
      absl::Status s =
          ToAbslStatus(stub->GetStatus(&status_context, v1::GetStatusRequest(), &status));
      if (s.ok() && status.state() != v1::WORKER_STATE_STARTED &&
          status.state() != v1::WORKER_STATE_UNSPECIFIED) {
        grpc::ClientContext leave_context;
        leave_context.set_deadline(deadline);
        v1::LeaveRequest leave;
        leave.set_generation(status.generation());
        if (!options_.channel.owner_id.empty()) {  // the keeper's lease
          leave.mutable_lease()->set_owner_id(options_.channel.owner_id);
          leave.mutable_lease()->set_ttl_ms(absl::ToInt64Milliseconds(options_.channel.lease_ttl));
        }
        v1::LeaveResponse left;
        s = ToAbslStatus(stub->Leave(&leave_context, leave, &left));
      }
      if (!s.ok()) errors[r] = absl::StrCat("rank ", r, " (", targets[r], "): ", s.ToString());
      spdlog::debug("drain: rank {} ({}): {}", r, targets[r],
                    !s.ok() ? s.ToString()
                    : status.state() == v1::WORKER_STATE_STARTED
                        ? std::string("in no group")
                        : absl::StrCat("left generation ", status.generation(), " (was ",
                                       v1::WorkerState_Name(status.state()), ")"));
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    if (!e.empty()) response.add_unreachable(e);
  }
  // No renewal and no lease until the next Apply (issue 31 item 2).
  std::unique_ptr<LeaseRenewer> lease;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lease.swap(lease_);
  }
  const bool had_lease = lease != nullptr;
  lease.reset();  // stops renewing, then releases on every rank it reaches
  {
    std::lock_guard<std::mutex> lock(mu_);
    RecordLocked("drained", -1,
                 absl::StrCat("left on ", targets.size() - response.unreachable_size(), " of ",
                              targets.size(), " ranks",
                              had_lease ? absl::StrCat("; lease of '", options_.channel.owner_id,
                                                       "' given back")
                                        : ""));
    UpdateLocked(absl::Now());
  }
  return response;
}

bool GroupKeeper::ready() {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

v1::GetGroupResponse GroupKeeper::Snapshot() {
  std::lock_guard<std::mutex> lock(mu_);
  UpdateLocked(absl::Now());
  v1::GetGroupResponse out;
  if (has_desired_) *out.mutable_desired() = WithDefaults(desired_);
  out.set_desired_version(desired_version_);
  out.set_phase(phase_);
  out.set_generation(generation_);
  for (const v1::RankView& v : views_) *out.add_ranks() = v;
  for (const v1::GroupEvent& e : history_) *out.add_history() = e;
  out.set_formations(formations_);
  out.set_failed_attempts(failed_attempts_);
  out.set_last_error(last_error_);
  if (phase_ == v1::GROUP_PHASE_BACKING_OFF) out.set_next_attempt_unix_ms(UnixMs(next_attempt_));
  out.set_last_form_seconds(last_form_seconds_);
  out.set_last_load_seconds(last_load_seconds_);
  out.set_last_recovery_seconds(last_recovery_seconds_);
  out.set_rank_loss_policy(options_.rank_loss);
  out.mutable_masked_ranks()->Assign(masked_.begin(), masked_.end());
  out.set_mask_round(mask_round_);
  out.mutable_lost_experts()->Assign(lost_experts_.begin(), lost_experts_.end());
  out.set_readds(readds_);
  out.set_last_readd_seconds(last_readd_seconds_);
  return out;
}

void GroupKeeper::RecordLocked(const std::string& kind, int rank, const std::string& message,
                               double seconds) {
  v1::GroupEvent e;
  e.set_time_unix_ms(UnixMs(absl::Now()));
  e.set_generation(generation_);
  e.set_kind(kind);
  e.set_rank(rank);
  e.set_message(message);
  e.set_seconds(seconds);
  history_.push_back(e);
  while (history_.size() > kHistorySize) history_.pop_front();
  if (options_.on_event) options_.on_event(e);
}

void GroupKeeper::SetReadyLocked(bool ready, absl::Time now) {
  if (ready == ready_) return;
  ready_ = ready;
  if (!ready) lost_at_ = now;
  if (options_.on_ready) options_.on_ready(ready);
}

void GroupKeeper::OnRankChange() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    UpdateLocked(absl::Now());
    wake_ = true;
  }
  cv_.notify_all();
}

v1::RankView GroupKeeper::ClassifyLocked(int rank, const RankObservation& obs) const {
  v1::RankView v;
  v.set_rank(rank);
  v.set_target(targets_[rank]);
  v.set_worker_state(obs.status.state());
  v.set_worker_generation(obs.status.generation());
  const bool watch_broken = !obs.watch_open && !obs.watch_error.ok();
  // A failed probe counts once probe_failure_threshold failed in a row (a
  // kubelet probe's failureThreshold), or at once for a rank that never
  // answered; until then the rank keeps the state of its last answer. A
  // broken Watch counts at once (issue 31 item 3).
  const bool probe_failed = obs.probed && !obs.probe.ok() &&
                            (obs.probe_failures >= options_.probe_failure_threshold ||
                             obs.last_answer == absl::InfinitePast());
  if (masks_ && formed_version_ >= 0 && std::binary_search(masked_.begin(), masked_.end(), rank)) {
    v.set_state(v1::RANK_STATE_MASKED);
    v.set_last_error(
        absl::StrCat("masked out by the survivors (mask round ", mask_round_, "); its worker ",
                     watch_broken || probe_failed
                         ? absl::StrCat("does not answer: ",
                                        (watch_broken ? obs.watch_error : obs.probe).ToString())
                         : absl::StrCat("answers: generation ", obs.status.generation(), ", state ",
                                        v1::WorkerState_Name(obs.status.state()))));
    return v;
  }
  const std::string missed =
      obs.probe_failures > 1 ? absl::StrCat(" (", obs.probe_failures, " probes in a row)") : "";
  if (probe_failed && obs.probe.code() == absl::StatusCode::kDeadlineExceeded && !watch_broken) {
    v.set_state(v1::RANK_STATE_UNRESPONSIVE);
    v.set_last_error(absl::StrCat("GetStatus", missed, ": ", obs.probe.ToString()));
  } else if (watch_broken || probe_failed) {
    v.set_state(v1::RANK_STATE_UNREACHABLE);
    v.set_last_error(watch_broken ? absl::StrCat("health Watch: ", obs.watch_error.ToString())
                                  : absl::StrCat("GetStatus", missed, ": ", obs.probe.ToString()));
  } else if (!obs.probed) {
    v.set_state(v1::RANK_STATE_UNSPECIFIED);
    v.set_last_error("not probed yet");
  } else if (formed_version_ >= 0 && obs.status.generation() == generation_ &&
             obs.status.state() != v1::WORKER_STATE_STARTED) {
    // In the group formed last (formed_version_ is -1 while forming).
    const bool serving = obs.readiness == grpc::health::v1::HealthCheckResponse::SERVING;
    if (obs.status.group_broken()) {
      v.set_state(v1::RANK_STATE_BROKEN);
      v.set_last_error(absl::StrCat("group broken: ", obs.status.broken_reason()));
    } else if (serving && obs.status.state() == v1::WORKER_STATE_ALLOCATED) {
      v.set_state(v1::RANK_STATE_READY);
    } else {
      v.set_state(settled_ ? v1::RANK_STATE_BROKEN : v1::RANK_STATE_FORMING);
      v.set_last_error(absl::StrCat(
          "in generation ", generation_, ", state ", v1::WorkerState_Name(obs.status.state()),
          ", health ", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(obs.readiness)));
    }
  } else if (forming_ || (formed_version_ >= 0 && !settled_)) {
    // Being formed, or formed but its probe has not seen the new generation.
    v.set_state(v1::RANK_STATE_FORMING);
  } else if (!drained_ && generation_ > 0 && obs.status.generation() == generation_ &&
             obs.status.state() != v1::WORKER_STATE_STARTED) {
    // Still in the group formed last, which is not in force any more (it lost
    // a rank, or its formation failed): ExplainWaitingLocked says which.
    if (obs.status.group_broken()) {
      v.set_state(v1::RANK_STATE_BROKEN);
      v.set_last_error(absl::StrCat("group broken: ", obs.status.broken_reason()));
    } else {
      v.set_state(v1::RANK_STATE_WAITING);
    }
  } else {
    v.set_state(v1::RANK_STATE_IDLE);
    if (obs.status.state() == v1::WORKER_STATE_STARTED) {
      v.set_last_error(absl::StrCat(
          "not in a group (state STARTED: restarted, or left)",
          generation_ > 0 ? absl::StrCat("; the coordinator's group is generation ", generation_)
                          : ""));
    } else {
      v.set_last_error(absl::StrCat(
          "in another group: generation ", obs.status.generation(), ", state ",
          v1::WorkerState_Name(obs.status.state()),
          generation_ > 0 ? absl::StrCat(" (the coordinator's is generation ", generation_, ")")
                          : " (the coordinator has formed none)"));
    }
  }
  return v;
}

void GroupKeeper::ExplainWaitingLocked(std::vector<v1::RankView>* views) const {
  std::vector<std::string> lost;
  for (const v1::RankView& v : *views) {
    const v1::RankState s = v.state();
    if (Lost(s) || s == v1::RANK_STATE_UNSPECIFIED || s == v1::RANK_STATE_IDLE ||
        s == v1::RANK_STATE_MASKED) {
      lost.push_back(absl::StrCat(v.rank(), " (", v1::RankState_Name(s), ")"));
    }
  }
  for (v1::RankView& v : *views) {
    if (v.state() != v1::RANK_STATE_WAITING) continue;
    const std::string in_group = absl::StrCat("in the group of generation ", v.worker_generation(),
                                              " (", v1::WorkerState_Name(v.worker_state()), ")");
    if (lost.empty()) {
      v.set_state(v1::RANK_STATE_FORMING);
      v.set_last_error(absl::StrCat(in_group, " from a formation that did not complete",
                                    last_error_.empty() ? "" : ": ", last_error_));
    } else {
      v.set_last_error(absl::StrCat(in_group, ", waiting for rank", lost.size() > 1 ? "s " : " ",
                                    absl::StrJoin(lost, ", "),
                                    " before a new generation is formed"));
    }
  }
}

void GroupKeeper::UpdateLocked(absl::Time now) {
  views_.resize(watchers_.size());
  ReadMaskLocked();
  bool all_ready = !watchers_.empty();
  std::vector<RankObservation> observations;
  std::vector<v1::RankView> fresh;
  for (size_t r = 0; r < watchers_.size(); ++r) {
    observations.push_back(watchers_[r]->Observe());
    fresh.push_back(ClassifyLocked(static_cast<int>(r), observations.back()));
  }
  ExplainWaitingLocked(&fresh);
  for (size_t r = 0; r < watchers_.size(); ++r) {
    const RankObservation& obs = observations[r];
    v1::RankView v = std::move(fresh[r]);
    const v1::RankState old = views_[r].state();
    if (v.state() != old || views_[r].target() != v.target()) {
      v.set_since_unix_ms(UnixMs(now));
      const bool gone = Lost(v.state()) || v.state() == v1::RANK_STATE_MASKED;
      const bool was_gone = Lost(old) || old == v1::RANK_STATE_MASKED;
      if (gone && !was_gone) {
        const double silent = obs.last_answer == absl::InfinitePast()
                                  ? 0.0
                                  : std::max(0.0, Seconds(now - obs.last_answer));
        RecordLocked("rank_lost", static_cast<int>(r),
                     absl::StrCat(v1::RankState_Name(v.state()), ": ", v.last_error()), silent);
      } else if (was_gone && !gone) {
        RecordLocked("rank_back", static_cast<int>(r),
                     absl::StrCat("answers again: ", v1::RankState_Name(v.state())));
      }
    } else {
      v.set_since_unix_ms(views_[r].since_unix_ms());
    }
    all_ready = all_ready && v.state() == v1::RANK_STATE_READY;
    views_[r] = std::move(v);
  }
  // A formed group that loses a rank after it settled is gone: form anew,
  // unless the policy keeps it up masked (the file comment).
  std::string why;
  const bool lost_some = settled_ && formed_version_ >= 0 && !all_ready;
  // While a re-add runs the ranks' probes change under it (the survivors
  // leave the mask before the returning rank's probe shows it joined).
  if (lost_some && masks_ && (readding_ || MaskableLocked(&why))) {
    if (!degraded_) {
      degraded_ = true;
      SetReadyLocked(false, now);
    }
  } else if (lost_some) {
    int first = 0;
    while (first < static_cast<int>(views_.size()) &&
           views_[first].state() == v1::RANK_STATE_READY) {
      ++first;
    }
    std::string message = first < static_cast<int>(views_.size()) ? views_[first].last_error() : "";
    if (masks_) absl::StrAppend(&message, "; not kept masked: ", why);
    RecordLocked("group_broken", first, message);
    formed_version_ = -1;
    settled_ = false;
    degraded_ = false;
  }
  if (settled_ && formed_version_ >= 0 && all_ready && degraded_) {
    degraded_ = false;
    lost_experts_.clear();
    if (lost_at_ != absl::InfinitePast()) {
      last_recovery_seconds_ = Seconds(now - lost_at_);
      RecordLocked("recovered", -1, "every rank READY again after a re-add, same generation",
                   last_recovery_seconds_);
    }
    lost_at_ = absl::InfinitePast();
  }
  // Settling: every rank READY after a formation.
  if (!settled_ && formed_version_ >= 0 && !forming_ && all_ready) {
    settled_ = true;
    ++formations_;
    RecordLocked("formed", -1,
                 absl::StrCat(views_.size(), " ranks, generation ", generation_,
                              ": join + configure + allocate ", last_form_seconds_,
                              " s, load experts ", last_load_seconds_, " s"),
                 last_form_seconds_);
    if (lost_at_ != absl::InfinitePast()) {
      last_recovery_seconds_ = Seconds(now - lost_at_);
      RecordLocked("recovered", -1, "READY again after a loss", last_recovery_seconds_);
    }
    lost_at_ = absl::InfinitePast();
  }
  const bool ready =
      has_desired_ && !drained_ && settled_ && formed_version_ == desired_version_ && all_ready;
  SetReadyLocked(ready, now);
  if (!has_desired_) {
    phase_ = v1::GROUP_PHASE_UNSPECIFIED;
  } else if (drained_) {
    phase_ = v1::GROUP_PHASE_DRAINED;
  } else if (ready) {
    phase_ = v1::GROUP_PHASE_READY;
  } else if (degraded_) {
    phase_ = v1::GROUP_PHASE_MASKED;
  } else {
    // FORMING: an attempt runs, settles, or starts at the next loop turn.
    const bool busy = forming_ || (formed_version_ >= 0 && !settled_);
    const bool lost =
        watchers_.empty() || std::any_of(views_.begin(), views_.end(),
                                         [](const v1::RankView& v) { return Lost(v.state()); });
    phase_ = !busy && lost                  ? v1::GROUP_PHASE_WAITING
             : !busy && now < next_attempt_ ? v1::GROUP_PHASE_BACKING_OFF
                                            : v1::GROUP_PHASE_FORMING;
  }
}

int64_t GroupKeeper::AdoptableGenerationLocked() const {
  const v1::DesiredState desired = WithDefaults(desired_);
  const int n = static_cast<int>(watchers_.size());
  int64_t generation = 0;
  for (int r = 0; r < n; ++r) {
    const RankObservation obs = watchers_[r]->Observe();
    const v1::GetStatusResponse& s = obs.status;
    const bool swiglu = desired.experts().kind() == v1::EXPERT_KIND_SWIGLU;
    if (obs.probed && obs.probe.ok() && !obs.watch_open && obs.watch_error.ok()) return -1;
    if (!obs.probed || !obs.probe.ok() ||
        obs.readiness != grpc::health::v1::HealthCheckResponse::SERVING ||
        s.state() != v1::WORKER_STATE_ALLOCATED || s.group_broken() || s.generation() <= 0 ||
        s.rank() != r || s.world_size() != n || (r > 0 && s.generation() != generation) ||
        (desired.backend() != "auto" && s.backend() != desired.backend()) ||
        s.capacity_tokens() != desired.capacity_tokens() || (s.expert_bytes() > 0) != swiglu) {
      return 0;
    }
    generation = s.generation();
  }
  return generation;
}

void GroupKeeper::ReadMaskLocked() {
  std::vector<int> masked;
  int round = 0;
  if (masks_ && formed_version_ >= 0) {
    for (const auto& w : watchers_) {
      const RankObservation obs = w->Observe();
      const v1::GetStatusResponse& s = obs.status;
      // A rank that joined alone to come back reports round 0 (itself live).
      if (!obs.probed || !obs.probe.ok() || s.generation() != generation_ ||
          s.state() == v1::WORKER_STATE_STARTED || s.group_broken() || s.mask_round() <= round) {
        continue;
      }
      round = s.mask_round();
      masked.assign(s.masked_ranks().begin(), s.masked_ranks().end());
    }
  }
  std::sort(masked.begin(), masked.end());
  if (masked != masked_ && !masked.empty()) {
    const double since_loss =
        lost_at_ == absl::InfinitePast() ? 0.0 : std::max(0.0, Seconds(absl::Now() - lost_at_));
    RecordLocked("masked", masked.front(),
                 absl::StrCat("the survivors masked ranks [", absl::StrJoin(masked, ","),
                              "] in mask round ", round, ": serving without a re-form"),
                 since_loss);
  }
  masked_ = std::move(masked);
  mask_round_ = round;
}

bool GroupKeeper::MaskableLocked(std::string* why) {
  // The ranks out of the group now: masked, or lost and masked at the
  // survivors' next step.
  const int n = static_cast<int>(views_.size());
  std::vector<bool> live(n, true);
  int serving = 0;
  std::string cause;
  for (int r = 0; r < n; ++r) {
    const v1::RankState s = views_[r].state();
    if (s == v1::RANK_STATE_READY) {
      ++serving;
    } else if (s == v1::RANK_STATE_MASKED || Lost(s)) {
      live[r] = false;
    } else if (watchers_[r]->Observe().last_answer_asked <= last_readd_end_) {
      // Re-added just now: its last probe (STARTED, alone) was asked before
      // the re-add ended (an answer arriving after it can still be stale).
    } else if (cause.empty()) {
      cause = absl::StrCat("rank ", r, " is ", v1::RankState_Name(s),
                           s == v1::RANK_STATE_IDLE
                               ? " (restarted before the survivors masked it: no step ran)"
                               : "",
                           ": ", views_[r].last_error());
    }
  }
  lost_experts_.clear();
  if (table_.has_value() && table_->ep_size() == n) {
    absl::StatusOr<core::PlacementTable> masked = table_->WithMask(live);
    if (masked.ok()) {
      for (int e = 0; e < masked->num_experts(); ++e) {
        if (masked->LiveReplicas(e).empty()) lost_experts_.push_back(e);
      }
    }
  }
  if (!cause.empty()) {
    *why = cause;
    return false;
  }
  if (serving == 0) {
    *why = "no rank is left serving";
    return false;
  }
  if (options_.rank_loss == v1::RANK_LOSS_MASK_COVERED && !lost_experts_.empty()) {
    *why = absl::StrCat("logical experts [", absl::StrJoin(lost_experts_, ","),
                        "] have no live replica (policy RANK_LOSS_MASK_COVERED)");
    return false;
  }
  return true;
}

std::vector<int> GroupKeeper::ReturnedMaskedRanksLocked() const {
  std::vector<int> back;
  if (!degraded_ || masked_.empty() || readding_ || forming_) return back;
  // Only answers to probes asked after the last re-add count (earlier ones
  // may show a rank that was re-added since still STARTED).
  for (int r : masked_) {
    const RankObservation obs = watchers_[r]->Observe();
    if (obs.probed && obs.probe.ok() && obs.last_answer_asked > last_readd_end_ &&
        obs.status.state() == v1::WORKER_STATE_STARTED) {
      back.push_back(r);
    }
  }
  if (back.empty()) return back;
  // Every survivor reports the mask (RejoinRanks would refuse otherwise).
  for (size_t r = 0; r < watchers_.size(); ++r) {
    if (std::binary_search(masked_.begin(), masked_.end(), static_cast<int>(r))) continue;
    const RankObservation obs = watchers_[r]->Observe();
    if (!obs.probed || !obs.probe.ok() || obs.last_answer_asked <= last_readd_end_ ||
        obs.status.mask_round() != mask_round_ ||
        !std::equal(obs.status.masked_ranks().begin(), obs.status.masked_ranks().end(),
                    masked_.begin(), masked_.end())) {
      return {};
    }
  }
  return back;
}

void GroupKeeper::Readd(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> formation(formation_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (drained_ || stopping_ || group_ == nullptr || !degraded_) {
      readding_ = false;
      return;
    }
  }
  const absl::Time start = absl::Now();
  const absl::StatusOr<v1::RejoinResponse> result = group_->RejoinRanks(ranks, setup_);
  const absl::Time end = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  readding_ = false;
  last_readd_end_ = end;
  const std::string list = absl::StrJoin(ranks, ",");
  if (result.ok()) {
    readds_ += static_cast<int64_t>(ranks.size());
    last_readd_seconds_ = Seconds(end - start);
    RecordLocked("readded", ranks.front(),
                 absl::StrCat("ranks [", list, "] re-added in mask round ", result->mask_round(),
                              " (still masked: [", absl::StrJoin(result->masked_ranks(), ","),
                              "]), generation unchanged"),
                 last_readd_seconds_);
  } else {
    RecordLocked(
        "readd_failed", ranks.front(),
        absl::StrCat("ranks [", list, "]: ", result.status().ToString(), "; re-forming the group"));
    last_error_ = result.status().ToString();
    degraded_ = false;
    formed_version_ = -1;
    settled_ = false;
  }
  UpdateLocked(end);
}

void GroupKeeper::FailAttemptLocked(const std::string& error, absl::Time now) {
  ++failed_attempts_;
  last_error_ = error;
  next_attempt_ = now + backoff_;
  RecordLocked("attempt_failed", -1,
               absl::StrCat(error, " (next attempt in ", absl::FormatDuration(backoff_), ")"));
  backoff_ = std::min(backoff_ * 2, options_.backoff_max);
}

void GroupKeeper::ResolveTargets() {
  v1::DesiredState desired;
  int64_t version = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    desired = desired_;
    version = desired_version_;
    last_resolve_ = absl::Now();
  }
  absl::StatusOr<std::vector<std::string>> resolved = options_.resolver->Resolve(desired);
  std::vector<std::unique_ptr<RankWatcher>> old;
  std::vector<std::unique_ptr<RankWatcher>> fresh;
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!resolved.ok()) {
      if (last_error_ != resolved.status().ToString()) {
        last_error_ = resolved.status().ToString();
        RecordLocked("resolve_failed", -1, last_error_);
      }
      return;
    }
    resolved_version_ = version;
    changed = *resolved != targets_;
  }
  if (!changed) {
    // The same ranks after a Drain (which gave the lease back): lease anew.
    bool lease_again = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      lease_again = !options_.channel.owner_id.empty() && lease_ == nullptr && !drained_;
    }
    if (!lease_again) return;
    absl::StatusOr<std::unique_ptr<LeaseRenewer>> lease =
        LeaseRenewer::StartBestEffort(*resolved, options_.channel, /*take_over=*/true);
    std::lock_guard<std::mutex> lock(mu_);
    if (lease.ok() && lease_ == nullptr) lease_ = *std::move(lease);
    return;
  }
  RankWatcherOptions watch;
  watch.probe_interval = options_.probe_interval;
  watch.probe_timeout = options_.probe_timeout;
  watch.retry_interval = std::min(options_.probe_interval, absl::Milliseconds(100));
  watch.channel = options_.channel;
  for (const std::string& target : *resolved) {
    fresh.push_back(std::make_unique<RankWatcher>(target, watch, [this] { OnRankChange(); }));
  }
  std::unique_ptr<LeaseRenewer> old_lease;
  std::unique_ptr<LeaseRenewer> fresh_lease;
  if (!options_.channel.owner_id.empty()) {
    absl::StatusOr<std::unique_ptr<LeaseRenewer>> lease =
        LeaseRenewer::StartBestEffort(*resolved, options_.channel, /*take_over=*/true);
    if (lease.ok()) fresh_lease = *std::move(lease);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fresh_lease != nullptr && !fresh_lease->last_renewal().ok()) {
      RecordLocked("lease", -1,
                   absl::StrCat("lease not taken on every rank yet (renewed every ",
                                absl::FormatDuration(options_.channel.lease_ttl / 3),
                                "): ", fresh_lease->last_renewal().message()));
    }
    old_lease.swap(lease_);
    lease_ = std::move(fresh_lease);
    old.swap(watchers_);
    watchers_ = std::move(fresh);
    targets_ = *resolved;
    views_.assign(targets_.size(), v1::RankView());
    formed_version_ = -1;
    settled_ = false;
    degraded_ = false;
    RecordLocked("targets", -1, absl::StrCat(targets_.size(), " ranks resolved"));
    UpdateLocked(absl::Now());
  }
  old.clear();  // outside mu_: their threads may be waiting for it
  if (old_lease != nullptr) old_lease->set_release_on_exit(false);  // same owner, maybe same ranks
  old_lease.reset();
}

void GroupKeeper::Attempt() {
  std::lock_guard<std::mutex> formation(formation_mu_);
  v1::DesiredState desired;
  int64_t version = 0;
  std::vector<std::string> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (drained_ || stopping_) return;
    desired = WithDefaults(desired_);
    version = desired_version_;
    targets = targets_;
    forming_ = true;
    settled_ = false;
    formed_version_ = -1;
    degraded_ = false;
    masks_ = false;
    masked_.clear();
    lost_experts_.clear();
    for (auto& w : watchers_) w->ResetReadiness();
    UpdateLocked(absl::Now());
  }
  CoordinatorOptions copts = options_.channel;
  copts.backend = desired.backend();
  // Rank masks: only where a lost rank may stay masked (the file comment).
  // Every backend's plane masks (Gloo, NCCL, one-sided; "auto" is one of
  // them); a group of one rank has no survivor to mask it (CanMask false).
  copts.rank_masks =
      options_.rank_loss != v1::RANK_LOSS_REFORM && targets.size() > 1 &&
      (desired.placement_size() > 0 || options_.rank_loss == v1::RANK_LOSS_MASK_ALWAYS);
  copts.group_timeout = absl::Milliseconds(desired.group_timeout_ms());
  copts.rpc_timeout = absl::Milliseconds(desired.rpc_timeout_ms());
  const absl::Time start = absl::Now();
  absl::Time allocated_at = start;
  int64_t generation = 0;
  std::unique_ptr<Coordinator> coordinator;
  RankSetup setup;
  std::optional<core::PlacementTable> table;
  group_.reset();
  const absl::Status result = [&]() -> absl::Status {
    const int world = static_cast<int>(targets.size());
    ASSIGN_OR_RETURN(GroupRequests requests, BuildGroupRequests(desired, world));
    const int num_experts = requests.allocate.num_experts();
    ASSIGN_OR_RETURN(table, DesiredPlacement(desired, num_experts, world));
    if (!table.has_value()) {
      ASSIGN_OR_RETURN(core::PlacementTable contiguous,
                       core::PlacementTable::Contiguous(num_experts, world));
      table = std::move(contiguous);
    }
    ASSIGN_OR_RETURN(coordinator, Coordinator::Connect(targets, copts));
    // Debug: what each step of the attempt did (issue 31 item 5).
    const auto step = [&](const std::string& what) {
      spdlog::debug("formation of desired version {}: {} on {} ranks after {:.3f} s", version, what,
                    world, Seconds(absl::Now() - start));
    };
    RETURN_IF_ERROR(coordinator->FormGroup().status());
    generation = coordinator->generation();
    step(absl::StrCat("Join generation ", generation, " (backend ", copts.backend,
                      copts.rank_masks ? ", rank masks" : "", ")"));
    RETURN_IF_ERROR(coordinator->ConfigureLayers(requests.configure).status());
    step(absl::StrCat("ConfigureLayers ", requests.configure.model().name()));
    RETURN_IF_ERROR(coordinator->AllocateWorkspace(requests.allocate).status());
    step(absl::StrCat("AllocateWorkspace capacity ", requests.allocate.capacity_tokens()));
    for (const v1::InstallPlacementRequest& placement : requests.placements) {
      RETURN_IF_ERROR(coordinator->InstallPlacement(placement).status());
      step(absl::StrCat("InstallPlacement layer ", placement.layer()));
    }
    allocated_at = absl::Now();
    for (const v1::LoadExpertsRequest& load : requests.load) {
      RETURN_IF_ERROR(coordinator->LoadExperts(load).status());
      step(absl::StrCat("LoadExperts layer ", load.layer()));
    }
    setup.configure = requests.configure;
    setup.allocate = requests.allocate;
    setup.placements = requests.placements;
    setup.loads = requests.load;
    return absl::OkStatus();
  }();
  const absl::Time end = absl::Now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    forming_ = false;
    if (generation > 0) generation_ = generation;
    if (result.ok()) {
      formed_version_ = version;
      formed_at_ = end;
      masks_ = copts.rank_masks;
      table_ = std::move(table);
      group_ = std::move(coordinator);
      setup_ = std::move(setup);
      last_form_seconds_ = Seconds(allocated_at - start);
      last_load_seconds_ = Seconds(end - allocated_at);
      backoff_ = options_.backoff_initial;
      last_error_.clear();
    } else {
      FailAttemptLocked(result.ToString(), end);
    }
    UpdateLocked(end);
  }
}

void GroupKeeper::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    const absl::Time now = absl::Now();
    UpdateLocked(now);
    enum class Action { kNone, kResolve, kForm, kReadd } action = Action::kNone;
    std::vector<int> back;
    if (has_desired_ && !drained_) {
      const bool any_lost =
          watchers_.empty() || std::any_of(views_.begin(), views_.end(), [](const v1::RankView& v) {
            return Lost(v.state()) || v.state() == v1::RANK_STATE_UNSPECIFIED;
          });
      const absl::Duration since_resolve = now - last_resolve_;
      back = ReturnedMaskedRanksLocked();
      if (!back.empty()) {
        action = Action::kReadd;
      } else if ((resolved_version_ != desired_version_ && since_resolve >= kResolveRetry) ||
                 (any_lost && since_resolve >= kResolveInterval)) {
        action = Action::kResolve;
      } else if (formed_version_ != desired_version_ && !forming_ && !any_lost &&
                 now >= next_attempt_) {
        action = Action::kForm;
        if (!adoption_checked_) {
          adoption_checked_ = true;
          const int64_t g = AdoptableGenerationLocked();
          if (g < 0 && now - last_resolve_ < kAdoptionWait) {
            adoption_checked_ = false;  // a Watch is still opening: decide later
            action = Action::kNone;
          } else if (g > 0) {
            generation_ = g;
            formed_version_ = desired_version_;
            formed_at_ = now;
            RecordLocked("adopted", -1,
                         absl::StrCat("the workers' group of generation ", g,
                                      " matches the desired state: not re-formed"));
            continue;
          }
        }
      } else if (formed_version_ >= 0 && !settled_ && !forming_ &&
                 now - formed_at_ > options_.settle_timeout) {
        int r = 0;
        while (r < static_cast<int>(views_.size()) && views_[r].state() == v1::RANK_STATE_READY) {
          ++r;
        }
        formed_version_ = -1;
        FailAttemptLocked(
            absl::StrCat("rank ", r, " not READY within ",
                         absl::FormatDuration(options_.settle_timeout), " of the formation: ",
                         r < static_cast<int>(views_.size()) ? views_[r].last_error() : "?"),
            now);
        continue;
      }
    }
    if (action == Action::kResolve) {
      lock.unlock();
      ResolveTargets();
      lock.lock();
      continue;
    }
    if (action == Action::kReadd) {
      readding_ = true;
      lock.unlock();
      Readd(back);
      lock.lock();
      continue;
    }
    if (action == Action::kForm) {
      lock.unlock();
      Attempt();
      lock.lock();
      continue;
    }
    absl::Duration wait = options_.probe_interval;
    if (next_attempt_ > now) wait = std::min(wait, next_attempt_ - now);
    cv_.wait_for(lock, absl::ToChronoNanoseconds(wait), [this] { return stopping_ || wake_; });
    wake_ = false;
  }
}

}  // namespace moe_ep::client
