/* moe_ep.h: the C API of libmoe_ep.so, the moe-ep worker embedded in an
 * inference engine's process (DESIGN §14; issue 16).
 *
 * moe_ep_worker_start() starts the same worker as the `moe-ep-worker`
 * executable inside the caller's process: its gRPC control plane (Join,
 * ConfigureLayers, AllocateWorkspace, LoadExperts, GetStatus, health,
 * metrics, TLS; DESIGN §8) serves on --listen exactly as the executable's,
 * so an orchestrator (`moe-ep up --targets`, the Python Group client) forms
 * and configures the group remotely. The caller then drives each step's data
 * plane in process, on its own buffers, without gRPC:
 *
 *   moe_ep_sync_token_counts   all ranks' token counts and the step's R
 *   moe_ep_commit_geometry     commit (epoch, R) for the next steps
 *   moe_ep_dispatch            hidden [T,H] + routing -> received rows [E,R,...]
 *   moe_ep_combine             the caller's expert outputs [E,R,H] -> [T,H]
 *   moe_ep_forward             dispatch + the worker's loaded experts + combine
 *
 * GPU backend ("nccl"), the same calls on the engine's CUDA buffers:
 *   moe_ep_sync_token_counts_async  device token count -> device counts[E]
 *   moe_ep_dispatch / _combine / _forward with device pointers and a stream
 *   moe_ep_check_step          the sync point: waits, reports a geometry
 *                              disagreement the device recorded
 *   moe_ep_graph_token / moe_ep_check_graph  is a captured graph still valid
 *   moe_ep_receive_buffers     one-sided: dispatch buffers peers fill in place
 *
 * Every data call is a collective: all ranks of the group make the same
 * calls in the same order (a rank with T = 0 still calls).
 *
 * Readiness (issue 30): data calls run only once
 * moe_ep_worker_wait_ready_for_steps has returned MOE_EP_OK on every rank
 * of the group in force (formed, configured, allocated, and, for engines
 * that step the worker's experts, every sparse layer of the plan loaded on
 * every rank, agreed across ranks); before that, and again after the group
 * re-formed or the workspace was re-allocated, they return
 * MOE_EP_FAILED_PRECONDITION at once naming what is missing.
 *
 * Call order and agreement (CPU backend): each data call opens with one
 * fixed-size all-gather in which every rank says which call it makes and
 * whether its own arguments and state are fine (core/engine_call_round.h).
 * A rank whose call fails its checks returns that error, its peers
 * MOE_EP_ABORTED naming it, and ranks in different calls (dispatch on one,
 * combine on another) are MOE_EP_ABORTED everywhere: nothing moves, the
 * group stays usable, and the next calls pair as before. The order of one
 * step is dispatch -> combine (or one forward): a second dispatch is
 * MOE_EP_FAILED_PRECONDITION "a dispatch is in flight: call combine first",
 * a combine without one "combine needs a dispatch first".
 *
 * Exceptions: no C++ exception (Gloo's, NCCL's, CUDA's or ours) leaves a
 * call: each becomes a status (MOE_EP_INTERNAL for anything unexpected);
 * every Gloo operation of the library runs inside a handler
 * (core/gloo_collective.cc). Gloo's own TCP device thread cannot be guarded
 * by any caller (an operation whose peer sends a larger message than it
 * posted throws gloo::EnforceNotMet there and the process aborts), so the
 * library never lets the ranks post different operations: the opening
 * round above, and the arrival round of every collective RPC before its
 * vote (issue 29), keep the ranks' Gloo operations paired.
 *
 * Stable C ABI (C11): opaque handles, fixed-width integer arguments, structs
 * that begin with their own size (fields are only ever appended). Symbols:
 * moe_ep_* only. MOE_EP_ABI_VERSION changes only when an existing call or
 * struct field changes meaning.
 *
 * Status: every call returns a moe_ep_status (0 = MOE_EP_OK, otherwise the
 * absl / gRPC status code) and sets the calling thread's message, read with
 * moe_ep_last_error() ("" after a call that succeeded). Messages name the
 * argument, the expected and the actual value.
 *
 * Tensors: row-major and contiguous. bf16 values are passed as uint16_t bit
 * patterns. Symbols: T = this rank's tokens of the step, H = hidden size,
 * K = top_k, E = ep_size (ranks of the group), L = this rank's experts,
 * R = the committed runtime_max_tokens_per_rank (DESIGN §6). Memory: on the
 * CPU backend ("gloo") host pointers and stream = NULL.
 *
 * GPU backend ("nccl"; DESIGN §14): every data pointer (inputs, outputs,
 * counts) is device memory of the worker's CUDA device (moe_ep_worker_info
 * .device; MOE_EP_INVALID_ARGUMENT names a host pointer), and `stream` is
 * the caller's cudaStream_t (NULL = the legacy default stream). A data call
 * only enqueues, in `stream` order: the one-sided plane enqueues on `stream`
 * itself (ordered after the worker's own earlier work; issue 30 item 3), the
 * nccl plane on the worker's stream after an event recorded on `stream`,
 * which then waits for the step's end event; no host synchronisation,
 * allocation or pageable copy, so outputs
 * are ready in `stream` order, and the calls can be captured in the
 * caller's CUDA graph (stream capture of `stream`, any capture mode). In a
 * graph: R is the committed R at capture time (commit the capture bucket
 * with moe_ep_commit_geometry(epoch, bucket, 0) first), T is the num_tokens
 * given at capture (pad a smaller batch to it with topk_ids =
 * invalid_expert_id: such rows are sent nowhere), and the per-step counts
 * (moe_ep_sync_token_counts_async, the step header {epoch, R, T}, the
 * received counts) are exchanged and checked on the device. A rank whose
 * (epoch, R) differs makes the step move only padding; the disagreement is
 * reported by moe_ep_check_step (MOE_EP_ABORTED). A moe_ep_dispatch or
 * moe_ep_forward whose arguments fail this rank's checks (host pointers,
 * NULL buffers, recv_rows < R, T outside [0, R]; a forward's layer without
 * loaded experts) returns the error, having first enqueued, in
 * `stream` order as any data call, a refusal in place of the step, on both
 * GPU planes: the one-sided plane publishes flags marked refused and moves
 * no row; the nccl plane runs the step's transfers at the committed R
 * (NCCL's calls must match in order and size on every rank) with a step
 * header marked refused, zero counts and padding rows, then the combine's
 * transfer. Either way the peers' dispatch and combine of that step end at
 * once without output (their `output` is not written) and their next
 * moe_ep_check_step returns MOE_EP_ABORTED "rank r refused its dispatch of
 * the step at epoch e (its arguments failed that rank's checks; its call
 * returned the error); ..." ending "the step moved no row here and wrote no
 * output; the group is still usable" on the one-sided plane and "the step
 * wrote no output here (its received rows lack that rank's); the group is
 * still usable" on the nccl plane (the other sources' rows did arrive); the
 * refusing rank's own moe_ep_check_step reports nothing for it, and the
 * group serves the next step (issue 30 item 1). On the nccl plane the
 * refusal's transfers are on `stream`, so work enqueued after it there
 * waits for the peers' step, as after any dispatch. When the refusal itself
 * cannot be enqueued (e.g. this rank's previous step is still dispatched),
 * the returned error says so and the peers wait for this rank as before.
 * A moe_ep_combine whose arguments fail is refused likewise on both GPU
 * planes (moe_ep_combine below). Errors found before the plane is known
 * usable (not ready for steps, no workspace, no committed geometry,
 * moe_ep_dispatch_only) are returned before anything is enqueued on that
 * rank; the peers' enqueued collectives then
 * wait for it: their next moe_ep_check_step returns MOE_EP_DEADLINE_EXCEEDED
 * after the group's timeout and the group is broken (re-form it). A graph
 * holds the workspace's buffers and communicator:
 * after the group re-forms (or the workspace is re-allocated) it must not be
 * replayed: moe_ep_check_graph returns MOE_EP_RECAPTURE; capture again.
 * While a capture in cudaStreamCaptureModeGlobal is open, no orchestrator
 * RPC may run on the worker (they synchronise).
 * Both GPU data planes (--gpu-data-plane, GetStatus.data_plane) serve these
 * calls with the same results: "nccl" (NCCL send/recv) and "one-sided"
 * (kernels storing into CUDA IPC peer windows: several worker processes may
 * share one GPU; issue 34). On the one-sided plane the calls route by the
 * contiguous placement (a forward of a layer with another installed table
 * is MOE_EP_FAILED_PRECONDITION), and moe_ep_sync_token_counts_async agrees
 * on the host: it synchronises `stream` and cannot be captured.
 *
 * NCCL: moe_ep_worker_start compares the NCCL found at run time with the
 * one built against on major.minor, not the patch level: NCCL keeps its
 * ABI (soname libnccl.so.2, versioned config structs) within a minor
 * release, and the structs its device API inlines into this library's
 * kernels change only between minor releases; patch releases fix bugs
 * without changing either, so requiring the patch would only refuse working
 * combinations (e.g. torch's pip NCCL a patch ahead of the toolkit's).
 *
 * Thread safety: every call is thread-safe. Data calls and the worker's
 * collective RPCs are serialized by the worker's collective slot; a data call
 * waits for it at most `timeout_ms` (MOE_EP_DEADLINE_EXCEEDED; nothing ran,
 * call it again: the peers wait for it in the opening round; 0 = no limit;
 * a negative timeout_ms is MOE_EP_INVALID_ARGUMENT, and on gloo the call
 * still meets its peers in the opening round, refusing it, so they return
 * MOE_EP_ABORTED at once). A group
 * error (a peer gone, a collective timeout) marks the group broken: later
 * data calls return MOE_EP_FAILED_PRECONDITION until the orchestrator
 * re-forms the group (Join with a new generation).
 */
