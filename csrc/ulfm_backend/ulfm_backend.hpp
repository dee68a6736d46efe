// ProcessGroupULFM: a torch.distributed backend whose collectives survive the death of peers.
//
// Contract (every operation: allreduce, broadcast, allgather, barrier, consensus):
//  * An operation either completes over the current membership, or completes with a
//    FailureRecord. It never throws because of an MPI error and never blocks forever on a dead
//    peer: any error on the communicator (not only PROC_FAILED/REVOKED) is treated as a possible
//    failure. Before the Work completes with a record the communicator has been revoked,
//    acknowledged, shrunk to the survivors and validated, and the epoch advanced by exactly one.
//  * A Work with a record carries no result the caller may trust (an in-place buffer may hold a
//    partial reduction); the caller rewinds from its own snapshot and tries again.
//  * Outcomes of one operation may differ across survivors. consensus(census) turns them into one
//    agreed record: every survivor receives the same failed ranks (since the last consensus), the
//    same size and epoch, and the element-wise sum of the callers' census vectors.
//  * Operations run in submission order on one worker thread per group, so Python can overlap
//    them with compute; Work.wait(timeout) raises instead of blocking past the timeout.
//  * Fail-stop for stock callers: an operation entered through torch.distributed (the c10d
//    overrides: dist.all_reduce, dist.broadcast, ... on the group) that sees a failure still
//    repairs the group, then completes with an error, so wait() raises as it would on gloo and a
//    stock job over ulfm stops like a stock gloo job. The typed entry points below (the
//    recovery layer's) complete with the record instead.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mpi.h>

#include "staging.hpp"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ulfm {

// The MPI datatype and reduction of a SUM over one torch dtype.
struct SumSpec {
  MPI_Datatype type;
  MPI_Op op;
};

struct FailureRecord {
  std::vector<int64_t> failed_ranks;  // world ranks, ascending
  int64_t size = 0;                   // membership after the operation
  int64_t rank = 0;                   // this process's rank in it
  int64_t epoch = 0;                  // group epoch after the operation
  bool repaired = false;              // this operation revoked and shrank the communicator
  std::vector<int64_t> census;        // consensus only: element-wise sum over survivors
  double started_s = 0.0;             // wall clock (s) when the worker thread began it
  double finished_s = 0.0;            // and when it was done with it
};

// Test-only fault injection: SIGKILL or SIGSTOP this process (or delay it) at a named point.
// "reduce"/"consensus": after the non-blocking MPI call was posted; "shrink": while the shrink is
// in progress (from a timer thread, the call being blocking); "broadcast-chunk"/"allgather-chunk":
// between two chunks of one transfer, before the next is posted; the other points on entry to
// the operation. The victim appends a JSON marker
// line to `marker_path` right before it dies, so tests count kills that really happened.
struct FaultArm {
  std::string point;
  int64_t occurrence = 1;  // 1 = the first time the point is reached
  std::string action;      // "kill", "stop" (SIGSTOP: a frozen process) or "delay"
  double delay_s = 0.0;    // kill: time after posting; delay: sleep before entering
  std::string marker_path;
  std::string marker_fields;  // extra JSON members for the marker, e.g. "\"iteration\": 3"
};

class WorkULFM : public c10d::Work {
 public:
  WorkULFM(c10d::OpType type, std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout,
           bool fail_stop);

  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  bool has_failure() const;
  FailureRecord record() const;  // valid once completed

  // `written`: the staged results' copies to the device still in flight (staging.hpp);
  // wait() makes the caller's current stream wait for them.
  void complete(const FailureRecord* record, std::exception_ptr error,
                std::vector<Fence> written = {});

 private:
  std::vector<at::Tensor> outputs_;
  std::vector<Fence> written_;
  std::chrono::milliseconds default_timeout_;
  bool fail_stop_;  // a failure completes the Work with an error (torch.distributed callers)
  bool failed_ = false;
  FailureRecord record_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class ProcessGroupULFM;

struct GroupOptions {
  std::vector<int64_t> world_ranks;  // members, in group-rank order
  std::string name;
  std::chrono::milliseconds timeout;
  // Split from this group's communicator instead of creating one over MPI_COMM_WORLD, which
  // fails while the world holds a dead rank. Collective over the parent's members, each
  // splitting off its own group at once (the groups so made are disjoint); the parent has no
  // operation in flight, and its members are the live ones (a consensus on it repaired it).
  ProcessGroupULFM* parent = nullptr;
  // Or duplicate this communicator (an MPI_Comm handle, as mpi4py gives it), whose members are
  // exactly `world_ranks` in this order; collective over them.
  int64_t duplicate = 0;
};

class ProcessGroupULFM : public c10d::Backend {
 public:
  explicit ProcessGroupULFM(GroupOptions options);
  ~ProcessGroupULFM() override;

  const std::string getBackendName() const override { return "ulfm"; }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // torch's gather and scatter (gather_object, scatter_object_list: megatron-core's
  // distributed checkpoints plan and finalize with them), as an all-gather of which the root
  // keeps the rows, and a broadcast of the root's rows of which each member keeps its own.
  // For small messages: every member moves size() x the input.
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;

