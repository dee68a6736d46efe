// ProcessGroupULFM implementation. See ulfm_backend.hpp for the contract, and
// docs/ulfm-behaviour.md for the measured MPI behaviour every branch below is written against
// ("Revoke and shrink", "Outcomes are not uniform").
#include "ulfm_backend.hpp"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <mpi-ext.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <csignal>
#include <fcntl.h>
#include <unistd.h>

namespace ulfm {
namespace {

// Largest element count handed to one MPI call (counts are C ints).
constexpr int64_t kMaxChunk = int64_t(1) << 30;
// A repair that cannot produce a validated communicator within this many shrinks is a bug or an
// MPI we do not understand: fail the operation loudly rather than loop.
constexpr int kMaxShrinkAttempts = 64;

double now_s() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// The MPI user op of a 16-bit all-reduce: inout[i] = round(float(in[i]) + float(inout[i])), each
// pairwise sum in fp32 and rounded once to the 16-bit type (round to nearest even), as torch's
// own add of two bf16 or fp16 tensors. ATen's CPU add kernel does exactly that with SIMD (the
// element-wise conversion loop it replaces ran at a fraction of memory speed); it runs on the
// thread MPI calls the op from, one ATen thread (the launcher sets OMP_NUM_THREADS=1).
template <at::ScalarType kType>
void sum_as_float(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto options = at::TensorOptions().dtype(kType).device(at::kCPU);
  at::Tensor a = at::from_blob(in, {int64_t(*len)}, options);
  at::Tensor b = at::from_blob(inout, {int64_t(*len)}, options);
  b.add_(a);
}

// MPI has no 16-bit float types or sums: one 2-byte type and a user op per format, created once.
struct HalfTypes {
  MPI_Datatype type16 = MPI_DATATYPE_NULL;
  MPI_Op sum_bf16 = MPI_OP_NULL;
  MPI_Op sum_fp16 = MPI_OP_NULL;
};

const HalfTypes& half_types() {
  static HalfTypes types = [] {
    HalfTypes t;
    MPI_Type_contiguous(2, MPI_BYTE, &t.type16);
    MPI_Type_commit(&t.type16);
    MPI_Op_create(&sum_as_float<at::kBFloat16>, /*commute=*/1, &t.sum_bf16);
    MPI_Op_create(&sum_as_float<at::kHalf>, /*commute=*/1, &t.sum_fp16);
    return t;
  }();
  return types;
}

SumSpec sum_spec(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return {MPI_FLOAT, MPI_SUM};
    case at::kDouble: return {MPI_DOUBLE, MPI_SUM};
    case at::kInt: return {MPI_INT32_T, MPI_SUM};
    case at::kLong: return {MPI_INT64_T, MPI_SUM};
    case at::kBFloat16: return {half_types().type16, half_types().sum_bf16};
    case at::kHalf: return {half_types().type16, half_types().sum_fp16};
    default:
      TORCH_CHECK_VALUE(false, "ulfm: all-reduce does not support dtype ", dtype,
                        " (supported: float32, float64, bfloat16, float16, int32, int64)");
  }
}

std::vector<int64_t> minus(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> out;
  for (int64_t x : a) {
    if (std::find(b.begin(), b.end(), x) == b.end()) out.push_back(x);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

bool fault_tolerance_enabled() {
  // Open MPI's runtime switch for ULFM is the MCA parameter mpi_ft_enable, which
  // `mpirun --with-ft ulfm` turns on; read it through the MPI tool interface.
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) return false;
  int index = -1;
  int enabled = 0;
  if (MPI_T_cvar_get_index("mpi_ft_enable", &index) == MPI_SUCCESS) {
    MPI_T_cvar_handle handle;
    int count = 0;
    if (MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) == MPI_SUCCESS) {
      MPI_T_cvar_read(handle, &enabled);
      MPI_T_cvar_handle_free(&handle);
    }
  }
  MPI_T_finalize();
  return enabled != 0;
}

// ------------------------------------------------------------------------------------ WorkULFM

WorkULFM::WorkULFM(c10d::OpType type, std::vector<at::Tensor> outputs,
                   std::chrono::milliseconds timeout, bool fail_stop)
    : c10d::Work(-1, type),
      outputs_(std::move(outputs)),
      default_timeout_(timeout),
      fail_stop_(fail_stop),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

bool WorkULFM::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool WorkULFM::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_ && !failed_;
}