#ifndef MOE_EP_H_
#define MOE_EP_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MOE_EP_EXPORT __attribute__((visibility("default")))
#else
#define MOE_EP_EXPORT
#endif

#define MOE_EP_ABI_VERSION 2

/* Status codes: absl::StatusCode / grpc::StatusCode values. */
typedef int32_t moe_ep_status;
#define MOE_EP_OK 0
#define MOE_EP_CANCELLED 1
#define MOE_EP_UNKNOWN 2
#define MOE_EP_INVALID_ARGUMENT 3
#define MOE_EP_DEADLINE_EXCEEDED 4
#define MOE_EP_NOT_FOUND 5
#define MOE_EP_ALREADY_EXISTS 6
#define MOE_EP_PERMISSION_DENIED 7
#define MOE_EP_RESOURCE_EXHAUSTED 8
#define MOE_EP_FAILED_PRECONDITION 9
#define MOE_EP_ABORTED 10
#define MOE_EP_OUT_OF_RANGE 11
#define MOE_EP_UNIMPLEMENTED 12
#define MOE_EP_INTERNAL 13
#define MOE_EP_UNAVAILABLE 14
#define MOE_EP_DATA_LOSS 15
#define MOE_EP_UNAUTHENTICATED 16
/* Not an absl code: a CUDA graph that captured data calls belongs to an
 * earlier group or workspace and must be captured again (moe_ep_check_graph). */
