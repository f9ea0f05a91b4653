// Data parallelism for the trainer over LibTorch's c10d, with no collective of our own: the ranks of a job
// meet at a TCPStore and talk through Gloo (CPU) or NCCL (CUDA); GradientBuckets averages the gradients.
// Every rank must call the same collectives in the same order. A collective throws c10::DistError when a
// rank has gone away or the timeout passed; the trainer turns that into its error.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "train/launch.h"

namespace torch::autograd {
struct Node;
}

namespace oryx::train {

enum class DistBackend { kGloo, kNccl };

// --dist-backend: "auto" (nccl on a CUDA device, gloo on the CPU), "gloo" or "nccl", checked against the
// device and against what this build has.
absl::StatusOr<DistBackend> ResolveDistBackend(const std::string& name, torch::Device device);
const char* DistBackendName(DistBackend backend);

// This process's membership of the job. Not thread-safe, except that GradientBuckets starts all-reduces
// from the autograd engine's thread while the owner waits in backward().
class DistGroup {
 public:
  // Joins the job: rank 0 serves the rendezvous store (unless torchrun's agent serves it), every rank
  // connects to it, then the backend connects the ranks. Fails when a rank is missing after `timeout`,
  // which is also the longest any later collective waits.
  static absl::StatusOr<std::unique_ptr<DistGroup>> Connect(const DistEnv& env, DistBackend backend,
                                                            torch::Device device, std::chrono::milliseconds timeout);

  int rank() const { return rank_; }
  int size() const { return size_; }
  DistBackend backend() const { return backend_kind_; }

  // In place over every rank's `tensor` (contiguous, on the group's device for NCCL).
  c10::intrusive_ptr<c10d::Work> SumAsync(torch::Tensor& tensor);
  // Waits for an operation: throws c10::DistBackendError when it failed (whatever the backend threw).
  void Wait(const c10::intrusive_ptr<c10d::Work>& work);
  void AllReduce(torch::Tensor& tensor, c10d::ReduceOp::RedOpType op);
  void Broadcast(torch::Tensor& tensor, int root);
  // Returns once every rank has called it.
  void Barrier(torch::Device device);

 private:
  DistGroup(int rank, int size, DistBackend backend) : rank_(rank), size_(size), backend_kind_(backend) {}

  int rank_, size_;
  DistBackend backend_kind_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
};

// Sums gradients over the ranks of a group, as DDP does. The gradients live in a few flat buckets of about
// bucket_bytes: each parameter's .grad is a view into its bucket, so nothing is copied, and each bucket is
// one all-reduce. Buckets hold the parameters in reverse order, about the order in which backward finishes
// them. After Overlap(), a bucket's all-reduce starts as soon as backward has finished its last gradient,
// while backward goes on with the rest (an AccumulateGrad post-hook per parameter). Buckets start in index
// order on every rank, as the collectives must match; a bucket with a parameter this rank's backward did
// not reach (a mode none of its micro-batches ran) waits for Finish(). The sum over ranks is the mean when
// each rank scales its loss by 1 / (ranks x micro-batches).
class GradientBuckets {
 public:
  // params: all of one dtype and device; they must outlive this object.
  GradientBuckets(DistGroup& group, const std::vector<torch::Tensor>& params, int64_t bucket_bytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // Zeroes every bucket and makes each parameter's .grad its view again (in case the step dropped it).
  void Zero();
  // The next backward pass is this rank's last of the step: all-reduce each bucket once it is complete.
  void Overlap();
  // Starts the all-reduces not yet started, in bucket order, and waits for all of them. Afterwards every
  // rank's gradients hold the sum over ranks. Returns the seconds this thread waited: on Gloo, the
  // communication that backward did not hide plus any wait for slower ranks; NCCL's wait is the stream's,
  // not the host's, so there it is about 0.
  double Finish();
  size_t num_buckets() const { return buckets_.size(); }

 private:
  class ReadyHook;
  struct Bucket {
    torch::Tensor flat;          // [total numel of its parameters]: their gradients
    std::vector<size_t> params;  // indices into params_
    size_t pending = 0;          // of those, how many backward has yet to finish (after Overlap)
    c10::intrusive_ptr<c10d::Work> work;
  };
  void MarkReady(size_t param);  // called by the hooks, on the autograd engine's thread
  void StartReadyBuckets();      // mu_ held

  DistGroup& group_;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> views_;  // per parameter: its gradient, a view into its bucket
  std::vector<size_t> bucket_of_;     // per parameter
  std::vector<Bucket> buckets_;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;  // AccumulateGrad, key
  std::mutex mu_;
  bool armed_ = false;  // Overlap() called, Finish() not yet
  size_t next_ = 0;     // the next bucket to start
};

// The CUDA piece (distributed_nccl.cc), built only against LibTorch's CUDA part and NCCL's header.
bool HaveNccl();
// Makes cuda:index the current device of this process; FailedPrecondition when it is not visible.
absl::Status UseCudaDevice(int index);
// A ProcessGroupNCCL over `store` (only when HaveNccl()).
c10::intrusive_ptr<c10d::Backend> MakeNcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout);

}  // namespace oryx::train