bool WorkULFM::wait(std::chrono::milliseconds timeout) {
  const auto limit = timeout == kNoTimeout ? default_timeout_ : timeout;
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, limit, [&] { return completed_; })) {
    // The operation is still running on the worker thread; the group cannot be used until the
    // peer that stalls it is declared failed.
    C10_THROW_ERROR(DistBackendError,
                    "ulfm: " + c10d::opTypeToString(opType_) + " did not complete within " +
                        std::to_string(limit.count()) + " ms");
  }
  if (exception_) std::rethrow_exception(exception_);
  // The results' copies to the device are in flight: the caller's current stream waits for
  // them, its thread does not (as ProcessGroupNCCL's Work.wait()).
  for (const auto& fence : written_) {
    c10::impl::VirtualGuardImpl impl(fence->device_type());
    fence->block(impl.getStream(fence->device()));
  }
  return true;
}

std::vector<at::Tensor> WorkULFM::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkULFM::getFuture() {
  return future_;
}

bool WorkULFM::has_failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_;
}

FailureRecord WorkULFM::record() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return record_;
}

// What a torch.distributed caller gets instead of a record: the error gloo would raise, saying
// who failed and where the recovery API is.
static std::exception_ptr fail_stop_error(c10d::OpType type, const FailureRecord& record) {
  std::string ranks;
  for (auto r : record.failed_ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  try {
    C10_THROW_ERROR(DistBackendError,
                    "ulfm: " + c10d::opTypeToString(type) + " failed: a peer died (world ranks [" +
                        ranks + "]; the group was shrunk to " + std::to_string(record.size) +
                        " members, epoch " + std::to_string(record.epoch) +
                        "). A torch.distributed call on a ulfm group stops on failure like one "
                        "on gloo; megatron_recover.collective.ULFMGroup returns the failure "
                        "record instead");
  } catch (...) {
    return std::current_exception();
  }
}

void WorkULFM::complete(const FailureRecord* record, std::exception_ptr error,
                        std::vector<Fence> written) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    written_ = std::move(written);
    if (record != nullptr) {
      record_ = *record;
      failed_ = record->repaired || !record->failed_ranks.empty();
    }
    if (failed_ && fail_stop_ && !error) error = fail_stop_error(opType_, record_);
    exception_ = error;
    completed_ = true;
  }
  cv_.notify_all();
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

// ---------------------------------------------------------------------------- ProcessGroupULFM

ProcessGroupULFM::ProcessGroupULFM(GroupOptions options)
    : c10d::Backend(
          [&] {
            auto it = std::find(options.world_ranks.begin(), options.world_ranks.end(),
                                world_rank());
            TORCH_CHECK(it != options.world_ranks.end(), "ulfm: this rank is not a member");
            return int(it - options.world_ranks.begin());
          }(),
          int(options.world_ranks.size())),
      options_(std::move(options)) {
  TORCH_CHECK(fault_tolerance_enabled(),
              "ulfm: MPI fault tolerance is off. Launch with `mpirun --with-ft ulfm ...` "
              "(or `megatron-recover launch`), using an Open MPI 5 built with ULFM.");
  if (options_.duplicate != 0) {
    MPI_Comm source = reinterpret_cast<MPI_Comm>(static_cast<intptr_t>(options_.duplicate));
    const int rc = MPI_Comm_dup(source, &comm_);
    TORCH_CHECK(rc == MPI_SUCCESS && comm_ != MPI_COMM_NULL,
                "ulfm: MPI_Comm_dup failed for group ", options_.name);
  } else if (options_.parent != nullptr) {
    // One color per group (its first member), ordered as its ranks are.
    const int color = int(*std::min_element(options_.world_ranks.begin(),
                                            options_.world_ranks.end()));
    const int rc = MPI_Comm_split(options_.parent->comm_, color, getRank(), &comm_);
    options_.parent = nullptr;
    TORCH_CHECK(rc == MPI_SUCCESS && comm_ != MPI_COMM_NULL,
                "ulfm: MPI_Comm_split failed for group ", options_.name);
  } else {
    MPI_Group world_group, group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    std::vector<int> ranks(options_.world_ranks.begin(), options_.world_ranks.end());
    MPI_Group_incl(world_group, int(ranks.size()), ranks.data(), &group);
    // Collective over the members only; members create their groups in the same order, so a
    // tag derived from the group's name keeps concurrent creations of disjoint groups apart.
    const int tag = int(std::hash<std::string>{}(options_.name) % 32768);
    int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &comm_);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    TORCH_CHECK(rc == MPI_SUCCESS && comm_ != MPI_COMM_NULL,
                "ulfm: MPI_Comm_create_group failed for group ", options_.name);
  }
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    refresh_members_locked();
    members_at_consensus_ = members_;
  }
  worker_ = std::thread(&ProcessGroupULFM::worker_loop, this);
}