#define MOE_EP_RECAPTURE 100

/* One embedded worker (opaque). */
typedef struct moe_ep_worker moe_ep_worker;

/* The group and workspace a worker is configured with (moe_ep_worker_info).
 * Set struct_size = sizeof(moe_ep_worker_info) before the call; a library
 * fills only the fields that fit in struct_size. */
typedef struct moe_ep_worker_info {
  uint64_t struct_size;
  int32_t rank;                        /* this rank, in [0, world_size) */
  int32_t world_size;                  /* E = ep_size */
  int64_t generation;                  /* of the joined group */
  int64_t hidden;                      /* H */
  int32_t top_k;                       /* K */
  int32_t num_experts;                 /* all experts of the layer */
  int32_t first_expert;                /* this rank's experts: [first_expert, first_expert + L) */
  int32_t num_local_experts;           /* L */
  int64_t capacity_tokens;             /* N: the largest R a step may commit */
  int32_t invalid_expert_id;           /* -1 or num_experts: ids that select no expert */
  int32_t backend;                     /* MOE_EP_BACKEND_* */
  int64_t epoch;                       /* committed geometry epoch, -1 before the first commit */
  int64_t runtime_max_tokens_per_rank; /* committed R, 0 before the first commit */
  int32_t device;                      /* CUDA device ordinal (nccl), -1 (gloo) */
} moe_ep_worker_info;

#define MOE_EP_BACKEND_GLOO 1 /* CPU: host pointers, stream = NULL */
#define MOE_EP_BACKEND_NCCL 2 /* GPU: device pointers, cudaStream_t */

/* ---------------------------------------------------------------- library */

/* "major.minor.patch" of this library (the `moe-ep-worker --version`
 * number). Never fails; the string is static. */
