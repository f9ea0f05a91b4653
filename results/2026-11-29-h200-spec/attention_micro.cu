// Playground: per-row vs grouped attention kernels over one sequence's 1.4b-sized KV cache (one layer).
#include <cstdio>
#include <vector>
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"
using namespace oryx::kernels::cuda;
int main() {
  const int H = 16, dh = 128, HD = H * dh;
  for (int64_t ctx : {1024, 8192, 32768}) {
    const int64_t cap = ctx + 16;
    bf16 *k, *v; float *qa, *out, *partial, *dummy; int32_t *attn, *row_seq, *groups; SeqDesc* seqs;
    ORYX_CUDA_CHECK(cudaMalloc(&k, cap * HD * 2)); ORYX_CUDA_CHECK(cudaMalloc(&v, cap * HD * 2));
    FillUniform(k, cap * HD, 1, -1, 1, nullptr); FillUniform(v, cap * HD, 2, -1, 1, nullptr);
    ORYX_CUDA_CHECK(cudaMalloc(&qa, 16 * HD * 4)); ORYX_CUDA_CHECK(cudaMalloc(&out, 16 * HD * 4));
    FillUniform(qa, 16 * HD, 3, -1, 1, nullptr);
    ORYX_CUDA_CHECK(cudaMalloc(&partial, 16ll * H * 4096 * (dh + 2) * 4));
    ORYX_CUDA_CHECK(cudaMalloc(&dummy, 64));
    ORYX_CUDA_CHECK(cudaMalloc(&attn, 64 * 4)); ORYX_CUDA_CHECK(cudaMalloc(&row_seq, 64 * 4));
    ORYX_CUDA_CHECK(cudaMalloc(&groups, 64 * 4)); ORYX_CUDA_CHECK(cudaMalloc(&seqs, sizeof(SeqDesc)));
    std::vector<int32_t> idx(16), zeros(16, 0);
    for (int i = 0; i < 16; ++i) idx[i] = i;
    cudaMemcpy(attn, idx.data(), 64, cudaMemcpyHostToDevice);
    cudaMemcpy(row_seq, zeros.data(), 64, cudaMemcpyHostToDevice);
    for (int R : {1, 3, 5, 9}) {
      SeqDesc s{0, R, ctx - R + 1, cap, dummy, dummy, k, v, nullptr, nullptr};
      cudaMemcpy(seqs, &s, sizeof s, cudaMemcpyHostToDevice);
      std::vector<int32_t> g;
      for (int a0 = 0; a0 < R; a0 += kAttentionGroupRows) g.insert(g.end(), {a0, std::min(kAttentionGroupRows, R - a0)});
      cudaMemcpy(groups, g.data(), g.size() * 4, cudaMemcpyHostToDevice);
      ModelDims dims{HD, H, dh, 4, 5440, 32000, 5 * HD + H, false, false, 1e-6f, 10000.0};
      for (int grouped = 0; grouped < 2; ++grouped) {
        const int64_t NG = g.size() / 2;
        const int64_t chunk = AttentionChunkFor(ctx + 1, grouped ? NG : R, H);
        const int64_t max_chunks = (ctx + 1 + chunk - 1) / chunk;
        AttentionParams p{dims, 0, R, chunk, max_chunks, attn, row_seq, seqs, qa, partial, out,
                          grouped ? NG : 0, grouped ? groups : nullptr, std::min(kAttentionGroupRows, R)};
        cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
        for (int i = 0; i < 5; ++i) Attention(p, nullptr);
        cudaEventRecord(a);
        for (int i = 0; i < 50; ++i) Attention(p, nullptr);
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); ms /= 50;
        const double bytes = 2.0 * 2 * HD * (ctx + 1);
        std::printf("ctx %6lld rows %d %-8s chunk %3lld: %7.1f us (KV once: %5.0f GB/s)\n", (long long)ctx, R,
                    grouped ? "grouped" : "per-row", (long long)chunk, ms * 1e3, bytes / (ms * 1e-3) / 1e9);
      }
    }
    cudaFree(k); cudaFree(v); cudaFree(qa); cudaFree(out); cudaFree(partial);
  }
}
