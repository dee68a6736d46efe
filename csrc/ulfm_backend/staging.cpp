// Staging of a ulfm operation's tensors; see staging.hpp for the contract.
#include "staging.hpp"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <mpi.h>
#include <mpi-ext.h>

namespace ulfm {

HostBufferPool::Buffer HostBufferPool::acquire(int64_t nbytes, bool pinned) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = idle_.find({nbytes, pinned});
    if (it != idle_.end()) {
      Buffer buffer = std::move(it->second);
      idle_.erase(it);
      idle_bytes_ -= nbytes;
      ++reused_;
      return buffer;
    }
    ++allocated_;
  }
  // Pinned memory comes from torch's caching host allocator, which keeps it from being reused
  // while a non-blocking copy that reads it is still in flight.
  return {at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned)),
          pinned, nullptr};
}

void HostBufferPool::release(Buffer buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t nbytes = buffer.bytes.numel();
  idle_bytes_ += nbytes;
  idle_.emplace(std::make_pair(nbytes, buffer.pinned), std::move(buffer));
  // Idle memory is bounded: the largest idle buffers go first (a state transfer's one-off
  // sizes, not the buckets that repeat every iteration, are usually the large ones).
  while (idle_bytes_ > kMaxIdleBytes && !idle_.empty()) {
    auto largest = std::prev(idle_.end());
    idle_bytes_ -= largest->first.first;
    idle_.erase(largest);
  }
}

HostBufferPool::Stats HostBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {allocated_, reused_, int64_t(idle_.size()), idle_bytes_};
}

Stage::Stage(const at::Tensor& user, Use use, bool direct_ok, const StagingContext& context)
    : user_(user), use_(use) {
  const c10::Device device = user.device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(),
                    "ulfm: tensors must be on the CPU or a CUDA device (got ", device, ")");
  if (device.is_cpu() && user.is_contiguous() && !context.force_host) {
    mpi_ = user;  // MPI works on the caller's storage
    return;
  }
  std::optional<c10::Event> produced;
  std::optional<c10::impl::VirtualGuardImpl> impl;
  std::optional<c10::Stream> producer;
  if (device.is_cuda()) {
    impl.emplace(device.type());
    producer = impl->getStream(device);  // the caller's current stream
    produced.emplace(device.type());
    produced->record(*producer);
    if (direct_ok && context.direct && user.is_contiguous()) {
      pending_ = std::make_shared<c10::Event>(std::move(*produced));
      mpi_ = user;
      return;
    }
  }
  pool_ = context.pool;
  buffer_ = pool_->acquire(int64_t(user.nbytes()), device.is_cuda());
  mpi_ = buffer_->bytes.view(user.scalar_type()).view(user.sizes());
  if (!device.is_cuda()) {
    if (use_ & kRead) mpi_.copy_(user);
    return;
  }
  const auto [in_stream, out_stream] = context.streams(device);
  write_stream_ = out_stream;
  if (!(use_ & kRead)) {
    pending_ = buffer_->fence;  // MPI overwrites the buffer once its previous copy finished
    produced->block(out_stream);  // the copy back lands after what the caller queued before
    return;
  }
  produced->block(in_stream);
  if (buffer_->fence) buffer_->fence->block(in_stream);
  {
    c10::StreamGuard guard(in_stream);
    mpi_.copy_(user, /*non_blocking=*/true);
  }
  // The caller may drop its tensor before the copy ran: keep the allocator from reusing it.
  impl->recordDataPtrOnStream(user.storage().data_ptr(), in_stream);
  pending_ = std::make_shared<c10::Event>(device.type());
  pending_->record(in_stream);
}

void Stage::ready() {
  if (pending_) pending_->synchronize();
}

void Stage::write_back() {
  if (!(use_ & kWrite) || !buffer_) return;  // MPI wrote the caller's storage itself
  if (!write_stream_) {
    user_.copy_(mpi_);
    return;
  }
  c10::impl::VirtualGuardImpl impl(user_.device().type());
  c10::StreamGuard guard(*write_stream_);  // sets this thread's device too
  user_.copy_(mpi_, /*non_blocking=*/true);
  impl.recordDataPtrOnStream(user_.storage().data_ptr(), *write_stream_);
  written_ = std::make_shared<c10::Event>(user_.device().type());
  written_->record(*write_stream_);
}

Fence Stage::finish() {
  if (buffer_) {
    if (written_) {
      buffer_->fence = written_;
    } else if (pending_) {
      buffer_->fence = pending_;
    }
    pool_->release(std::move(*buffer_));
    buffer_.reset();
  }
  mpi_ = at::Tensor();
  return written_;
}

bool mpi_cuda_aware() {
#if defined(OMPI_HAVE_MPI_EXT_CUDA) && OMPI_HAVE_MPI_EXT_CUDA
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

}  // namespace ulfm