MOE_EP_EXPORT const char* moe_ep_version(void);

/* MOE_EP_ABI_VERSION of this library (compare with the header's). */
MOE_EP_EXPORT int32_t moe_ep_abi_version(void);

/* The message of the calling thread's last call: "" after a success,
 * otherwise what failed. Valid until the thread's next moe_ep_* call. */
MOE_EP_EXPORT const char* moe_ep_last_error(void);

/* Does nothing and returns MOE_EP_OK: the fixed cost of one call through a
 * binding (the Python layer's overhead figure, issue 16 item 5). */
MOE_EP_EXPORT moe_ep_status moe_ep_noop(void);

/* The moe-ep-worker executable: its main() is this call (flags as the
 * executable's, argv[0] the program name). Returns the process exit status
 * after SIGTERM / SIGINT (0), or 2 on a bad command line or start-up error.
 * Installs handlers for SIGTERM and SIGINT: for executables only. */
MOE_EP_EXPORT int moe_ep_worker_main(int argc, char** argv);

/* --------------------------------------------------------------- lifecycle */

/* Starts a worker in this process with moe-ep-worker's flags: `argc`
 * strings in `argv` (no program name), e.g. {"--listen=127.0.0.1:0",
 * "--backend=gloo"}; `argv` may be NULL when argc is 0. It serves until
 * moe_ep_worker_stop. Logs go to stderr. No signal handlers are installed.
 * Errors: MOE_EP_INVALID_ARGUMENT (a flag, --help or --version, `out` NULL),
 * MOE_EP_UNAVAILABLE (--listen cannot be bound), MOE_EP_FAILED_PRECONDITION
 * (built with NCCL and the NCCL found at run time is another major.minor
 * release: the message names both; why not the patch: see the top). On error *out is NULL. */
MOE_EP_EXPORT moe_ep_status moe_ep_worker_start(int32_t argc, const char* const* argv,
                                                moe_ep_worker** out);

/* Health NOT_SERVING, new RPCs UNAVAILABLE, waits up to drain_timeout_ms
 * (>= 0) for running RPCs, stops serving and frees `worker` (also on error).
 * Must not race with other calls on `worker`. NULL: no-op. Never waits on
 * the engine's CUDA graphs: where graphs that captured NCCL-plane calls
 * still exist (NCCL frees a communicator only after them), the
 * communicator's abort finishes in the background once they are destroyed
 * and a warning says so; destroy such graphs first to free it at once. A
 * graph that captured calls of a stopped worker must not be replayed.
 * Errors: MOE_EP_DEADLINE_EXCEEDED (RPCs were still running at the deadline
 * and were cancelled; the worker is stopped and freed anyway). */
MOE_EP_EXPORT moe_ep_status moe_ep_worker_stop(moe_ep_worker* worker, int64_t drain_timeout_ms);

/* The bound --listen address, "host:port" (NUL-terminated, valid until
 * moe_ep_worker_stop). Errors: MOE_EP_INVALID_ARGUMENT (NULL arguments). */
MOE_EP_EXPORT moe_ep_status moe_ep_worker_address(const moe_ep_worker* worker,
                                                  const char** address);

/* Blocks until the orchestrator has formed the group and allocated the
 * workspace on this rank (GetStatus state ALLOCATED, not broken), at most
 * timeout_ms (>= 0): the control plane's readiness, what a health probe
 * reports. Not the readiness for steps: the orchestrator may still be
 * loading experts on this rank or a peer; data calls need
 * moe_ep_worker_wait_ready_for_steps. Errors: MOE_EP_DEADLINE_EXCEEDED (not
 * ready in time; the message gives the state), MOE_EP_INVALID_ARGUMENT. */
MOE_EP_EXPORT moe_ep_status moe_ep_worker_wait_ready(moe_ep_worker* worker, int64_t timeout_ms);

/* What the engine steps (moe_ep_worker_wait_ready_for_steps). */
#define MOE_EP_STEPS_OWN_EXPERTS 0    /* dispatch + combine: the engine's own experts */
#define MOE_EP_STEPS_WORKER_EXPERTS 1 /* forward too: the experts LoadExperts put here */