  // Typed entry points for megatron_recover.collective (they return WorkULFM).
  c10::intrusive_ptr<WorkULFM> allreduce_sum(at::Tensor tensor);
  c10::intrusive_ptr<WorkULFM> broadcast_from(at::Tensor tensor, int64_t root_world_rank);
  c10::intrusive_ptr<WorkULFM> allgather_into(at::Tensor output, at::Tensor input);
  c10::intrusive_ptr<WorkULFM> barrier_ft();
  c10::intrusive_ptr<WorkULFM> consensus(std::vector<int64_t> census);
  // Grow back: replace this group's communicator by `grown` (an MPI_Comm handle built by the
  // caller over the live members plus joiners, e.g. MPIX_Comm_shrink of a pool communicator
  // then MPI_Comm_split). Collective over `grown`'s members, each from its own group (a joiner
  // from the one-member group it waited in). The Work's record says whether it took: census
  // [1] when every member of `grown` validated it (agreed, so uniform), the epoch then one past
  // the largest member's; census [0] otherwise, with `grown` revoked and this group unchanged.
  c10::intrusive_ptr<WorkULFM> adopt(int64_t grown_handle);

  int64_t epoch() const;
  int64_t current_size() const;
  int64_t current_rank() const;
  std::vector<int64_t> members() const;  // world ranks of the current membership

  // Follow every data operation with an agreement on its outcome, so all survivors report a
  // failure from the same operation. Costs one MPIX_Comm_agree per call; off by default, when
  // the per-iteration consensus makes outcomes uniform instead. Set it on every member alike.
  void set_agree_each_op(bool on) { agree_each_op_ = on; }

  // The most bytes one MPI call of a broadcast or all-gather moves (default 1 GiB, under the C
  // int counts of MPI); larger transfers run as consecutive calls of at most this many bytes,
  // each preceded by fault point "<op>-chunk" (the second chunk on). Set it on every member
  // alike: members with different sizes would post mismatched calls. Tests lower it to cross
  // chunk boundaries with small tensors.
  void set_max_chunk_bytes(int64_t bytes);

  // Staging (staging.hpp). `set_stage_host`: stage CPU tensors through the host buffer pool as
  // CUDA tensors are (tests run the staged path on CPU with it). `set_direct_device`: hand CUDA
  // tensors' device memory to MPI, except 16-bit sums; refused unless the MPI is CUDA-aware.
  // Both apply to operations submitted afterwards.
  void set_stage_host(bool on);
  void set_direct_device(bool on);
  std::map<std::string, int64_t> staging_stats() const;  // the buffer pool's counters

  void arm_fault(FaultArm arm);
  int64_t fault_hits(const std::string& point);  // times `point` was reached so far

 private:
  using Body = std::function<int(MPI_Comm)>;
  struct Task {
    c10::intrusive_ptr<WorkULFM> work;
    Stages stages;  // made ready before `run`, written back after its success, then finished
    std::function<void(FailureRecord*)> run;
  };

  // `fail_stop`: the caller came through torch.distributed (see the contract above).
  c10::intrusive_ptr<WorkULFM> enqueue_allreduce(c10d::OpType type,
                                                 const std::vector<at::Tensor>& tensors,
                                                 bool fail_stop);
  // `keep`: a scatter's output, which takes this member's row of the broadcast `tensor`.
  c10::intrusive_ptr<WorkULFM> enqueue_broadcast(at::Tensor tensor, int64_t root_world_rank,
                                                 bool fail_stop, at::Tensor keep = {});
  c10::intrusive_ptr<WorkULFM> enqueue_barrier(bool fail_stop);
  int reduce_in_place(const at::Tensor& host, const SumSpec& spec, MPI_Comm comm, bool inject);
  c10::intrusive_ptr<WorkULFM> enqueue_allgather(at::Tensor output, at::Tensor input,
                                                 std::vector<at::Tensor> rows, bool fail_stop);
  c10::intrusive_ptr<WorkULFM> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                       bool fail_stop, Stages stages,
                                       std::function<void(FailureRecord*)> run);
  StagingContext staging();
  void worker_loop();

  // Runs `body` on the communicator; on any error repairs and fills `record`.
  void run_data_op(const char* point, const Body& body, FailureRecord* record);
  void run_consensus(std::vector<int64_t>& census, FailureRecord* record);
  void run_adopt(MPI_Comm grown, FailureRecord* record);
  void repair(FailureRecord* record);
  bool validate(MPI_Comm comm);
  void refresh_members_locked();
  void fill_membership(FailureRecord* record);

  bool kill_pending_at(const std::string& point);
  void fault_enter(const std::string& point);
  void fault_posted(const std::string& point);

  GroupOptions options_;
  std::atomic<bool> agree_each_op_{false};
  std::atomic<int64_t> max_chunk_bytes_{int64_t(1) << 30};
  MPI_Comm comm_ = MPI_COMM_NULL;  // touched only by the worker thread after construction

  HostBufferPool pool_;
  std::atomic<bool> force_host_{false};
  std::atomic<bool> direct_{false};
  std::mutex streams_mutex_;
  std::map<c10::DeviceIndex, std::pair<c10::Stream, c10::Stream>> streams_;  // in, write-back

  mutable std::mutex state_mutex_;   // guards the membership fields below
  std::vector<int64_t> members_;
  std::vector<int64_t> members_at_consensus_;
  int64_t epoch_ = 0;
  int64_t rank_in_comm_ = 0;

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::thread worker_;

  std::mutex fault_mutex_;
  std::vector<FaultArm> arms_;
  std::map<std::string, int64_t> hits_;
  bool has_pending_kill_ = false;
  FaultArm pending_kill_;
};

// True when this MPI job runs with fault tolerance on (mpirun --with-ft ulfm).
bool fault_tolerance_enabled();

// Test-only: what the main thread is doing (e.g. "schedule" while megatron's forward/backward
// runs), written into a fault's marker as "phase" when the victim dies on a worker thread.
void set_fault_phase(std::string phase);

}  // namespace ulfm
