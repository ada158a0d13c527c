#include "client/local_cluster.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/targets.h"
#include "core/status_macros.h"

namespace moe_ep::client {
namespace {

constexpr absl::string_view kListeningPrefix = "moe-ep-worker listening on ";

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::set<LocalCluster*>& Registry() {
  static std::set<LocalCluster*> live;
  return live;
}

// Writes all of `data` to `fd`, retrying on EINTR and short writes.
void WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // the sink is gone; worker output is best effort
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void DrainTo(int from_fd, int to_fd) {
  char buf[4096];
  while (true) {
    const ssize_t n = read(from_fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    WriteAll(to_fd, buf, static_cast<size_t>(n));
  }
}

}  // namespace

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("wait status ", status);
}

absl::StatusOr<std::string> DefaultWorkerBinary() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot read /proc/self/exe: ", ec.message(), "; pass --worker-binary"));
  }
  return (self.parent_path() / "moe-ep-worker").string();
}

absl::StatusOr<std::string> ParseListeningLine(const std::string& line) {
  absl::string_view text = absl::StripTrailingAsciiWhitespace(line);
  if (!absl::ConsumePrefix(&text, kListeningPrefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected '", kListeningPrefix, "HOST:PORT', got '", line, "'"));
  }
  auto hp = SplitHostPort(text);
  if (!hp.ok()) return hp.status();
  return std::string(text);
}

int CountLocalGpus(const std::string& dev_dir, const char* cuda_visible_devices) {
  int nodes = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dev_dir, error)) {
    const std::string name = entry.path().filename().string();
    absl::string_view rest = name;
    if (absl::ConsumePrefix(&rest, "nvidia") && !rest.empty() &&
        std::all_of(rest.begin(), rest.end(), absl::ascii_isdigit)) {
      ++nodes;
    }
  }
  if (error || cuda_visible_devices == nullptr) return error ? 0 : nodes;
  int visible = 0;
  for (absl::string_view entry : absl::StrSplit(cuda_visible_devices, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    int index = -1;
    const bool uuid = absl::StartsWith(entry, "GPU-") || absl::StartsWith(entry, "MIG-");
    if (!uuid && !(absl::SimpleAtoi(entry, &index) && index >= 0 && index < nodes)) break;
    ++visible;
  }
  return std::min(visible, nodes);
}

int CountLocalGpus() { return CountLocalGpus("/dev", getenv("CUDA_VISIBLE_DEVICES")); }

void UseOneWorkerPerGpu(int num_gpus, LocalClusterOptions* options) {
  options->num_workers = num_gpus;
  options->backend = "nccl";
  options->per_worker_args.assign(num_gpus, {});
  for (int i = 0; i < num_gpus; ++i) {
    options->per_worker_args[i].push_back(absl::StrCat("--device=", i));
  }
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(
    const LocalClusterOptions& options) {
  if (options.num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers: expected >= 1, got ", options.num_workers));
  }
  if (options.backend.empty()) return absl::InvalidArgumentError("--backend: empty");
  if (!options.per_worker_args.empty() &&
      static_cast<int>(options.per_worker_args.size()) != options.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("per_worker_args: expected ", options.num_workers,
                     " lists (one per worker), got ", options.per_worker_args.size()));
  }
  std::string binary = options.worker_binary;
  if (binary.empty()) {
    ASSIGN_OR_RETURN(binary, DefaultWorkerBinary());
  }
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("worker binary '", binary,
                                            "' is missing or not executable (", strerror(errno),
                                            "); build moe-ep-worker or pass --worker-binary"));
  }
  std::unique_ptr<LocalCluster> cluster(new LocalCluster(options));
  cluster->binary_ = binary;
  cluster->workers_.resize(options.num_workers);
  cluster->targets_.resize(options.num_workers);
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry().insert(cluster.get());
  }
  std::vector<int> all;
  for (int i = 0; i < options.num_workers; ++i) {
    absl::Status s = cluster->Spawn(i, "127.0.0.1:0", /*append_log=*/false);
    if (!s.ok()) return s;  // the destructor stops the workers started so far
    all.push_back(i);
  }
  RETURN_IF_ERROR(cluster->ReadAddresses(all));
  return cluster;
}