/* The readiness contract of the data calls (issue 30 item 1). Blocks until
 * (1) this rank is joined, configured, allocated, not broken, not under a
 * rank mask, and, with MOE_EP_STEPS_WORKER_EXPERTS, holds experts for every
 * sparse layer of the configured plan (LoadExperts done, none running), and
 * (2) every rank of the group is so with the same generation, workspace
 * and (with MOE_EP_STEPS_WORKER_EXPERTS) the same layers and expert specs:
 * the ranks agree in one arrival round on the group's store (no data-plane
 * collective: a peer that is still being set up breaks nothing, the wait
 * just goes on). Then it returns MOE_EP_OK on every rank, and the data
 * calls run until the group re-forms or the workspace is re-allocated
 * (then wait again). Collective in the sense that every rank's engine
 * calls it; ranks that call it at different times wait for each other.
 * A LoadExperts of a layer after the wait does not end readiness; while it
 * runs it holds that rank's calls (and its peers' collectives wait for
 * them, at most the group's timeout): reload between steps, not during.
 * timeout_ms >= 0, 0 = no limit. Errors: MOE_EP_INVALID_ARGUMENT
 * (`experts` not one of the two values, timeout_ms < 0, NULL worker),
 * MOE_EP_DEADLINE_EXCEEDED (the message says what this rank lacks, e.g.
 * "sparse layers [2,3] of the plan have no experts loaded on rank 1", or
 * which ranks did not agree), MOE_EP_UNAVAILABLE (shutting down).
 * Thread-safe; holds the worker only for short checks. */
MOE_EP_EXPORT moe_ep_status moe_ep_worker_wait_ready_for_steps(moe_ep_worker* worker,
                                                               int32_t experts, int64_t timeout_ms);

/* Fills `info` (struct_size set by the caller) from the allocated group.
 * Errors: MOE_EP_FAILED_PRECONDITION (not joined, or no workspace yet),
 * MOE_EP_INVALID_ARGUMENT (NULL, struct_size too small for the first
 * field). */
MOE_EP_EXPORT moe_ep_status moe_ep_worker_info_get(moe_ep_worker* worker, moe_ep_worker_info* info);

/* -------------------------------------------------------------- data plane */
/* moe_ep_sync_token_counts and moe_ep_commit_geometry run the worker's
 * SyncTokenCounts / CommitGeometry handlers in process (same checks, same
 * GetStatus fields as the RPCs): they wait for the collective slot like an
 * RPC without a deadline (each holder is bounded by the group's timeout).
 * The other data calls take `timeout_ms` (>= 0, 0 = no limit) for that
 * wait; the collective itself is bounded by the group's timeout (Join). */

/* All-gathers local_tokens (>= 0) of every rank. Writes counts[world_size]
 * (may be NULL) and *runtime_max_tokens_per_rank (may be NULL): the smallest
 * CUDA-graph bucket >= max(counts), or max(counts) without buckets (DESIGN
 * §6). Collective (on gloo: the opening round of the data calls, nothing
 * else). Errors: MOE_EP_INVALID_ARGUMENT (local_tokens < 0),
 * MOE_EP_RESOURCE_EXHAUSTED (max(counts) > capacity_tokens),
 * MOE_EP_FAILED_PRECONDITION (no workspace / group broken / not ready for
 * steps), MOE_EP_ABORTED (a peer refused, or is in another call), group
 * errors.
 * Host values on both backends: blocking, not capturable (on nccl use
 * moe_ep_sync_token_counts_async inside a graph). */
MOE_EP_EXPORT moe_ep_status moe_ep_sync_token_counts(moe_ep_worker* worker, int64_t local_tokens,
                                                     int64_t* counts,
                                                     int64_t* runtime_max_tokens_per_rank);

/* GPU backend: the token-count agreement on the device. local_tokens: device
 * int64 (this rank's T); counts: device int64 [world_size], rank-major.
 * Enqueued on `stream` (an NCCL all-gather; capturable, see the top); on
 * the one-sided plane a host all-gather that synchronises `stream`.
 * Collective. Errors: MOE_EP_UNIMPLEMENTED (gloo: use
 * moe_ep_sync_token_counts), MOE_EP_INVALID_ARGUMENT (NULL or host
 * pointers), MOE_EP_FAILED_PRECONDITION (no workspace / group broken; on
 * the one-sided plane, while `stream` is being captured), group errors. */
MOE_EP_EXPORT moe_ep_status moe_ep_sync_token_counts_async(moe_ep_worker* worker,
                                                           const int64_t* local_tokens,
                                                           int64_t* counts, void* stream,
                                                           int64_t timeout_ms);

