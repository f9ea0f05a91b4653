// The CUDA backend's memory: new sequences on the device, what the device has left, and the forward's
// scratch buffers, grown all or nothing.

#include <initializer_list>
#include "engine/cuda_backend_internal.h"

namespace oryx {

using namespace cuda_internal;  // NOLINT: the backend's own internals

absl::StatusOr<SequenceState> CudaBackend::TryNewSequence() const {
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CudaSequence> seq, CudaSequence::Create(ctx_, this));
  return SequenceState(config_, std::move(seq));
}

SequenceState CudaBackend::NewSequence() const {
  absl::StatusOr<SequenceState> seq = TryNewSequence();
  if (!seq.ok()) {
    std::fprintf(stderr, "fatal: CudaBackend::NewSequence: %s\n", std::string(seq.status().message()).c_str());
    std::abort();
  }
  return std::move(*seq);
}

int64_t CudaBackend::KvBytes(int64_t positions) const {
  const int64_t blocks = (positions + kc::kKvBlockTokens - 1) / kc::kKvBlockTokens;
  return blocks * kc::kKvBlockTokens * 2 * config_.n_layers * config_.n_heads * config_.head_dim *
         static_cast<int64_t>(sizeof(bf16));
}

absl::Status CudaBackend::ReserveKv(int64_t bytes) { return ctx_->kv->Reserve(bytes); }

int64_t CudaBackend::KvPoolBytes() const { return ctx_->kv->pool_bytes(); }

int64_t CudaBackend::AvailableDeviceBytes() const {
  size_t free = 0, total = 0;
  ORYX_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(free) + ctx_->pool.cached_bytes() + ctx_->kv->free_bytes();
}

namespace {

// A buffer pointer of the scratch to replace by a new buffer of `bytes`: what it holds now, and how to set it.
struct BufferField {
  void* current;
  std::function<void(void*)> set;
  int64_t bytes;
};
template <typename T>
BufferField Field(T*& p, int64_t bytes) {
  return {p, [&p](void* q) { p = static_cast<T*>(q); }, bytes};
}

}  // namespace

absl::Status CudaBackend::EnsureScratch(int64_t N, int64_t NL, int64_t partial, int64_t meta_bytes, int64_t round_q,
                                        int64_t workspace_bytes) {
  const ModelConfig& c = config_;
  const int64_t D = c.d_model, V = c.vocab_size, HD = c.qk_dim(), F = c.mlp_hidden, P = in_proj_.width;
  Scratch& sc = *scratch_;
  // Replaces the device buffers `fields` (and the pinned host buffer `pinned`, when given) by new ones, all or
  // none: when there is no room, the old buffers stay and the status says so.
  auto replace = [&sc](std::initializer_list<BufferField> fields, const BufferField* pinned,
                       const char* what) -> absl::Status {
    int64_t total = pinned != nullptr ? pinned->bytes : 0;
    for (const BufferField& f : fields) total += f.bytes;
    std::vector<void*> fresh;
    bool ok = true;
    for (const BufferField& f : fields) {
      void* p = TryDeviceAlloc(f.bytes);
      if (p == nullptr) {
        ok = false;
        break;
      }
      fresh.push_back(p);
    }
    void* host = nullptr;
    if (ok && pinned != nullptr && cudaMallocHost(&host, pinned->bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      ok = false;
    }
    if (!ok) {
      for (void* p : fresh) cudaFree(p);
      size_t free = 0, total_device = 0;
      (void)cudaMemGetInfo(&free, &total_device);
      return absl::ResourceExhaustedError(Cat("out of GPU memory: the forward's ", what, " need ",
                                              static_cast<double>(total) / (1 << 30), " GiB; ",
                                              static_cast<double>(free) / (1 << 30), " GiB free"));
    }
    sc.DropGraphs();
    size_t i = 0;
    for (const BufferField& f : fields) {
      if (f.current != nullptr) {
        ORYX_CUDA_CHECK(cudaFree(f.current));
        sc.owned.erase(std::find(sc.owned.begin(), sc.owned.end(), f.current));
      }
      f.set(fresh[i]);
      sc.owned.push_back(fresh[i++]);
    }
    if (pinned != nullptr) {
      if (pinned->current != nullptr) ORYX_CUDA_CHECK(cudaFreeHost(pinned->current));
      pinned->set(host);
    }
    return absl::OkStatus();
  };
  if (N > sc.rows_cap) {
    const int64_t n = std::max(N, 2 * sc.rows_cap);
    ORYX_RETURN_IF_ERROR(replace({Field(sc.x, n * D * 4), Field(sc.proj, n * P * 4), Field(sc.kv, n * 2 * HD * 4),
                                  Field(sc.qa, n * HD * 4), Field(sc.o, n * HD * 4), Field(sc.tmp, n * D * 4),
                                  Field(sc.mlp, n * 2 * F * 4), Field(sc.u, n * D * 2), Field(sc.y, n * HD * 2),
                                  Field(sc.act, n * F * 2)},
                                 nullptr, "activation buffers"));
    sc.rows_cap = n;
  }
  if (NL > sc.logit_rows_cap) {
    const int64_t n = std::max(NL, 2 * sc.logit_rows_cap);
    const BufferField host = Field(sc.logits_host, n * V * 4);
    ORYX_RETURN_IF_ERROR(replace({Field(sc.head, n * D * 2), Field(sc.logits, n * V * 4)}, &host, "logit buffers"));
    sc.logit_rows_cap = n;
  }
  if (partial > sc.partial_cap) {
    const int64_t n = std::max(partial, 2 * sc.partial_cap);
    ORYX_RETURN_IF_ERROR(replace({Field(sc.partial, n * 4)}, nullptr, "attention partials and scan states"));
    sc.partial_cap = n;
  }
  if (meta_bytes > sc.meta_cap) {
    const int64_t n = std::max(meta_bytes, 2 * sc.meta_cap);
    const BufferField host = Field(sc.meta_host, n);
    ORYX_RETURN_IF_ERROR(replace({Field(sc.meta, n)}, &host, "metadata buffers"));
    sc.meta_cap = n;
  }
  if (round_q > sc.round_q_cap) {
    ORYX_RETURN_IF_ERROR(replace({Field(sc.round_q, round_q * 4)}, nullptr, "draft distributions"));
    sc.round_q_cap = round_q;
  }
  if (workspace_bytes > sc.sample_workspace_cap) {
    ORYX_RETURN_IF_ERROR(replace({Field(sc.sample_workspace, workspace_bytes)}, nullptr, "sampling workspace"));
    sc.sample_workspace_cap = workspace_bytes;
  }
  return absl::OkStatus();
}

int64_t CudaBackend::PartialFloats(const Plan& plan) const {
  const int64_t scan = kc::ChunkedScanScratchFloats(ctx_->dims, plan.scan_chunks);
  if (plan.tiled_attention) return scan;
  return std::max(scan, plan.NA * config_.n_heads * plan.max_chunks * (config_.head_dim + 2));
}

}  // namespace oryx