absl::Status LocalCluster::Restart(int index) {
  if (index < 0 || index >= num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker index: expected 0..", num_workers() - 1, ", got ", index));
  }
  std::thread drain;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Worker& w = workers_[index];
    ReapLocked(w, false);
    if (!w.reaped && w.pid > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", index, " (pid ", w.pid, ") is still running"));
    }
    drain = std::move(w.drain);
  }
  // Its output thread ends at the pipe's EOF (it tries mu_, never blocks on it).
  if (drain.joinable()) drain.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Worker& w = workers_[index];
    if (w.stdout_fd >= 0) close(w.stdout_fd);
    if (w.owns_log_fd && w.log_fd >= 0) close(w.log_fd);
    w = Worker();
  }
  RETURN_IF_ERROR(Spawn(index, targets_[index], /*append_log=*/true));
  return ReadAddresses({index});
}

absl::Status LocalCluster::Spawn(int index, const std::string& listen, bool append_log) {
  Worker& w = workers_[index];
  if (!options_.log_dir.empty()) {
    const std::string path = absl::StrCat(options_.log_dir, "/worker-", index, ".log");
    w.log_fd = open(path.c_str(),
                    O_WRONLY | O_CREAT | (append_log ? O_APPEND : O_TRUNC) | O_CLOEXEC, 0644);
    if (w.log_fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("--log-dir: cannot write '", path, "': ", strerror(errno)));
    }
    w.owns_log_fd = true;
  } else {
    w.log_fd = STDERR_FILENO;
  }
  // Everything the child needs is prepared before fork: after it, only
  // async-signal-safe calls (this process has gRPC threads).
  std::vector<std::string> args = {binary_, absl::StrCat("--listen=", listen),
                                   absl::StrCat("--backend=", options_.backend)};
  for (const std::string& a : options_.extra_args) args.push_back(a);
  if (!options_.per_worker_args.empty()) {
    for (const std::string& a : options_.per_worker_args[index]) args.push_back(a);
  }
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2 for worker ", index, ": ", strerror(errno)));
  }
  const pid_t parent = getpid();
  const int log_fd = w.log_fd;
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(pipefd[0]);
    close(pipefd[1]);
    return absl::InternalError(absl::StrCat("fork for worker ", index, ": ", strerror(err)));
  }
  if (pid == 0) {
    // Child: die with the parent, own process group (a terminal Ctrl-C reaches
    // only the CLI, which then stops the workers in order), default signal
    // handling and an empty mask (the CLI blocks SIGINT/SIGTERM for its
    // signal thread, and masks are inherited across exec).
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    setpgid(0, 0);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigset_t empty;
    sigemptyset(&empty);
    sigprocmask(SIG_SETMASK, &empty, nullptr);
    dup2(pipefd[1], STDOUT_FILENO);
    if (log_fd != STDERR_FILENO) dup2(log_fd, STDERR_FILENO);
    execv(argv[0], argv.data());
    const char msg[] = "moe-ep: exec of moe-ep-worker failed\n";
    WriteAll(STDERR_FILENO, msg, sizeof(msg) - 1);
    _exit(127);
  }
  close(pipefd[1]);
  std::lock_guard<std::mutex> lock(mu_);
  w.pid = pid;
  w.stdout_fd = pipefd[0];
  return absl::OkStatus();
}