/* Commits (epoch >= 0, R) for the next steps; every rank commits the same
 * pair (dispatch and forward check it across ranks: MOE_EP_ABORTED). Not a
 * collective. Errors: MOE_EP_INVALID_ARGUMENT (R < local_tokens, negative
 * values), MOE_EP_RESOURCE_EXHAUSTED (R > capacity_tokens),
 * MOE_EP_FAILED_PRECONDITION (a dispatched step is in flight; not ready for
 * steps). */
MOE_EP_EXPORT moe_ep_status moe_ep_commit_geometry(moe_ep_worker* worker, int64_t epoch,
                                                   int64_t runtime_max_tokens_per_rank,
                                                   int64_t local_tokens);

/* Dispatch of a step whose experts the caller runs. In: hidden [T,H] bf16,
 * topk_ids [T,K] int32 (global expert ids in [0, num_experts); the
 * configured invalid_expert_id, -1 or num_experts, is padding and selects
 * none; any other id is the caller's routing bug: MOE_EP_INVALID_ARGUMENT
 * "topk_ids[row t, choice k] = id: outside [0, E) ..." here, MOE_EP_ABORTED
 * on the peers, nothing moved, on gloo; the GPU planes read ids on the
 * device only, so there such a choice selects no expert, the step runs,
 * and this rank's next moe_ep_check_step returns MOE_EP_INVALID_ARGUMENT
 * with the same words),
 * topk_weights [T,K] fp32, T <= R (inputs may be NULL when T = 0). Out, for
 * recv_rows >= R rows per source (the three row buffers may be NULL when
 * recv_rows = 0): recv_hidden [E,recv_rows,H] bf16,
 * recv_topk_ids [E,recv_rows,K] int32, recv_topk_weights [E,recv_rows,K]
 * fp32 (slot j < source_counts[s] of row s: the j-th token source rank s
 * sent here, with its full K ids and weights; other slots: zero hidden, the
 * invalid id, zero weights), source_counts[E] int64, expert_counts[L] int64
 * ((token, choice) pairs routed to each local expert). Collective. A bad
 * argument on one rank aborts the step on all (MOE_EP_ABORTED on the
 * others) before any payload moves (CPU backend; on nccl see the top). On
 * nccl all buffers, source_counts and expert_counts included, are device
 * memory, and a slot of source s holds a token when one of its ids is a
 * local expert (the counts are computed on the device). Errors: MOE_EP_INVALID_ARGUMENT (sizes,
 * NULL buffers, recv_rows < R, T > R, an expert id out of range, stream not
 * NULL on the CPU backend), MOE_EP_FAILED_PRECONDITION (not ready for
 * steps; no committed geometry; "a dispatch is in flight: call combine
 * first"), MOE_EP_ABORTED (a peer refused its dispatch or is in another
 * call), group errors. */
MOE_EP_EXPORT moe_ep_status moe_ep_dispatch(moe_ep_worker* worker, const uint16_t* hidden,
                                            const int32_t* topk_ids, const float* topk_weights,
                                            int64_t num_tokens, uint16_t* recv_hidden,
                                            int32_t* recv_topk_ids, float* recv_topk_weights,
                                            int64_t recv_rows, int64_t* source_counts,
                                            int64_t* expert_counts, void* stream,
                                            int64_t timeout_ms);