ProcessGroupULFM::~ProcessGroupULFM() {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  // The communicator is not freed: after a failure MPI_Comm_free may wait on dead peers, and
  // groups live until the process exits anyway.
}

int64_t ProcessGroupULFM::epoch() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return epoch_;
}

int64_t ProcessGroupULFM::current_size() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return int64_t(members_.size());
}

int64_t ProcessGroupULFM::current_rank() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return rank_in_comm_;
}

std::vector<int64_t> ProcessGroupULFM::members() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return members_;
}

void ProcessGroupULFM::refresh_members_locked() {
  MPI_Group group, world_group;
  MPI_Comm_group(comm_, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  int n = 0;
  MPI_Group_size(group, &n);
  std::vector<int> local(n), global(n);
  for (int i = 0; i < n; ++i) local[i] = i;
  MPI_Group_translate_ranks(group, n, local.data(), world_group, global.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  members_.assign(global.begin(), global.end());
  int r = 0;
  MPI_Comm_rank(comm_, &r);
  rank_in_comm_ = r;
}

void ProcessGroupULFM::fill_membership(FailureRecord* record) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  record->size = int64_t(members_.size());
  record->rank = rank_in_comm_;
  record->epoch = epoch_;
}

// ------------------------------------------------------------------------------------- worker

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::enqueue(
    c10d::OpType type, std::vector<at::Tensor> outputs, bool fail_stop, Stages stages,
    std::function<void(FailureRecord*)> run) {
  auto work = c10::make_intrusive<WorkULFM>(type, std::move(outputs), options_.timeout,
                                            fail_stop);
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    TORCH_CHECK(!stopping_, "ulfm: group ", options_.name, " is shut down");
    queue_.push_back(Task{work, std::move(stages), std::move(run)});
  }
  queue_cv_.notify_one();
  return work;
}

void ProcessGroupULFM::worker_loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    FailureRecord record;
    std::exception_ptr error;
    record.started_s = now_s();
    try {
      for (auto& stage : task.stages) {
        if (stage->device().is_cuda()) {
          // This thread's event waits and copies then run on the tensors' device (a CUDA call
          // on another device, the default 0, would open a context there).
          c10::impl::VirtualGuardImpl(stage->device().type()).setDevice(stage->device());
          break;
        }
      }
      for (auto& stage : task.stages) stage->ready();
      task.run(&record);
      // Only a success writes staged results back: a failed operation leaves a staged tensor
      // as the caller had it (an unstaged one may hold a partial result, see the contract).
      if (!record.repaired) {
        for (auto& stage : task.stages) stage->write_back();
      }
    } catch (...) {
      error = std::current_exception();
    }
    std::vector<Fence> written;
    for (auto& stage : task.stages) {
      if (Fence fence = stage->finish()) written.push_back(std::move(fence));
    }
    record.finished_s = now_s();
    fill_membership(&record);
    task.work->complete(&record, error, std::move(written));
  }
}

void ProcessGroupULFM::run_data_op(const char* point, const Body& body, FailureRecord* record) {
  fault_enter(point);
  int rc = body(comm_);
  if (agree_each_op_) {
    // Agreement is uniform: every survivor takes the same branch below, so all of them report
    // the failure from this very operation.
    int flag = rc == MPI_SUCCESS ? 1 : 0;
    int arc = MPIX_Comm_agree(comm_, &flag);
    if (arc != MPI_SUCCESS || flag == 0) rc = arc != MPI_SUCCESS ? arc : MPI_ERR_OTHER;
  }
  if (rc != MPI_SUCCESS) repair(record);
}