absl::Status LocalCluster::ReadAddresses(const std::vector<int>& indices) {
  const int n = num_workers();
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  std::vector<std::string> buffers(n);
  std::vector<bool> done(n, true);
  for (int i : indices) done[i] = false;
  int remaining = static_cast<int>(indices.size());
  while (remaining > 0) {
    std::vector<pollfd> fds;
    std::vector<int> index_of;
    for (int i = 0; i < n; ++i) {
      if (done[i]) continue;
      fds.push_back(pollfd{workers_[i].stdout_fd, POLLIN, 0});
      index_of.push_back(i);
    }
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) {
      std::string which;
      for (int i = 0; i < n; ++i) {
        if (!done[i]) absl::StrAppend(&which, which.empty() ? "" : ", ", i);
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "worker(s) ", which, " printed no '", kListeningPrefix, "HOST:PORT' line within ",
          absl::FormatDuration(options_.start_timeout), " (binary ", binary_, ")"));
    }
    const int rc = poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(left_ms, 1000)));
    if (rc < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("poll on worker output: ", strerror(errno)));
    }
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      const int i = index_of[k];
      Worker& w = workers_[i];
      char buf[4096];
      const ssize_t got = read(w.stdout_fd, buf, sizeof(buf));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        // EOF: the worker exited (or closed stdout) before announcing itself.
        std::lock_guard<std::mutex> lock(mu_);
        for (int tries = 0; tries < 100 && !w.reaped; ++tries) {
          ReapLocked(w, /*block=*/false);
          if (!w.reaped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        return absl::UnavailableError(absl::StrCat(
            "worker ", i, " (pid ", w.pid, ") ",
            w.reaped ? absl::StrCat("exited with ", DescribeWaitStatus(w.wait_status))
                     : std::string("closed its stdout"),
            " before printing its address; see its output",
            options_.log_dir.empty() ? " above" : absl::StrCat(" in ", options_.log_dir)));
      }
      buffers[i].append(buf, static_cast<size_t>(got));
      size_t newline;
      while (!done[i] && (newline = buffers[i].find('\n')) != std::string::npos) {
        std::string line = buffers[i].substr(0, newline);
        buffers[i].erase(0, newline + 1);
        auto address = ParseListeningLine(line);
        if (address.ok()) {
          targets_[i] = *address;
          done[i] = true;
          --remaining;
        } else {
          line.push_back('\n');
          WriteAll(w.log_fd, line.data(), line.size());
        }
      }
    }
  }
  // From here on the workers' stdout only carries logs.
  for (int i : indices) {
    Worker& w = workers_[i];
    if (!buffers[i].empty()) WriteAll(w.log_fd, buffers[i].data(), buffers[i].size());
    w.drain = std::thread(&LocalCluster::DrainAndWatch, this, i, w.stdout_fd, w.log_fd);
  }
  return absl::OkStatus();
}

pid_t LocalCluster::pid(int index) const { return workers_.at(index).pid; }

void LocalCluster::DrainAndWatch(int index, int stdout_fd, int log_fd) {
  // The descriptors come as arguments: Stop() may hold mu_ (and join this
  // thread) before the thread first runs.
  DrainTo(stdout_fd, log_fd);
  // EOF: the worker died (or closed its stdout). Stop() holds mu_ while it
  // joins this thread, so never block on mu_: try it, and give up as soon
  // as the cluster is stopping (that exit is expected).
  WorkerExit exit;
  for (int tries = 0; tries < 500 && exit.index < 0; ++tries) {
    if (stopping_.load()) return;
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (lock.owns_lock()) {
      Worker& w = workers_[index];
      ReapLocked(w, /*block=*/false);
      if (w.reaped && !w.reported) {
        w.reported = true;
        exit.index = index;
        exit.pid = w.pid;
        exit.target = targets_[index];
        exit.wait_status = w.wait_status;
        exit.sent_by_us = w.signal_sent != 0 && WIFSIGNALED(w.wait_status) &&
                          WTERMSIG(w.wait_status) == w.signal_sent;
      } else if (w.reported) {
        return;
      }
    }
    if (exit.index < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (exit.index < 0) return;  // stdout closed but the process lives on
  const std::string how = WIFSIGNALED(exit.wait_status)
                              ? absl::StrCat("was killed by ", DescribeWaitStatus(exit.wait_status))
                              : absl::StrCat("exited with ", DescribeWaitStatus(exit.wait_status));
  exit.description =
      absl::StrCat("worker ", index, " (pid ", exit.pid, exit.target.empty() ? "" : ", ",
                   exit.target, ") ", how, exit.sent_by_us ? " (sent by moe-ep)" : "",
                   options_.log_dir.empty()
                       ? ""
                       : absl::StrCat("; its log: ", options_.log_dir, "/worker-", index, ".log"));
  Report(std::move(exit));
}

void LocalCluster::Report(WorkerExit exit) {
  if (options_.on_exit) {
    options_.on_exit(exit);
  } else {
    const std::string line = absl::StrCat("moe-ep: ", exit.description, "\n");
    WriteAll(STDERR_FILENO, line.data(), line.size());
  }
  std::lock_guard<std::mutex> lock(exits_mu_);
  exits_.push_back(std::move(exit));
  exits_cv_.notify_all();
}

std::vector<WorkerExit> LocalCluster::Exits() {
  std::lock_guard<std::mutex> lock(exits_mu_);
  return exits_;
}

absl::StatusOr<WorkerExit> LocalCluster::WaitForExit(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(exits_mu_);
  if (!exits_cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout),
                          [this] { return !exits_.empty(); })) {
    return absl::DeadlineExceededError(
        absl::StrCat("no worker exited within ", absl::FormatDuration(timeout)));
  }
  return exits_.front();
}