/* The one-sided plane's receive buffers (issue 30): device memory inside
 * this rank's window, *recv_hidden [E,rows,H] bf16, *recv_topk_ids
 * [E,rows,K] int32, *recv_topk_weights [E,rows,K] fp32, *recv_rows =
 * capacity_tokens (N); laid out as moe_ep_dispatch's outputs (source-major,
 * all K ids a slot), one set per worker. Every worker of the group must be
 * started with --onesided-receive-buffers (the windows are sized alike:
 * AllocateWorkspace refuses windows of different sizes).
 * Passed as moe_ep_dispatch's three row buffers with recv_rows = *recv_rows
 * (the counts stay the caller's), the peers store their rows into them in
 * place — no copy of the peers' rows after their flags arrive, as DeepEP's
 * low-latency receive tensors live in its buffer — when the step takes the
 * fused direct path: R <= 512, at most 8 ranks, bf16 dispatch, at most 1024
 * local experts, and MOE_EP_ONESIDED_FUSED_UNPACK / _DIRECT_UNPACK not 0.
 * Then slots j < source_counts[s] hold the tokens and slots [count, R) are
 * padding, as moe_ep_dispatch says, but slots [R, rows) are not written:
 * they keep an earlier step's rows, so read each source's slots below R
 * (or below its count) only. Otherwise the rows are copied into them as
 * into buffers of the caller's (same values, padding up to rows: E * (N -
 * R) rows more to write than with recv_rows = R). In a step every rank's
 * engine passes them, or none does (else the step writes no output and
 * moe_ep_check_step returns MOE_EP_ABORTED "receive buffers mismatch ...",
 * naming the ranks). The next dispatch overwrites them, and a peer's next
 * dispatch may store into them once this rank's combine of the step has
 * run: read them with work ordered before that combine on its stream (a
 * read on another stream needs an event the combine's stream waits for).
 * The GPU planes take one dispatched step at a time, so two micro-batches
 * do not overlap here. Valid while moe_ep_graph_token is unchanged (the
 * workspace). Not a collective; waits for the worker's collective slot
 * like a data call (timeout: none), and like them may remake the plane's
 * dispatcher after a Forward RPC under another placement table (a new
 * moe_ep_graph_token). Errors: MOE_EP_INVALID_ARGUMENT (NULL arguments),
 * MOE_EP_UNIMPLEMENTED (the gloo or nccl plane, or a worker without the
 * flag), MOE_EP_FAILED_PRECONDITION (no workspace yet: wait for the
 * orchestrator, moe_ep_worker_wait_ready; group broken; a rank mask). */
MOE_EP_EXPORT moe_ep_status moe_ep_receive_buffers(moe_ep_worker* worker, uint16_t** recv_hidden,
                                                   int32_t** recv_topk_ids,
                                                   float** recv_topk_weights, int64_t* recv_rows);

/* An exchange: moe_ep_dispatch (same arguments, same results, same
 * errors) whose step ends with it: no combine follows, and the next data
 * call may be another dispatch. For layers that move rows both ways with
 * dispatches (python/moe_ep_client/deep_ep.py returns expert outputs to
 * their sources this way, each (token, choice) row unweighted so the
 * source sums w * expert(x) in fp32 with one rounding). Every rank makes
 * the same kind of call (a peer in moe_ep_dispatch: MOE_EP_ABORTED on
 * every rank). CPU backend only: MOE_EP_UNIMPLEMENTED on the GPU planes. */
MOE_EP_EXPORT moe_ep_status moe_ep_dispatch_only(moe_ep_worker* worker, const uint16_t* hidden,
                                                 const int32_t* topk_ids, const float* topk_weights,
                                                 int64_t num_tokens, uint16_t* recv_hidden,
                                                 int32_t* recv_topk_ids, float* recv_topk_weights,
                                                 int64_t recv_rows, int64_t* source_counts,
                                                 int64_t* expert_counts, void* stream,
                                                 int64_t timeout_ms);

/* Combine of the dispatched step: expert_out [E,recv_rows,H] bf16 (slot j <
 * source_counts[s] of row s = that token's sum over its choices k among
 * this rank's experts of topk_weights[k] * expert(hidden); other slots are
 * not read; NULL when recv_rows = 0) -> output [T,H] bf16 (T of the
 * dispatch; NULL allowed when T = 0), the
 * sum over ranks, accumulated in fp32 (DESIGN §7). Collective. Errors:
 * MOE_EP_FAILED_PRECONDITION ("combine needs a dispatch first"; not ready
 * for steps), MOE_EP_INVALID_ARGUMENT (recv_rows < R, NULL, host pointers,
 * a negative timeout_ms: on gloo the step stays dispatched on every rank,
 * call again; the GPU planes refuse it in place, on `stream`: the one-sided
 * plane publishes flags marked refused, the nccl plane runs the combine's
 * transfers with a step header marked refused among them; the peers'
 * combine ends at once without output, their moe_ep_check_step returns
 * MOE_EP_ABORTED "rank r refused its combine of the step at epoch e (its
 * arguments failed that rank's checks; its call returned the error); the
 * step wrote no output here (its expert outputs lack that rank's); the
 * group is still usable", this rank's reports nothing for it, and the step
 * is over on every rank; the argument error returned here then ends
 * "(refused: the step is over on every rank; the peers' check_step names
 * this rank)", or says that no refusal could be enqueued and the peers
 * wait until the group's timeout; with no dispatched step nothing is
 * refused (no peer waits on this rank's combine); issue 30 item 1),
 * MOE_EP_ABORTED (a peer refused its combine or is in another call), group
 * errors. */