void ProcessGroupULFM::repair(FailureRecord* record) {
  std::vector<int64_t> before;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    before = members_;
  }
  MPIX_Comm_revoke(comm_);
  int acked = 0;
  MPIX_Comm_ack_failed(comm_, int(before.size()), &acked);
  for (int attempt = 0;; ++attempt) {
    TORCH_CHECK(attempt < kMaxShrinkAttempts, "ulfm: group ", options_.name,
                " could not be repaired after ", kMaxShrinkAttempts, " shrinks");
    fault_enter("shrink");
    MPI_Comm shrunk = MPI_COMM_NULL;
    int rc = MPIX_Comm_shrink(comm_, &shrunk);
    if (rc != MPI_SUCCESS || shrunk == MPI_COMM_NULL) continue;
    MPI_Comm_set_errhandler(shrunk, MPI_ERRORS_RETURN);
    // The previous communicator is revoked and abandoned (see the destructor on freeing).
    comm_ = shrunk;
    // Shrink can return a communicator that still holds a rank that died during the shrink.
    if (validate(comm_)) break;
    MPIX_Comm_revoke(comm_);
  }
  std::lock_guard<std::mutex> lock(state_mutex_);
  refresh_members_locked();
  epoch_ += 1;
  record->failed_ranks = minus(before, members_);
  record->repaired = true;
}

bool ProcessGroupULFM::validate(MPI_Comm comm) {
  int flag = 1;
  if (MPIX_Comm_agree(comm, &flag) != MPI_SUCCESS) return false;
  int size = 0, one = 1;
  MPI_Comm_size(comm, &size);
  int rc = MPI_Allreduce(MPI_IN_PLACE, &one, 1, MPI_INT, MPI_SUM, comm);
  flag = (rc == MPI_SUCCESS && one == size) ? 1 : 0;
  // Agreement makes the verdict uniform: no survivor keeps a communicator another one rejects.
  return MPIX_Comm_agree(comm, &flag) == MPI_SUCCESS && flag == 1;
}

void ProcessGroupULFM::run_consensus(std::vector<int64_t>& census, FailureRecord* record) {
  const std::vector<int64_t> contribution = census;
  int64_t max_epoch = 0;
  for (;;) {
    fault_enter("consensus");
    int flag = 1;
    int rc;
    if (kill_pending_at("consensus")) {
      MPI_Request request;
      rc = MPIX_Comm_iagree(comm_, &flag, &request);
      fault_posted("consensus");
      if (rc == MPI_SUCCESS) rc = MPI_Wait(&request, MPI_STATUS_IGNORE);
    } else {
      rc = MPIX_Comm_agree(comm_, &flag);
    }
    if (rc != MPI_SUCCESS) {
      repair(record);
      continue;
    }
    census = contribution;
    max_epoch = epoch();
    int rc_sum = census.empty() ? MPI_SUCCESS
                                : MPI_Allreduce(MPI_IN_PLACE, census.data(), int(census.size()),
                                                MPI_INT64_T, MPI_SUM, comm_);
    int rc_max = MPI_Allreduce(MPI_IN_PLACE, &max_epoch, 1, MPI_INT64_T, MPI_MAX, comm_);
    flag = (rc_sum == MPI_SUCCESS && rc_max == MPI_SUCCESS) ? 1 : 0;
    rc = MPIX_Comm_agree(comm_, &flag);
    if (rc == MPI_SUCCESS && flag == 1) break;
    repair(record);
  }
  std::lock_guard<std::mutex> lock(state_mutex_);
  // Survivors may have repaired a different number of times when outcomes were not uniform;
  // the agreed epoch is the largest, so every survivor leaves the consensus with the same one.
  epoch_ = std::max(epoch_, max_epoch);
  record->failed_ranks = minus(members_at_consensus_, members_);
  record->census = census;
  members_at_consensus_ = members_;
}

void ProcessGroupULFM::run_adopt(MPI_Comm grown, FailureRecord* record) {
  fault_enter("adopt");
  MPI_Comm_set_errhandler(grown, MPI_ERRORS_RETURN);
  int64_t max_epoch = epoch();
  int flag = MPI_Allreduce(MPI_IN_PLACE, &max_epoch, 1, MPI_INT64_T, MPI_MAX, grown) ==
             MPI_SUCCESS;
  // Agreement makes the outcome uniform over the grown membership: either every live member
  // installs `grown`, or none does and each keeps its own communicator.
  const bool took = MPIX_Comm_agree(grown, &flag) == MPI_SUCCESS && flag == 1;
  if (!took) {
    MPIX_Comm_revoke(grown);
    record->census = {0};
    return;
  }
  // The previous communicator is abandoned, as after a shrink (see the destructor).
  comm_ = grown;
  std::lock_guard<std::mutex> lock(state_mutex_);
  refresh_members_locked();
  epoch_ = max_epoch + 1;
  members_at_consensus_ = members_;
  record->census = {1};
}

