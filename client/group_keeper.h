#pragma once

// GroupKeeper: the reconciler behind `moe-ep coordinator` (DESIGN §16, issue
// 12 item 5). It holds a desired state (client/desired_state.h) and makes
// the workers match it: resolves the targets (client/target_resolver.h),
// watches every rank (client/rank_watcher.h), and forms, configures,
// allocates and loads the group (client::Coordinator: FormGroup,
// ConfigureLayers, AllocateWorkspace, LoadExperts). Whenever the group stops
// matching — a rank unreachable or unresponsive, a restarted worker (back in
// STARTED), a worker in another generation, health NOT_SERVING, or a new
// desired state — it forms a new generation (FormGroup: above the highest
// generation any worker reports) and applies the whole state again, once
// every rank answers. A failed attempt is retried after an exponential
// back-off (backoff_initial, doubling, at most backoff_max); a formation
// counts as done once every rank pushes health SERVING within settle_timeout.
//
// A coordinator that starts (or restarts) next to a group that already
// matches leaves it alone (DESIGN §16: no needless re-form): before its first
// formation it adopts the workers' group when every rank answers READY-like —
// health SERVING, ALLOCATED, one generation, rank i of N at target i, the
// desired backend (unless "auto") and capacity, and expert weights loaded iff
// the experts are SwiGLU. GetStatus shows neither the model nor which layers
// are loaded, so a group formed by another client with the same shape but
// another model would be adopted too; Apply a state to force a re-form.
//
// Rank masks (DESIGN §15, §16; issue 17): with a policy other than
// RANK_LOSS_REFORM (options.rank_loss), a group of at least 2 ranks and a
// desired state that installs a placement (or RANK_LOSS_MASK_ALWAYS), the
// group is formed with rank masks (CoordinatorOptions::rank_masks), on any
// backend: "gloo" (server/cpu_data_plane.h), "nccl" and "auto" (the NCCL
// plane, server/gpu_data_plane.h, or the one-sided CUDA IPC plane,
// server/onesided_data_plane.h; "auto" without a GPU is Gloo) all mask once
// Join lists every rank's address, which rank_masks sends. Only a group of
// one rank cannot (DataPlane::CanMask: no survivor); it re-forms. A rank
// lost after the group settled then does not re-form it: the survivors mask
// it themselves at the first step that fails, the phase is MASKED (GetGroup
// shows the mask and the experts left with no live replica), and once the
// lost rank's worker answers again in state STARTED (restarted on its
// target) and every survivor reports the same mask, the keeper re-adds it
// (and any other masked rank that is back, in one round:
// Coordinator::RejoinRanks with the group's own set-up requests) between
// two of the caller's steps; READY follows once every rank reports SERVING.
// The caller must not run a step while a re-add runs (a step that races it
// may fail; watch for the "readded" event). It re-forms instead (a new
// generation, once every rank answers) when: RANK_LOSS_MASK_COVERED and
// some logical expert has no live replica left; a survivor reports
// group_broken or stops serving; a lost rank is back (STARTED) before the
// survivors masked it (no step ran in between); the re-add fails. A group
// adopted from another client cannot be re-added to (its rendezvous secret
// is unknown): it is re-formed.
//
// Phases and rank states: proto/moe_ep/v1/coordinator.proto.
//
// Thread safety: every public method may be called from any thread. The
// callbacks run with the keeper's lock held, on its threads: they must not
// call the keeper, and must not block.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/coordinator.h"
#include "client/lease_renewer.h"
#include "client/rank_watcher.h"
#include "client/target_resolver.h"
#include "core/placement_table.h"
#include "moe_ep/v1/coordinator.pb.h"

namespace moe_ep::client {

struct GroupKeeperOptions {
  // Credentials and message limit of every worker channel (backend and
  // timeouts come from the desired state). channel.owner_id non-empty: the
  // keeper holds the workers' lease under that id (client/lease_renewer.h),
  // taking it over from any other owner whenever the targets are resolved
  // anew (DESIGN §16: a restarted coordinator takes the lease over), renews
  // it every lease_ttl/3, and claims it in every leased call.
  CoordinatorOptions channel;
  // Null: DefaultTargetResolver (targets as listed; headless Service names).
  std::shared_ptr<TargetResolver> resolver;
  absl::Duration probe_interval = absl::Milliseconds(250);
  // The deadline of each GetStatus probe.
  absl::Duration probe_timeout = absl::Seconds(1);
  // A rank is UNRESPONSIVE (missed deadlines) or UNREACHABLE (other
  // failures) once this many probes in a row failed, as a kubelet probe's
  // failureThreshold (issue 31 item 3): with the defaults a rank stopped
  // for 2.5 s misses 2 and the group is left alone; a hung rank is acted on
  // after about 3 x (probe_timeout + probe_interval) = 3.75 s. A broken
  // health Watch (a killed worker's connection closes) counts at once, and
  // so does a failed probe of a rank that never answered.
  int probe_failure_threshold = 3;
  absl::Duration backoff_initial = absl::Milliseconds(250);
  absl::Duration backoff_max = absl::Seconds(10);
  absl::Duration settle_timeout = absl::Seconds(5);
  // What a lost rank does to the group (the file comment; coordinator.proto
  // RankLossPolicy). UNSPECIFIED = RANK_LOSS_MASK_COVERED.
  v1::RankLossPolicy rank_loss = v1::RANK_LOSS_MASK_COVERED;
  // The group became READY (true) or stopped being READY (false).
  std::function<void(bool ready)> on_ready;
  // Every event recorded in the history.
  std::function<void(const v1::GroupEvent&)> on_event;
};

class GroupKeeper {
 public:
  // Starts the reconciler; with `initial`, applies it at once.
  // Errors: kInvalidArgument for an invalid `initial` (ValidateDesiredState)
  // or options (probe_interval, probe_timeout, backoff_initial,
  // settle_timeout not positive, backoff_max < backoff_initial).
  static absl::StatusOr<std::unique_ptr<GroupKeeper>> Start(
      GroupKeeperOptions options, std::optional<v1::DesiredState> initial = std::nullopt);
  // Stops the reconciler and the watchers, stops renewing the lease and
  // gives it back (issue 31 item 2: a stopped coordinator does not strand its
  // group for the lease's TTL; a restarted one takes it again and adopts a
  // group that matches). Leaves the workers' group as it is.
  ~GroupKeeper();
  GroupKeeper(const GroupKeeper&) = delete;
  GroupKeeper& operator=(const GroupKeeper&) = delete;

