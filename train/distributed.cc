// The process group (TCPStore rendezvous, Gloo from LibTorch's own ProcessGroupGloo) and the gradient
// buckets. Gloo's types are used only through the shared pointers ProcessGroupGloo's factories return, so
// the gloo headers this compiles against (Debian's libgloo-dev: the torch wheel ships none) need only
// declare them; the objects are built inside LibTorch, by its own copy of gloo.
#include "train/distributed.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#ifdef ORYX_HAVE_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <signal.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "train/torch_io.h"
#include "train/trainer.h"

namespace oryx::train {

namespace {

#ifdef ORYX_HAVE_GLOO
// The network device Gloo binds: GLOO_SOCKET_IFNAME's interface when set, the loopback for a job on one
// host, else the address this host's name resolves to (LibTorch's default).
std::shared_ptr<::gloo::transport::Device> GlooDevice(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (master_addr == "127.0.0.1" || master_addr == "localhost") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::Backend> MakeGlooBackend(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& env,
                                                  std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(GlooDevice(env.master_addr));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, options);
}
#endif

// Gloo writes to its sockets with writev, which cannot take MSG_NOSIGNAL: once a peer has died, a write to
// it raises SIGPIPE, whose default action kills this rank before Gloo can turn the broken connection into an
// error (Python ignores SIGPIPE at start, so PyTorch's own jobs never see this). A rank ignores it, and the
// write fails with EPIPE instead.
void IgnoreSigpipe() {
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, nullptr);
}

}  // namespace

const char* DistBackendName(DistBackend backend) { return backend == DistBackend::kNccl ? "nccl" : "gloo"; }

absl::StatusOr<DistBackend> ResolveDistBackend(const std::string& name, torch::Device device) {
  DistBackend backend;
  if (name == "auto") {
    backend = device.is_cuda() ? DistBackend::kNccl : DistBackend::kGloo;
  } else if (name == "gloo" || name == "nccl") {
    backend = name == "nccl" ? DistBackend::kNccl : DistBackend::kGloo;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--dist-backend must be auto, gloo or nccl, got '", name, "'"));
  }
  if (backend == DistBackend::kNccl && !device.is_cuda()) {
    return absl::InvalidArgumentError(
        "--dist-backend nccl needs CUDA devices, and this run trains on the CPU (no CUDA device is visible, or "
        "--device cpu): use gloo");
  }
  if (backend == DistBackend::kNccl && !HaveNccl()) {
    return absl::FailedPreconditionError(
        "--dist-backend nccl: this build has no NCCL (it needs LibTorch's CUDA part and nccl.h at configure time)");
  }
#ifndef ORYX_HAVE_GLOO
  if (backend == DistBackend::kGloo) {
    return absl::FailedPreconditionError(
        "--dist-backend gloo: this build has no Gloo (configure found no gloo headers: install libgloo-dev, "
        "e.g. with scripts/setup, and configure again)");
  }
#endif
  return backend;
}

absl::StatusOr<std::unique_ptr<DistGroup>> DistGroup::Connect(const DistEnv& env, DistBackend backend,
                                                              torch::Device device, std::chrono::milliseconds timeout) {
  std::unique_ptr<DistGroup> group(new DistGroup(env.rank, env.world_size, backend));
  const std::string where = absl::StrCat(env.master_addr, ":", env.master_port);
  const double seconds = std::chrono::duration<double>(timeout).count();
  IgnoreSigpipe();
  try {
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(env.master_port);
    options.isServer = env.rank == 0 && !env.agent_store;
    options.numWorkers = env.world_size;
    options.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    group->store_ = c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("oryx/", env.restart_count), tcp);
  } catch (const c10::Error& e) {
    return absl::UnavailableError(absl::StrCat(
        "could not ", env.rank == 0 && !env.agent_store ? "serve" : "reach", " the job's rendezvous store at ", where,
        " with all ", env.world_size, " ranks within ", seconds, " s (",
        env.rank == 0 ? "is the port free, and did every rank start?" : "is rank 0 running at MASTER_ADDR:MASTER_PORT?",
        "): ", e.what_without_backtrace()));
  }
  try {
    if (backend == DistBackend::kNccl) {
      group->backend_ = MakeNcclBackend(group->store_, env.rank, env.world_size, timeout);
    } else {
#ifdef ORYX_HAVE_GLOO
      group->backend_ = MakeGlooBackend(group->store_, env, timeout);
#endif
    }
  } catch (const c10::Error& e) {
    return absl::UnavailableError(absl::StrCat("could not connect the ", DistBackendName(backend), " backend of ",
                                               env.world_size, " ranks within ", seconds,
                                               " s: ", e.what_without_backtrace()));
  }
  if (!group->backend_) return absl::InternalError("no backend");
  return group;
}

c10::intrusive_ptr<c10d::Work> DistGroup::SumAsync(torch::Tensor& tensor) {
  std::vector<at::Tensor> tensors = {tensor};
  return backend_->allreduce(tensors);
}

void DistGroup::Wait(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    // Gloo's own exceptions (a peer's connection reset, a timeout) come through as they are.
    C10_THROW_ERROR(DistBackendError, e.what());
  }
}