// --------------------------------------------------------------------------------- operations

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::allreduce_sum(at::Tensor tensor) {
  std::vector<at::Tensor> tensors{tensor};
  return enqueue_allreduce(c10d::OpType::ALLREDUCE, tensors, false);
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::enqueue_allreduce(
    c10d::OpType type, const std::vector<at::Tensor>& tensors, bool fail_stop) {
  // One operation for all tensors: one failure record, one repair, however many tensors.
  std::vector<SumSpec> specs;
  Stages stages;
  for (const auto& tensor : tensors) {
    specs.push_back(sum_spec(tensor.scalar_type()));
    // A 16-bit sum's MPI operator runs on the host: never hand it device memory.
    stages.push_back(std::make_shared<Stage>(tensor, Stage::kReadWrite,
                                             specs.back().op == MPI_SUM, staging()));
  }
  return enqueue(type, tensors, fail_stop, stages, [this, stages, specs](FailureRecord* record) {
    run_data_op("reduce", [&](MPI_Comm comm) {
      const bool inject = kill_pending_at("reduce");
      for (size_t i = 0; i < stages.size(); ++i) {
        const int rc = reduce_in_place(stages[i]->mpi(), specs[i], comm, inject && i == 0);
        if (rc != MPI_SUCCESS) return rc;
      }
      return MPI_SUCCESS;
    }, record);
  });
}

int ProcessGroupULFM::reduce_in_place(const at::Tensor& host, const SumSpec& spec, MPI_Comm comm,
                                      bool inject) {
  char* data = static_cast<char*>(host.data_ptr());
  const int64_t numel = host.numel();
  const int64_t itemsize = host.element_size();
  for (int64_t offset = 0; offset < numel; offset += kMaxChunk) {
    const int count = int(std::min(kMaxChunk, numel - offset));
    void* chunk = data + offset * itemsize;
    int rc;
    if (inject && offset == 0) {
      MPI_Request request;
      rc = MPI_Iallreduce(MPI_IN_PLACE, chunk, count, spec.type, spec.op, comm, &request);
      fault_posted("reduce");
      if (rc == MPI_SUCCESS) rc = MPI_Wait(&request, MPI_STATUS_IGNORE);
    } else {
      rc = MPI_Allreduce(MPI_IN_PLACE, chunk, count, spec.type, spec.op, comm);
    }
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::broadcast_from(at::Tensor tensor,
                                                             int64_t root_world_rank) {
  return enqueue_broadcast(std::move(tensor), root_world_rank, false);
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::enqueue_broadcast(at::Tensor tensor,
                                                                int64_t root_world_rank,
                                                                bool fail_stop,
                                                                at::Tensor keep) {
  // The root's tensor is only read, the others' only written.
  const auto use = root_world_rank == world_rank() ? Stage::kRead : Stage::kWrite;
  auto stage = std::make_shared<Stage>(tensor, use, /*direct_ok=*/true, staging());
  return enqueue(c10d::OpType::BROADCAST, {keep.defined() ? keep : tensor}, fail_stop, {stage},
                 [this, stage, root_world_rank, keep](FailureRecord* record) {
    const auto current = members();
    auto it = std::find(current.begin(), current.end(), root_world_rank);
    TORCH_CHECK_VALUE(it != current.end(), "ulfm: broadcast root ", root_world_rank,
                      " is not a live member of group ", options_.name);
    const int root = int(it - current.begin());
    char* data = static_cast<char*>(stage->mpi().data_ptr());
    const int64_t nbytes = stage->mpi().nbytes();
    const int64_t chunk = max_chunk_bytes_;
    run_data_op("broadcast", [&](MPI_Comm comm) {
      for (int64_t offset = 0; offset == 0 || offset < nbytes; offset += chunk) {
        if (offset > 0) fault_enter("broadcast-chunk");
        const int count = int(std::min(chunk, nbytes - offset));
        const int rc = MPI_Bcast(data + offset, count, MPI_BYTE, root, comm);
        if (rc != MPI_SUCCESS) return rc;
      }
      return MPI_SUCCESS;
    }, record);
    if (record->repaired || !keep.defined()) return;
    const auto rows = stage->mpi().chunk(int64_t(current.size()));
    keep.copy_(rows[size_t(current_rank())].view(keep.sizes()));
  });
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::allgather_into(at::Tensor output,
                                                             at::Tensor input) {
  return enqueue_allgather(std::move(output), std::move(input), {}, false);
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::enqueue_allgather(at::Tensor output,
                                                                at::Tensor input,
                                                                std::vector<at::Tensor> rows,
                                                                bool fail_stop) {
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(),
                    "ulfm: all-gather output and input dtypes differ");
  TORCH_CHECK_VALUE(output.numel() == input.numel() * current_size(),
                    "ulfm: all-gather output must hold size() x input elements (size() = ",
                    current_size(), ")");
  auto in = std::make_shared<Stage>(input, Stage::kRead, /*direct_ok=*/true, staging());
  auto out = std::make_shared<Stage>(output, Stage::kWrite, /*direct_ok=*/true, staging());
  return enqueue(c10d::OpType::ALLGATHER, {output}, fail_stop, {in, out},
                 [this, in, out, rows](FailureRecord* record) {
    const int64_t nbytes = in->mpi().nbytes();
    const int64_t chunk = max_chunk_bytes_;
    run_data_op("allgather", [&](MPI_Comm comm) {
      int size = 0;
      MPI_Comm_size(comm, &size);
      if (int64_t(size) * nbytes != out->mpi().nbytes()) return int(MPI_ERR_SIZE);
      const char* input = static_cast<const char*>(in->mpi().data_ptr());
      char* output = static_cast<char*>(out->mpi().data_ptr());
      // Each round gathers bytes [offset, offset + count) of every member's input straight into
      // place: member r's piece lands at r * nbytes + offset, through a receive type of `count`
      // bytes whose extent is a whole row (nbytes).
      for (int64_t offset = 0; offset == 0 || offset < nbytes; offset += chunk) {
        if (offset > 0) fault_enter("allgather-chunk");
        const int count = int(std::min(chunk, nbytes - offset));
        MPI_Datatype piece, row;
        MPI_Type_contiguous(count, MPI_BYTE, &piece);
        MPI_Type_create_resized(piece, 0, MPI_Aint(nbytes), &row);
        MPI_Type_commit(&row);
        const int rc = MPI_Allgather(input + offset, count, MPI_BYTE, output + offset, 1, row,
                                     comm);
        MPI_Type_free(&row);
        MPI_Type_free(&piece);
        if (rc != MPI_SUCCESS) return rc;
      }
      return MPI_SUCCESS;
    }, record);
    if (record->repaired || rows.empty()) return;
    // torch's list form: split the gathered rows into the caller's tensors before completion.
    auto chunks = out->mpi().chunk(int64_t(rows.size()));
    for (size_t i = 0; i < rows.size(); ++i) rows[i].copy_(chunks[i].view(rows[i].sizes()));
  });
}

void ProcessGroupULFM::set_max_chunk_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 1 && bytes <= kMaxChunk, "ulfm: a chunk holds 1 to ", kMaxChunk,
                    " bytes, got ", bytes);
  max_chunk_bytes_ = bytes;
}

void ProcessGroupULFM::set_stage_host(bool on) {
  force_host_ = on;
}

void ProcessGroupULFM::set_direct_device(bool on) {
  TORCH_CHECK_VALUE(!on || mpi_cuda_aware(),
                    "ulfm: this MPI is not CUDA-aware (MPIX_Query_cuda_support() returns 0), so "
                    "CUDA tensors cannot go to it directly; leave the direct path off (they are "
                    "staged through pinned host memory) or use an Open MPI built with CUDA");
  direct_ = on;
}

std::map<std::string, int64_t> ProcessGroupULFM::staging_stats() const {
  const auto stats = pool_.stats();
  return {{"allocated", stats.allocated}, {"reused", stats.reused}, {"idle", stats.idle},
          {"idle_bytes", stats.idle_bytes}};
}

StagingContext ProcessGroupULFM::staging() {
  return {&pool_, force_host_, direct_, [this](c10::Device device) {
            std::lock_guard<std::mutex> lock(streams_mutex_);
            auto it = streams_.find(device.index());
            if (it == streams_.end()) {
              c10::impl::VirtualGuardImpl impl(device.type());
              it = streams_.emplace(device.index(),
                                    std::make_pair(impl.getStreamFromGlobalPool(device),
                                                   impl.getStreamFromGlobalPool(device))).first;
            }
            return it->second;
          }};
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::barrier_ft() {
  return enqueue_barrier(false);
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::enqueue_barrier(bool fail_stop) {
  return enqueue(c10d::OpType::BARRIER, {}, fail_stop, {}, [this](FailureRecord* record) {
    run_data_op("barrier", [](MPI_Comm comm) { return MPI_Barrier(comm); }, record);
  });
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::consensus(std::vector<int64_t> census) {
  auto shared = std::make_shared<std::vector<int64_t>>(std::move(census));
  return enqueue(c10d::OpType::UNKNOWN, {}, false, {}, [this, shared](FailureRecord* record) {
    run_consensus(*shared, record);
  });
}

c10::intrusive_ptr<WorkULFM> ProcessGroupULFM::adopt(int64_t grown_handle) {
  // Open MPI's MPI_Comm is a pointer; mpi4py hands out its value (MPI._handleof).
  MPI_Comm grown = reinterpret_cast<MPI_Comm>(static_cast<intptr_t>(grown_handle));
  TORCH_CHECK_VALUE(grown != MPI_COMM_NULL, "ulfm: adopt needs a communicator");
  return enqueue(c10d::OpType::UNKNOWN, {}, false, {},
                 [this, grown](FailureRecord* record) { run_adopt(grown, record); });
}

// The torch.distributed entry points: the typed operations, failing stop (see the header).

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "ulfm: all-reduce takes exactly one tensor");
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM,
                    "ulfm: all-reduce supports only ReduceOp.SUM (got ",
                    int(opts.reduceOp.op_), ")");
  return enqueue_allreduce(c10d::OpType::ALLREDUCE, tensors, true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  // What torch.distributed's coalescing manager (megatron's bucket groups) sends.
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM,
                    "ulfm: all-reduce supports only ReduceOp.SUM (got ",
                    int(opts.reduceOp.op_), ")");
  return enqueue_allreduce(c10d::OpType::ALLREDUCE_COALESCED, tensors, true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "ulfm: broadcast takes exactly one tensor");
  // torch passes the root as a rank of the group as created; members keep their world ranks.
  return enqueue_broadcast(tensors[0], options_.world_ranks.at(opts.rootRank), true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions&) {
  TORCH_CHECK_VALUE(inputs.size() == 1 && outputs.size() == 1,
                    "ulfm: all-gather takes one input tensor and one output list");
  TORCH_CHECK_VALUE(int64_t(outputs[0].size()) == current_size(),
                    "ulfm: all-gather output list must have one tensor per live member (",
                    current_size(), ")");
  at::Tensor flat = at::empty({current_size() * inputs[0].numel()},
                              inputs[0].options().device(at::kCPU));
  return enqueue_allgather(flat, inputs[0], outputs[0], true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::barrier(const c10d::BarrierOptions&) {
  return enqueue_barrier(true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  TORCH_CHECK_VALUE(inputs.size() == 1, "ulfm: gather takes one input tensor");
  const bool root = options_.world_ranks.at(opts.rootRank) == world_rank();
  std::vector<at::Tensor> rows;
  if (root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && int64_t(outputs[0].size()) == current_size(),
                      "ulfm: gather's root takes one output list with one tensor per live "
                      "member (", current_size(), ")");
    rows = outputs[0];
  }
  at::Tensor flat = at::empty({current_size() * inputs[0].numel()},
                              inputs[0].options().device(at::kCPU));
  return enqueue_allgather(flat, inputs[0], rows, true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupULFM::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == 1, "ulfm: scatter takes one output tensor");
  const int64_t root_world_rank = options_.world_ranks.at(opts.rootRank);
  at::Tensor flat;
  if (root_world_rank == world_rank()) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && int64_t(inputs[0].size()) == current_size(),
                      "ulfm: scatter's root takes one input list with one tensor per live "
                      "member (", current_size(), ")");
    std::vector<at::Tensor> rows;
    for (const auto& row : inputs[0]) rows.push_back(row.reshape({-1}).to(at::kCPU));
    flat = at::cat(rows);
  } else {
    flat = at::empty({current_size() * outputs[0].numel()},
                     outputs[0].options().device(at::kCPU));
  }
  return enqueue_broadcast(flat, root_world_rank, true, outputs[0]);
}

// ------------------------------------------------------------------------------ fault injection

void ProcessGroupULFM::arm_fault(FaultArm arm) {
  TORCH_CHECK_VALUE(arm.point == "reduce" || arm.point == "consensus" || arm.point == "shrink" ||
                        arm.point == "barrier" || arm.point == "broadcast" ||
                        arm.point == "allgather" || arm.point == "adopt" ||
                        arm.point == "broadcast-chunk" || arm.point == "allgather-chunk",
                    "ulfm: unknown fault point '", arm.point, "'");
  TORCH_CHECK_VALUE(arm.action == "kill" || arm.action == "stop" || arm.action == "delay",
                    "ulfm: unknown fault action '", arm.action, "'");
  TORCH_CHECK_VALUE(arm.point != "shrink" || arm.action == "delay" || arm.delay_s > 0,
                    "ulfm: a kill inside shrink needs delay_s > 0 (it fires from a timer)");
  std::lock_guard<std::mutex> lock(fault_mutex_);
  arms_.push_back(std::move(arm));
}

int64_t ProcessGroupULFM::fault_hits(const std::string& point) {
  std::lock_guard<std::mutex> lock(fault_mutex_);
  auto it = hits_.find(point);
  return it == hits_.end() ? 0 : it->second;
}

namespace {

std::mutex phase_mutex;
std::string fault_phase;  // set_fault_phase(); empty: never set

[[noreturn]] void die_with_marker(const FaultArm& arm) {  // or freeze: see the end
  std::string phase;
  {
    std::lock_guard<std::mutex> lock(phase_mutex);
    phase = fault_phase;
  }
  char line[640];
  const int n = std::snprintf(line, sizeof(line),
                              "{\"point\": \"%s\", \"rank\": %d, \"time\": %.6f, "
                              "\"phase\": \"%s\"%s%s}\n",
                              arm.point.c_str(), world_rank(), now_s(), phase.c_str(),
                              arm.marker_fields.empty() ? "" : ", ", arm.marker_fields.c_str());
  const int fd = ::open(arm.marker_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd >= 0) {
    ssize_t written = ::write(fd, line, std::min(size_t(n), sizeof(line) - 1));
    (void)written;
    ::fsync(fd);
    ::close(fd);
  }
  // "stop" freezes the process (SIGSTOP) the way a hung host or a deadlock would look.
  ::kill(::getpid(), arm.action == "stop" ? SIGSTOP : SIGKILL);
  for (;;) ::pause();
}

}  // namespace

void set_fault_phase(std::string phase) {
  std::lock_guard<std::mutex> lock(phase_mutex);
  fault_phase = std::move(phase);
}

bool ProcessGroupULFM::kill_pending_at(const std::string& point) {
  // Only the armed occurrence posts the non-blocking variant: blocking and non-blocking
  // collectives never match each other, so every other call must stay blocking like the peers'.
  std::lock_guard<std::mutex> lock(fault_mutex_);
  return has_pending_kill_ && pending_kill_.point == point;
}

void ProcessGroupULFM::fault_enter(const std::string& point) {
  std::vector<FaultArm> due;
  {
    std::lock_guard<std::mutex> lock(fault_mutex_);
    const int64_t count = ++hits_[point];
    if (arms_.empty()) return;
    for (const auto& arm : arms_) {
      if (arm.point == point && arm.occurrence == count) due.push_back(arm);
    }
  }
  for (const auto& arm : due) {
    if (arm.action == "delay") {
      std::this_thread::sleep_for(std::chrono::duration<double>(arm.delay_s));
    } else if (point == "shrink") {  // kill or stop
      // Shrink is blocking: a timer thread kills us while this thread is inside it.
      std::thread([arm] {
        std::this_thread::sleep_for(std::chrono::duration<double>(arm.delay_s));
        die_with_marker(arm);
      }).detach();
    } else if (point == "reduce" || point == "consensus") {
      // Killed by fault_posted(), once the non-blocking call is in flight.
      std::lock_guard<std::mutex> lock(fault_mutex_);
      pending_kill_ = arm;
      has_pending_kill_ = true;
    } else {
      die_with_marker(arm);  // blocking calls without a non-blocking twin: die on entry
    }
  }
}

void ProcessGroupULFM::fault_posted(const std::string& point) {
  FaultArm arm;
  {
    std::lock_guard<std::mutex> lock(fault_mutex_);
    if (!has_pending_kill_ || pending_kill_.point != point) return;
    arm = pending_kill_;
  }
  if (arm.delay_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(arm.delay_s));
  die_with_marker(arm);
}

}  // namespace ulfm
