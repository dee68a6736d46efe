// Staging: the memory MPI reads and writes for one tensor of a ulfm operation.
//
// MPI works on host memory (on device memory only when it is CUDA-aware and the group allows it).
// A Stage is made on the caller's thread when the operation is submitted, used on the group's
// worker thread, and its ordering handed to the caller's Work.wait():
//
//  * A contiguous CPU tensor: MPI uses the caller's storage; nothing is copied.
//  * A non-contiguous CPU tensor, or any CPU tensor while `force_host` is set (tests, so that
//    the path below runs on machines without a GPU): a buffer from the pool, filled on the
//    caller's thread, written back by the worker only when the operation succeeded.
//  * A device (CUDA) tensor: a pinned buffer from the pool. On the caller's thread an event
//    marks the caller's current stream (the producer), the group's copy-in stream waits for it
//    and for the buffer's previous use, copies device to host without blocking, and records
//    `staged`. The worker synchronizes `staged` before MPI touches the buffer. After a success it
//    copies host to device on the write-back stream, under the tensor's device, and records
//    `written`; Work.wait() makes the caller's current stream wait for `written`, as
//    ProcessGroupNCCL's work does. No thread of ours blocks the GPU's queue: the caller only
//    enqueues, the worker waits for its own copy. The buffer returns to the pool fenced by the
//    last event that touched it.
//  * A device tensor with `direct` (a CUDA-aware MPI; not for 16-bit sums, whose MPI operator
//    runs on the host): the worker synchronizes the producer's event, then MPI reads and writes
//    device memory itself. Nothing is copied and nothing is left to order: a CUDA-aware MPI's
//    blocking call has finished with the memory when it returns.
//
// The staged path and the buffer pool are the same code on CPU and CUDA; only the event and
// stream calls are skipped for CPU tensors, whose copies are synchronous.
//
// Work.get_future() completes on the host when the worker is done, before a staged CUDA
// result's copy back has run: read such a result after Work.wait(), which orders it.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace ulfm {

using Fence = std::shared_ptr<c10::Event>;

// Reusable host buffers, pinned for device tensors. Bucket sizes repeat every iteration, so a
// buffer of the exact size is almost always idle; idle buffers beyond kMaxIdleBytes are freed.
class HostBufferPool {
 public:
  struct Buffer {
    at::Tensor bytes;  // uint8, nbytes long
    bool pinned = false;
    Fence fence;       // the last device work that used it (null: none, or a host buffer)
  };
  struct Stats {
    int64_t allocated = 0;  // buffers created
    int64_t reused = 0;     // acquisitions served by an idle buffer
    int64_t idle = 0;       // buffers idle now
    int64_t idle_bytes = 0;
  };
  static constexpr int64_t kMaxIdleBytes = int64_t(4) << 30;

  Buffer acquire(int64_t nbytes, bool pinned);
  void release(Buffer buffer);
  Stats stats() const;

 private:
  mutable std::mutex mutex_;
  std::multimap<std::pair<int64_t, bool>, Buffer> idle_;  // (nbytes, pinned) -> buffer
  int64_t idle_bytes_ = 0;
  int64_t allocated_ = 0;
  int64_t reused_ = 0;
};

// What the group tells a Stage about itself.
struct StagingContext {
  HostBufferPool* pool;
  bool force_host;   // stage CPU tensors through the pool too (tests)
  bool direct;       // the group passes device memory to MPI (CUDA-aware MPI)
  // The group's copy-in and write-back streams on `device`, created on first use.
  std::function<std::pair<c10::Stream, c10::Stream>(c10::Device)> streams;
};

class Stage {
 public:
  enum Use { kRead = 1, kWrite = 2, kReadWrite = 3 };

  // On the caller's thread. `direct_ok`: MPI may read and write this tensor's device memory
  // (no host-side operator on it).
  Stage(const at::Tensor& user, Use use, bool direct_ok, const StagingContext& context);

  // The tensor MPI reads and writes: contiguous, on the host (or the device when direct).
  const at::Tensor& mpi() const { return mpi_; }
  // The caller's tensor's device.
  c10::Device device() const { return user_.device(); }

  // On the worker: wait until the bytes MPI reads are in place (and the buffer is free).
  void ready();
  // On the worker, after the operation succeeded: the result into the caller's tensor.
  void write_back();
  // On the worker, last: the buffer back to the pool. The event the caller's stream must wait
  // for before reading the tensor (null when nothing is in flight on the device).
  Fence finish();

 private:
  at::Tensor user_;
  at::Tensor mpi_;
  Use use_;
  HostBufferPool* pool_ = nullptr;
  std::optional<HostBufferPool::Buffer> buffer_;
  std::optional<c10::Stream> write_stream_;
  Fence pending_;  // what `ready()` synchronizes
  Fence written_;
};

using Stages = std::vector<std::shared_ptr<Stage>>;

// Whether this MPI reports CUDA support at run time (Open MPI's MPIX_Query_cuda_support).
bool mpi_cuda_aware();

}  // namespace ulfm