MOE_EP_EXPORT moe_ep_status moe_ep_combine(moe_ep_worker* worker, const uint16_t* expert_out,
                                           int64_t recv_rows, uint16_t* output, void* stream,
                                           int64_t timeout_ms);

/* One MoE layer with the experts LoadExperts put on this worker for `layer`
 * (and its shared expert, when loaded): hidden [T,H] bf16, topk_ids [T,K]
 * int32, topk_weights [T,K] fp32 -> output [T,H] bf16. Collective. On the
 * CPU (Gloo) plane it runs the Forward RPC's call gates with `timeout_ms`
 * (not 0) as its deadline (a GPU plane's step is one stream-ordered launch
 * bounded by the capacity, with no gate):
 * once any rank's step is past it, the expert compute stops and all ranks
 * stop together at the next gate with MOE_EP_DEADLINE_EXCEEDED ("...
 * stopped on every rank ... the group stays usable"); nothing is combined
 * and the group is not broken. moe_ep_dispatch and moe_ep_combine are one
 * collective each, with no work of the library's between them to stop, so
 * they have no gate.
 * Errors: MOE_EP_FAILED_PRECONDITION (no experts for `layer`, no committed
 * geometry, a dispatch in flight, not ready for steps),
 * MOE_EP_INVALID_ARGUMENT (as moe_ep_dispatch, ids included),
 * MOE_EP_ABORTED, MOE_EP_DEADLINE_EXCEEDED
 * (the agreed stop above), group errors. */
MOE_EP_EXPORT moe_ep_status moe_ep_forward(moe_ep_worker* worker, int32_t layer,
                                           const uint16_t* hidden, const int32_t* topk_ids,
                                           const float* topk_weights, int64_t num_tokens,
                                           uint16_t* output, void* stream, int64_t timeout_ms);

/* The sync point of the GPU data calls: waits (host) for the work they
 * enqueued on the worker's stream, at most the group's timeout, and reports
 * the first (epoch, R) disagreement the device-side check recorded since the
 * last call (MOE_EP_ABORTED naming the rank; when R differed the
 * communicator is aborted too: re-form the group) or a peer's refused
 * dispatch or combine (MOE_EP_ABORTED "rank r refused its dispatch (or:
 * its combine) of the step at epoch e ..."; the group stays usable; see the
 * top and moe_ep_combine), else the first expert
 * id out of range the route kernel saw (MOE_EP_INVALID_ARGUMENT
 * "topk_ids[row t, choice k] = id: outside [0, E) ... (n ids out of range;
 * found on the device by rank r's step: those choices selected no
 * expert ...)"; on that rank only, the group stays usable; DESIGN §7,
 * issue 30). Each record is reported once. Not capturable. On gloo the
 * checks are synchronous: MOE_EP_OK. Errors: MOE_EP_ABORTED,
 * MOE_EP_INVALID_ARGUMENT,
 * MOE_EP_DEADLINE_EXCEEDED (a peer did not take part; the group is broken),
 * MOE_EP_FAILED_PRECONDITION (no workspace / group broken). */
MOE_EP_EXPORT moe_ep_status moe_ep_check_step(moe_ep_worker* worker, int64_t timeout_ms);

/* The token of the workspace the data calls run on now (never 0 once
 * allocated): record it when capturing a CUDA graph of data calls.
 * Errors: MOE_EP_INVALID_ARGUMENT (NULL), MOE_EP_FAILED_PRECONDITION (no
 * workspace / group broken). */
MOE_EP_EXPORT moe_ep_status moe_ep_graph_token(moe_ep_worker* worker, uint64_t* token);

/* Before replaying a graph captured under `token`: MOE_EP_OK when the
 * workspace is still the one it captured, MOE_EP_RECAPTURE when the group
 * re-formed or the workspace was re-allocated since (the graph's buffers
 * and communicator are gone: capture again, after a new commit of the
 * bucket). Cheap (no device work). Errors: MOE_EP_FAILED_PRECONDITION (no
 * workspace yet / group broken: do not replay), MOE_EP_INVALID_ARGUMENT. */
MOE_EP_EXPORT moe_ep_status moe_ep_check_graph(moe_ep_worker* worker, uint64_t token);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_EP_H_ */