  // Coordinator.Apply: replaces the desired state (see the .proto).
  // Errors: kInvalidArgument from ValidateDesiredState; nothing changes then.
  absl::StatusOr<v1::ApplyResponse> Apply(const v1::DesiredState& desired);
  // Coordinator.Drain: waits for a formation in progress, then Leave on
  // every rank that is in a group, stops renewing the lease and gives it
  // back; no re-forming (and no lease) until the next Apply.
  v1::DrainResponse Drain();
  // Coordinator.GetGroup. Never blocks on workers.
  v1::GetGroupResponse Snapshot();
  // True while the phase is READY.
  bool ready();

 private:
  explicit GroupKeeper(GroupKeeperOptions options);
  void Loop();
  // Resolves the targets of the desired state and (re)starts the watchers.
  void ResolveTargets();
  // One formation attempt of the desired state (formation_mu_ held).
  void Attempt();
  void OnRankChange();
  void UpdateLocked(absl::Time now);
  v1::RankView ClassifyLocked(int rank, const RankObservation& obs) const;
  // RANK_STATE_WAITING views (ClassifyLocked's) get their message naming the
  // ranks the group lost; with none lost (a formation failed after Join)
  // they are FORMING.
  void ExplainWaitingLocked(std::vector<v1::RankView>* views) const;
  void RecordLocked(const std::string& kind, int rank, const std::string& message,
                    double seconds = 0);
  void SetReadyLocked(bool ready, absl::Time now);
  void FailAttemptLocked(const std::string& error, absl::Time now);
  // Masked ranks that are back (their worker answers in STARTED) while every
  // survivor reports the same mask; re-adds them (formation_mu_ taken).
  void Readd(const std::vector<int>& ranks);
  std::vector<int> ReturnedMaskedRanksLocked() const;
  // Reads the survivors' mask from the probes into masked_ / mask_round_.
  void ReadMaskLocked();
  // Whether the group formed last may stay up with its non-READY ranks
  // (see the file comment); else `why` says what forces a re-form. Fills
  // lost_experts_ either way.
  bool MaskableLocked(std::string* why);
  // The generation of a running group that matches the desired state (see
  // the file comment), 0 when there is none, -1 while a rank's health Watch
  // has not delivered its first status (undecided).
  int64_t AdoptableGenerationLocked() const;

  const GroupKeeperOptions options_;
  std::mutex formation_mu_;  // held by an attempt and by Drain
  std::mutex mu_;            // guards everything below
  std::condition_variable cv_;
  bool stopping_ = false;
  bool wake_ = false;
  bool has_desired_ = false;
  v1::DesiredState desired_;
  int64_t desired_version_ = 0;
  int64_t resolved_version_ = -1;  // desired version the targets were resolved for
  absl::Time last_resolve_ = absl::InfinitePast();
  bool drained_ = false;
  std::vector<std::string> targets_;
  std::vector<std::unique_ptr<RankWatcher>> watchers_;
  std::unique_ptr<LeaseRenewer> lease_;  // of targets_; null without an owner_id
  std::vector<v1::RankView> views_;
  // The group formed last: the desired version it applied (-1: none or
  // broken), its generation, whether every rank reported READY since.
  int64_t formed_version_ = -1;
  int64_t generation_ = 0;
  bool forming_ = false;
  bool adoption_checked_ = false;  // the first formation looked for a group to adopt
  bool settled_ = false;
  absl::Time formed_at_ = absl::InfinitePast();
  bool ready_ = false;
  absl::Time lost_at_ = absl::InfinitePast();  // the group stopped being READY
  v1::GroupPhase phase_ = v1::GROUP_PHASE_UNSPECIFIED;
  absl::Duration backoff_;
  absl::Time next_attempt_ = absl::InfinitePast();
  std::string last_error_;
  int64_t formations_ = 0;
  int64_t failed_attempts_ = 0;
  double last_form_seconds_ = 0, last_load_seconds_ = 0, last_recovery_seconds_ = 0;
  std::deque<v1::GroupEvent> history_;
  // Rank masks of the group formed last (see the file comment).
  std::unique_ptr<Coordinator> group_;  // formation_mu_: its Coordinator (secret, generation)
  RankSetup setup_;                     // formation_mu_: what a returning rank is sent
  bool masks_ = false;                  // formed with rank masks
  std::optional<core::PlacementTable> table_;  // its placement (contiguous when none was given)
  bool degraded_ = false;                      // kept up masked (phase MASKED)
  bool readding_ = false;
  absl::Time last_readd_end_ = absl::InfinitePast();  // when the last re-add returned
  std::vector<int> masked_;                           // the survivors' masked ranks (ascending)
  int mask_round_ = 0;
  std::vector<int> lost_experts_;  // no live replica under masked_ and the lost ranks
  int64_t readds_ = 0;
  double last_readd_seconds_ = 0;
  std::thread loop_;
};

}  // namespace moe_ep::client