void LocalCluster::ReapLocked(Worker& w, bool block) {
  if (w.reaped || w.pid <= 0) return;
  int status = 0;
  pid_t r;
  do {
    r = waitpid(w.pid, &status, block ? 0 : WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == w.pid || (r < 0 && errno == ECHILD)) {
    w.reaped = true;
    w.wait_status = status;
  }
}

absl::Status LocalCluster::StopLocked() {
  for (Worker& w : workers_) {
    ReapLocked(w, false);
    if (!w.reaped && w.pid > 0) kill(w.pid, SIGTERM);
  }
  const absl::Time deadline = absl::Now() + options_.stop_timeout;
  while (true) {
    bool all = true;
    for (Worker& w : workers_) {
      ReapLocked(w, false);
      all = all && (w.reaped || w.pid <= 0);
    }
    if (all || absl::Now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  int killed = 0;
  for (Worker& w : workers_) {
    if (!w.reaped && w.pid > 0) {
      kill(w.pid, SIGKILL);
      ReapLocked(w, true);
      ++killed;
    }
  }
  for (Worker& w : workers_) {
    if (w.drain.joinable()) w.drain.join();
    if (w.stdout_fd >= 0) close(w.stdout_fd);
    w.stdout_fd = -1;
    if (w.owns_log_fd && w.log_fd >= 0) close(w.log_fd);
    w.log_fd = -1;
    w.owns_log_fd = false;
  }
  if (killed > 0) {
    return absl::DeadlineExceededError(absl::StrCat(killed, " worker(s) ignored SIGTERM for ",
                                                    absl::FormatDuration(options_.stop_timeout),
                                                    " and were killed"));
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::Stop() {
  stopping_.store(true);
  std::lock_guard<std::mutex> lock(mu_);
  return StopLocked();
}

absl::Status LocalCluster::Kill(int index, int signo) {
  if (index < 0 || index >= num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker index: expected 0..", num_workers() - 1, ", got ", index));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Worker& w = workers_[index];
  ReapLocked(w, false);
  if (w.reaped || w.pid <= 0) {
    return absl::NotFoundError(absl::StrCat("worker ", index, " has already exited"));
  }
  w.signal_sent = signo;
  if (kill(w.pid, signo) != 0) {
    return absl::InternalError(absl::StrCat("kill(", w.pid, ", ", signo, "): ", strerror(errno)));
  }
  if (signo == SIGKILL) ReapLocked(w, true);
  return absl::OkStatus();
}

bool LocalCluster::IsRunning(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  Worker& w = workers_.at(index);
  ReapLocked(w, false);
  return w.pid > 0 && !w.reaped;
}

absl::StatusOr<int> LocalCluster::WaitStatus(int index) {
  if (index < 0 || index >= num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker index: expected 0..", num_workers() - 1, ", got ", index));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Worker& w = workers_[index];
  ReapLocked(w, false);
  if (!w.reaped) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", index, " (pid ", w.pid, ") is still running"));
  }
  return w.wait_status;
}

void LocalCluster::StopAll() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (LocalCluster* cluster : Registry()) (void)cluster->Stop();
}

LocalCluster::~LocalCluster() {
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry().erase(this);
  }
  (void)Stop();
}

}  // namespace moe_ep::client