void DistGroup::AllReduce(torch::Tensor& tensor, c10d::ReduceOp::RedOpType op) {
  std::vector<at::Tensor> tensors = {tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  Wait(backend_->allreduce(tensors, options));
}

void DistGroup::Broadcast(torch::Tensor& tensor, int root) {
  std::vector<at::Tensor> tensors = {tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  Wait(backend_->broadcast(tensors, options));
}

void DistGroup::Barrier(torch::Device device) {
  torch::Tensor one = torch::ones({1}, torch::TensorOptions().device(device));
  AllReduce(one, c10d::ReduceOp::SUM);
  (void)one.item<float>();  // NCCL's wait only orders the stream: wait for the result itself
}

class GradientBuckets::ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(GradientBuckets* owner, size_t param) : owner_(owner), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    owner_->MarkReady(param_);
    return outputs;
  }

 private:
  GradientBuckets* owner_;
  size_t param_;
};

GradientBuckets::GradientBuckets(DistGroup& group, const std::vector<torch::Tensor>& params, int64_t bucket_bytes)
    : group_(group), params_(params), views_(params.size()), bucket_of_(params.size()) {
  TORCH_CHECK(!params.empty(), "GradientBuckets: no parameters");
  // Reverse order: the output end of the model finishes its gradients first.
  std::vector<std::vector<size_t>> members(1);
  int64_t bytes = 0;
  for (size_t k = params.size(); k-- > 0;) {
    TORCH_CHECK(params[k].dtype() == params[0].dtype() && params[k].device() == params[0].device(),
                "GradientBuckets: parameters of mixed dtype or device");
    const int64_t size = params[k].numel() * static_cast<int64_t>(params[k].element_size());
    if (!members.back().empty() && bytes + size > bucket_bytes) {
      members.emplace_back();
      bytes = 0;
    }
    members.back().push_back(k);
    bytes += size;
  }
  torch::NoGradGuard no_grad;
  for (auto& indices : members) {
    Bucket b;
    int64_t numel = 0;
    for (size_t k : indices) numel += params[k].numel();
    b.flat = torch::zeros({numel}, params[0].options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k : indices) {
      views_[k] = b.flat.narrow(0, offset, params[k].numel()).view(params[k].sizes());
      bucket_of_[k] = buckets_.size();
      offset += params[k].numel();
    }
    b.params = std::move(indices);
    buckets_.push_back(std::move(b));
  }
  for (size_t k = 0; k < params_.size(); ++k) {
    params_[k].mutable_grad() = views_[k];
    std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(params_[k]);
    const uintptr_t key = accumulator->add_post_hook(std::make_unique<ReadyHook>(this, k));
    hooks_.emplace_back(std::move(accumulator), key);
  }
}

GradientBuckets::~GradientBuckets() {
  for (auto& [node, key] : hooks_) node->del_post_hook(key);
}

void GradientBuckets::Zero() {
  torch::NoGradGuard no_grad;
  for (Bucket& b : buckets_) b.flat.zero_();
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!params_[k].grad().defined() || !params_[k].grad().is_same(views_[k])) params_[k].mutable_grad() = views_[k];
  }
}

void GradientBuckets::Overlap() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Bucket& b : buckets_) b.pending = b.params.size();
  next_ = 0;
  armed_ = true;
}

void GradientBuckets::MarkReady(size_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) return;
  Bucket& b = buckets_[bucket_of_[param]];
  if (b.pending > 0) --b.pending;
  StartReadyBuckets();
}

void GradientBuckets::StartReadyBuckets() {
  while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
    buckets_[next_].work = group_.SumAsync(buckets_[next_].flat);
    ++next_;
  }
}

double GradientBuckets::Finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!armed_) next_ = 0;
    armed_ = false;
    for (; next_ < buckets_.size(); ++next_) buckets_[next_].work = group_.SumAsync(buckets_[next_].flat);
  }
  const auto start = std::chrono::steady_clock::now();
  for (Bucket& b : buckets_) {
    group_.Wait(b.work);
    b.work.reset();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

absl::Status CheckDistributedOptions(const DistributedOptions& dist) {
  if (!(dist.timeout_s > 0) || dist.timeout_s > 1e7) {
    return absl::InvalidArgumentError(absl::StrCat("--dist-timeout must be in (0, 1e7] seconds, got ", dist.timeout_s));
  }
  if (!(dist.bucket_mb > 0) || dist.bucket_mb > 1e5) {
    return absl::InvalidArgumentError(absl::StrCat("--bucket-mb must be in (0, 1e5], got ", dist.bucket_mb));
  }
  return absl::OkStatus();
}

absl::Status CheckLocalLaunch(const TrainOptions& o, int nproc) {
  if (nproc < 1) return absl::InvalidArgumentError(absl::StrCat("--nproc must be at least 1, got ", nproc));
  ORYX_ASSIGN_OR_RETURN(torch::Device device, ParseDevice(o.device));
  ORYX_RETURN_IF_ERROR(ResolveDistBackend(o.dist.backend, device).status());
  ORYX_RETURN_IF_ERROR(CheckDistributedOptions(o.dist));
  if (device.is_cuda() && nproc > static_cast<int>(torch::cuda::device_count())) {
    return absl::InvalidArgumentError(absl::StrCat("--nproc ", nproc, " on CUDA runs one rank per GPU, and ",
                                                   torch::cuda::device_count(), " are visible"));
  }
  return absl::OkStatus();
}

}  // namespace oryx::train
