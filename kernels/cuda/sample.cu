// Sampling on the GPU: greedy argmax (ties to the lowest index, kernels/cpu/sample.cc's order), and the
// distribution and draw of engine/sampler.cc's Sampler and the lossless acceptance of
// speculative/speculative.cc (AcceptLossless), with the uniforms given by the caller.
//
// A row's sampling distribution keeps a prefix of the candidates ordered by (logit descending, index
// ascending). The prefix is found without sorting: the cut is the key (the logit's bits, ordered like the
// floats) of its last candidate and, among candidates of that key, the last kept index. Radix selection over
// the keys (4 passes of 8 bits, histograms of counts or of probability mass in shared memory) finds the
// top_k-th candidate and then, inside those, the candidate at which the mass reaches top_p. Sums are in
// double but in another order than the CPU's, so a draw may differ from the CPU's only where the uniform or
// a top_p boundary falls within rounding of a cumulative mass. One block per row (CutKernel, DrawKernel);
// AcceptLossless judges a span's drafts in order in one block after the cuts of all its rows.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kSampleThreads = 1024;

__device__ __forceinline__ bool Better(float v, int64_t i, float best, int64_t best_i) {
  return v > best || (v == best && i < best_i);
}

// One block of kSampleThreads per row: each thread folds its logits into the largest ArgmaxKey (value, then
// the lower index), 16-byte loads where the rows allow, several in flight; then the warps' and the block's
// largest. (A block of 256 threads looping over the row took about 20 µs for 32000 logits.)
__global__ void __launch_bounds__(kSampleThreads) ArgmaxKernel(ArgmaxParams p) {
  __shared__ unsigned long long warp_best[kSampleThreads / 32];
  const float* row = p.logits_ptr + int64_t(blockIdx.x) * p.vocab;
  unsigned long long best = 0;
  if (p.vocab % 4 == 0 && reinterpret_cast<uintptr_t>(p.logits_ptr) % 16 == 0) {
    const float4* quads = reinterpret_cast<const float4*>(row);
#pragma unroll 4
    for (int64_t q = threadIdx.x; q < p.vocab / 4; q += blockDim.x) {
      const float4 v = __ldg(quads + q);
      best = max(best, max(max(ArgmaxKey(v.x, 4 * q), ArgmaxKey(v.y, 4 * q + 1)),
                           max(ArgmaxKey(v.z, 4 * q + 2), ArgmaxKey(v.w, 4 * q + 3))));
    }
  } else {
    for (int64_t i = threadIdx.x; i < p.vocab; i += blockDim.x) best = max(best, ArgmaxKey(row[i], i));
  }
  for (int offset = 16; offset > 0; offset /= 2) best = max(best, __shfl_xor_sync(0xffffffffu, best, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp != 0) return;
  best = lane < int(blockDim.x / 32) ? warp_best[lane] : 0;
  for (int offset = 16; offset > 0; offset /= 2) best = max(best, __shfl_xor_sync(0xffffffffu, best, offset));
  if (lane == 0) p.tokens_ptr[blockIdx.x * p.tokens_stride] = ArgmaxToken(best);
}

// f(logit) for each of a row's logits this thread takes (every blockDim.x-th), four at a time where the row
// allows 16-byte loads.
template <typename F>
__device__ __forceinline__ void ForEachLogit(const float* row, int64_t vocab, F&& f) {
  if (vocab % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    const float4* q4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
    for (int64_t q = threadIdx.x; q < vocab / 4; q += blockDim.x) {
      const float4 v = __ldg(q4 + q);
      f(v.x), f(v.y), f(v.z), f(v.w);
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) f(row[i]);
  }
}

// One block of kSampleThreads per row: each thread's two largest logits (the CPU's TopTwo: a repeated
// largest is also the second), the block's, then in a second pass over the row (from L2) Z = sum e^d and
// sum e^d d with d = l - top1, so that H = log Z - (sum e^d d) / Z.
__global__ void __launch_bounds__(kSampleThreads) DistributionStatsKernel(DistributionStatsParams p) {
  __shared__ float scratch[32];
  const float* row = p.logits_ptr + int64_t(blockIdx.x) * p.vocab;
  float* out = p.stats_ptr + 2 * int64_t(blockIdx.x);
  if (p.vocab < 2) {
    if (threadIdx.x == 0) out[0] = 0.f, out[1] = 0.f;
    return;
  }
  float a = -INFINITY, b = -INFINITY;
  auto fold = [&](float l) {
    if (l > a) {
      b = a, a = l;
    } else if (l > b) {
      b = l;
    }
  };
  ForEachLogit(row, p.vocab, fold);
  const float top1 = BlockMax(a, scratch);
  // Two threads holding the largest: it is also the second. Otherwise the second is the best of the holder's
  // second and the other threads' largest.
  const float holders = BlockSum(a == top1 ? 1.f : 0.f, scratch);
  const float top2 = holders > 1.5f ? top1 : BlockMax(a == top1 ? b : a, scratch);
  float z = 0.f, weighted = 0.f;
  auto add = [&](float l) {
    const float d = l - top1, w = expf(d);
    z += w, weighted += w * d;
  };
  ForEachLogit(row, p.vocab, add);
  z = BlockSum(z, scratch);
  weighted = BlockSum(weighted, scratch);
  if (threadIdx.x == 0) out[0] = logf(z) - weighted / z, out[1] = top1 - top2;
}

// ---------------------------------------------------------------------------------------------------------
// Sampling distributions

// What defines a row's distribution: candidate i is kept iff OrderedBits(x_i) > key, or OrderedBits(x_i) ==
// key and i <= last; its probability is float(e_i / mass) with e_i = exp((x_i - top) / temperature) (greedy: 1).
struct RowCut {
  float top;
  uint32_t key;
  int32_t last;
  int32_t greedy;
  double mass;
};
static_assert(sizeof(RowCut) <= 32, "SamplingWorkspaceBytes assumes 32 bytes per row");

__device__ __forceinline__ bool Kept(const RowCut& c, uint32_t key, int64_t i) {
  return key > c.key || (key == c.key && i <= c.last);
}

// e_i as the CPU computes it: float arithmetic, then exp of a float.
__device__ __forceinline__ float Weight(float x, float top, float temperature) { return expf((x - top) / temperature); }

__device__ __forceinline__ float Prob(const RowCut& c, float x, int64_t i, float temperature) {
  if (!Kept(c, OrderedBits(x), i)) return 0.f;
  return c.greedy ? 1.f : static_cast<float>(static_cast<double>(Weight(x, c.top, temperature)) / c.mass);
}

// Exclusive prefix sum over the block (blockDim.x == kSampleThreads); every thread gets its prefix and the
// total. `scratch` holds 32 values.
template <typename T>
__device__ T BlockExclusiveScan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  T inclusive = v;
  for (int offset = 1; offset < 32; offset *= 2) {
    const T other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  T before = 0, all = 0;
  for (int w = 0; w < warps; ++w) {
    if (w < warp) before += scratch[w];
    all += scratch[w];
  }
  *total = all;
  return before + inclusive - v;
}

// The contiguous slice of [0, V) that thread t walks when index order matters.
__device__ __forceinline__ void Slice(int64_t V, int64_t* begin, int64_t* end) {
  const int64_t per = (V + blockDim.x - 1) / blockDim.x;
  *begin = min(V, per * threadIdx.x);
  *end = min(V, *begin + per);
}

// The index of the n-th (1-based) candidate of key `key` in index order, or -1 when there are fewer.
__device__ int64_t NthOfKey(const float* row, int64_t V, uint32_t key, int64_t n) {
  __shared__ int64_t scratch[32];
  __shared__ int64_t found;
  int64_t begin, end;
  Slice(V, &begin, &end);
  int64_t count = 0;
  for (int64_t i = begin; i < end; ++i) count += OrderedBits(row[i]) == key;
  if (threadIdx.x == 0) found = -1;
  int64_t total;
  int64_t before = BlockExclusiveScan<int64_t>(count, scratch, &total);
  if (before < n && n <= before + count) {
    for (int64_t i = begin; i < end; ++i) {
      if (OrderedBits(row[i]) == key && ++before == n) found = i;
    }
  }
  __syncthreads();
  const int64_t result = found;
  __syncthreads();
  return result;
}

// Radix selection from the top: the largest key c such that the measure (a count, or the mass e_i) of the
// candidates in `cut` (all when null) with key >= c reaches `target`; *above gets the measure of those with
// key > c. When the whole set stays below target (rounding), the set's smallest key.
template <bool kMass>
__device__ uint32_t SelectKey(const float* row, int64_t V, float top, float temperature, const RowCut* cut,
                              double target, double* above_out) {
  __shared__ double hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ double above_s;
  uint32_t prefix = 0;
  double above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1);
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const uint32_t key = OrderedBits(row[i]);
      if ((key & high_mask) != (prefix & high_mask)) continue;
      if (cut != nullptr && !Kept(*cut, key, i)) continue;
      atomicAdd(&hist[(key >> shift) & 255], kMass ? static_cast<double>(Weight(row[i], top, temperature)) : 1.0);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chosen = -1, lowest = -1;
      double sum = above;
      for (int b = 255; b >= 0; --b) {
        if (hist[b] == 0) continue;
        lowest = b;
        if (sum + hist[b] >= target) {
          chosen = b;
          break;
        }
        sum += hist[b];
      }
      if (chosen < 0) {  // target not reached: keep the whole set
        chosen = lowest < 0 ? 0 : lowest;
        sum = above;
        for (int b = 255; b > chosen; --b) sum += hist[b];
      }
      prefix_s = prefix | (static_cast<uint32_t>(chosen) << shift);
      above_s = sum;
    }
    __syncthreads();
    prefix = prefix_s;
    above = above_s;
    __syncthreads();
  }
  *above_out = above;
  return prefix;
}

// One block per row: the row's RowCut (Sampler::Distribution's kept prefix and its mass).
__global__ void CutKernel(SamplingDims d, const float* logits_ptr, RowCut* cuts_ptr) {
  __shared__ float values[kSampleThreads];
  __shared__ int64_t indices[kSampleThreads];
  const int64_t V = d.vocab;
  const float* row = logits_ptr + int64_t(blockIdx.x) * V;
  // The first candidate: the largest logit, lowest index.
  float best = -INFINITY;
  int64_t best_i = V;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    if (Better(row[i], i, best, best_i)) best = row[i], best_i = i;
  }
  values[threadIdx.x] = best;
  indices[threadIdx.x] = best_i;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride && Better(values[threadIdx.x + stride], indices[threadIdx.x + stride],
                                       values[threadIdx.x], indices[threadIdx.x])) {
      values[threadIdx.x] = values[threadIdx.x + stride];
      indices[threadIdx.x] = indices[threadIdx.x + stride];
    }
    __syncthreads();
  }
  RowCut cut{values[0], OrderedBits(values[0]), static_cast<int32_t>(indices[0]), 1, 1.0};
  if (d.temperature == 0.f) {  // greedy: all mass on the first candidate
    if (threadIdx.x == 0) cuts_ptr[blockIdx.x] = cut;
    return;
  }
  cut.greedy = 0;
  const float top = cut.top, T = d.temperature;
  // top_k: the k-th candidate's key, and how many of the candidates of that key are kept (lowest indices).
  const int64_t k = d.top_k > 0 ? min(d.top_k, V) : V;
  cut.key = 0;
  cut.last = static_cast<int32_t>(V - 1);
  if (k < V) {
    double above = 0;
    cut.key = SelectKey<false>(row, V, top, T, nullptr, static_cast<double>(k), &above);
    cut.last = static_cast<int32_t>(NthOfKey(row, V, cut.key, k - static_cast<int64_t>(above)));
  }
  // The mass of the top_k candidates.
  double total = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    if (Kept(cut, OrderedBits(row[i]), i)) total += Weight(row[i], top, T);
  }
  __shared__ double dscratch[32];
  double sum_all;
  (void)BlockExclusiveScan<double>(total, dscratch, &sum_all);
  total = sum_all;
  cut.mass = total;
  // top_p: the shortest prefix of them whose mass reaches top_p * total.
  if (d.top_p < 1.f) {
    const double target = static_cast<double>(d.top_p) * total;
    double above = 0;
    const RowCut k_cut = cut;
    const uint32_t key = SelectKey<true>(row, V, top, T, &k_cut, target, &above);
    // Candidates of that key in the top_k set, each of weight e: the fewest n >= 1 with above + n e >= target.
    const float x = __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);  // the logit of that key
    const double e = Weight(x, top, T);
    int64_t n = e > 0 ? static_cast<int64_t>(fmin(static_cast<double>(V), fmax(1.0, ceil((target - above) / e)))) : 1;
    while (n > 1 && above + (n - 1) * e >= target) --n;
    while (above + n * e < target && n < V) ++n;  // more than the key has: NthOfKey says so (-1)
    int64_t last = NthOfKey(row, V, key, n);
    if (key == k_cut.key && (last < 0 || last > k_cut.last)) last = k_cut.last;
    if (last < 0) {  // rounding asked for more candidates of that key than there are: all of them
      last = V - 1;
    }
    cut.key = key;
    cut.last = static_cast<int32_t>(last);
    // The kept mass, recomputed over the kept set.
    double kept = 0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      if (Kept(cut, OrderedBits(row[i]), i)) kept += Weight(row[i], top, T);
    }
    (void)BlockExclusiveScan<double>(kept, dscratch, &sum_all);
    cut.mass = sum_all;
  }
  if (threadIdx.x == 0) cuts_ptr[blockIdx.x] = cut;
}

// Sampler::Draw over probabilities given per index by `prob(i)`: the first index, in index order, whose
// cumulative probability exceeds uniform * total; the last positive one when rounding runs past the end.
template <typename ProbFn>
__device__ int64_t DrawIndexOrder(int64_t V, double uniform, ProbFn prob) {
  __shared__ double scratch[32];
  __shared__ int64_t found;
  __shared__ int64_t last_positive;
  int64_t begin, end;
  Slice(V, &begin, &end);
  double mass = 0;
  int64_t my_last = -1;
  for (int64_t i = begin; i < end; ++i) {
    const float pi = prob(i);
    if (pi <= 0.f) continue;
    mass += pi;
    my_last = i;
  }
  if (threadIdx.x == 0) found = V, last_positive = 0;
  double total;
  const double before = BlockExclusiveScan<double>(mass, scratch, &total);
  const double threshold = uniform * total;
  if (my_last >= 0) atomicMax(reinterpret_cast<unsigned long long*>(&last_positive), my_last);
  if (my_last >= 0 && threshold < before + mass) {
    double running = before;
    for (int64_t i = begin; i < end; ++i) {
      const float pi = prob(i);
      if (pi <= 0.f) continue;
      running += pi;
      if (threshold < running) {
        atomicMin(reinterpret_cast<unsigned long long*>(&found), i);
        break;
      }
    }
  }
  __syncthreads();
  const int64_t result = found < V ? found : last_positive;
  __syncthreads();
  return result;
}

// One block per row: the token Sampler::Next draws from the row's distribution with the row's uniform.
__global__ void DrawKernel(SamplingDims d, const float* logits_ptr, const RowCut* cuts_ptr,
                           const double* uniforms_ptr, int32_t* tokens_ptr, int64_t tokens_stride) {
  const float* row = logits_ptr + int64_t(blockIdx.x) * d.vocab;
  const RowCut cut = cuts_ptr[blockIdx.x];
  int32_t* token_out = tokens_ptr + int64_t(blockIdx.x) * tokens_stride;
  if (cut.greedy) {
    if (threadIdx.x == 0) *token_out = cut.last;
    return;
  }
  const int64_t token = DrawIndexOrder(d.vocab, uniforms_ptr[blockIdx.x],
                                       [&](int64_t i) { return Prob(cut, row[i], i, d.temperature); });
  if (threadIdx.x == 0) *token_out = static_cast<int32_t>(token);
}

// Plain temperature sampling (every token kept: top_k 0 or >= V, top_p 1), a row per cluster of `parts` blocks
// (up to kDrawParts, as many as one wave holds) that split it into contiguous parts, so that a few rows still
// spread over several SMs (CutKernel then DrawKernel, a block each per row, took 45 µs for one row of 32000
// logits on the H200; this kernel 14 µs with 8 parts). The blocks share, through
// distributed shared memory and in part order, the row's largest logit, its mass sum_i e_i and each part's
// mass of probabilities float(e_i / mass); the part where the cumulative mass passes uniform * total finds the
// token in index order, as DrawIndexOrder does.
constexpr int kDrawParts = 8;

__global__ void __launch_bounds__(kSampleThreads) SoftmaxDrawKernel(SampleRowsParams p, int parts) {
  __shared__ float part_top;
  __shared__ double part_mass, part_probs, scratch[32];
  __shared__ int64_t found, last_positive;
  AfterPrevious();
  const unsigned part = ClusterRank();
  const int64_t r = blockIdx.x / parts, V = p.dims.vocab;
  const float* row = p.logits_ptr + r * V;
  const float T = p.dims.temperature;
  // This block's part of the row, and this thread's contiguous slice of it (index order matters for the draw).
  const int64_t per_part = (V + parts - 1) / parts, b0 = min(V, per_part * part), b1 = min(V, b0 + per_part);
  const int64_t per = (b1 - b0 + blockDim.x - 1) / blockDim.x;
  const int64_t begin = min(b1, b0 + per * threadIdx.x), end = min(b1, begin + per);
  // 1. The row's largest logit (the first two passes read the part coalesced; the order of their sums is
  // free, as the CPU's is its own).
  float top = -INFINITY;
  for (int64_t i = b0 + threadIdx.x; i < b1; i += blockDim.x) top = fmaxf(top, row[i]);
  for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
  if (threadIdx.x % 32 == 0) reinterpret_cast<float*>(scratch)[threadIdx.x / 32] = top;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < int(blockDim.x / 32); ++w) top = fmaxf(top, reinterpret_cast<float*>(scratch)[w]);
    part_top = top;
  }
  ClusterSync();
  top = -INFINITY;
  for (unsigned q = 0; q < unsigned(parts); ++q) top = fmaxf(top, *ClusterPeer(&part_top, q));
  // 2. The row's mass, summed over the parts in order.
  double mass = 0;
  for (int64_t i = b0 + threadIdx.x; i < b1; i += blockDim.x) mass += Weight(row[i], top, T);
  double all;
  (void)BlockExclusiveScan<double>(mass, scratch, &all);
  if (threadIdx.x == 0) part_mass = all;
  ClusterSync();
  double total_mass = 0;
  for (unsigned q = 0; q < unsigned(parts); ++q) total_mass += *ClusterPeer(&part_mass, q);
  // 3. The probabilities' cumulative mass: this thread's, before it in the part, before the part.
  double probs = 0;
  int64_t my_last = -1;
  // Every token kept: Prob with a cut that keeps all (the lowest key, the last index).
  const RowCut all_kept{top, 0u, static_cast<int32_t>(V - 1), 0, total_mass};
  for (int64_t i = begin; i < end; ++i) {
    const float pi = Prob(all_kept, row[i], i, T);
    if (pi <= 0.f) continue;
    probs += pi;
    my_last = i;
  }
  const double in_part = BlockExclusiveScan<double>(probs, scratch, &all);
  if (threadIdx.x == 0) part_probs = all, found = V, last_positive = 0;
  ClusterSync();
  double before = 0, total = 0;
  for (unsigned q = 0; q < unsigned(parts); ++q) {
    const double m = *ClusterPeer(&part_probs, q);
    if (q < part) before += m;
    total += m;
  }
  // 4. The first index whose cumulative probability exceeds uniform * total.
  const double threshold = p.uniforms_ptr[r] * total;
  if (my_last >= 0) atomicMax(reinterpret_cast<unsigned long long*>(&last_positive), my_last);
  double running = before + in_part;
  if (my_last >= 0 && threshold < running + probs) {
    for (int64_t i = begin; i < end; ++i) {
      const float pi = Prob(all_kept, row[i], i, T);
      if (pi <= 0.f) continue;
      running += pi;
      if (threshold < running) {
        atomicMin(reinterpret_cast<unsigned long long*>(&found), i);
        break;
      }
    }
  }
  ClusterSync();  // every part's found and last_positive in place
  if (part == 0 && threadIdx.x == 0) {
    int64_t token = V, last = 0;
    for (unsigned q = 0; q < unsigned(parts); ++q) {
      token = min(token, *ClusterPeer(&found, q));
      last = max(last, *ClusterPeer(&last_positive, q));
    }
    p.tokens_ptr[r * p.tokens_stride] = static_cast<int32_t>(token < V ? token : last);
  }
  ClusterSync();  // no block leaves while rank 0 reads its shared memory
}

// One block per row: the row's sampling distribution (what Sampler::Distribution writes), for the lossless
// acceptance of a token drawn from it.
__global__ void DistributionKernel(SamplingDims d, const float* logits_ptr, const RowCut* cuts_ptr, float* probs_ptr,
                                   int64_t probs_row_stride) {
  const float* row = logits_ptr + int64_t(blockIdx.x) * d.vocab;
  const RowCut cut = cuts_ptr[blockIdx.x];
  float* out = probs_ptr + int64_t(blockIdx.x) * probs_row_stride;
  for (int64_t i = threadIdx.x; i < d.vocab; i += blockDim.x) {
    out[i] = cut.greedy ? (i == cut.last ? 1.f : 0.f) : Prob(cut, row[i], i, d.temperature);
  }
}

// One block: AcceptLossless over the span's rows (their cuts made), drafts judged in order.
__global__ void AcceptKernel(AcceptLosslessParams p, const RowCut* cuts_ptr) {
  const int64_t V = p.dims.vocab, n = p.drafts;
  const float T = p.dims.temperature;
  for (int64_t i = 0; i < n; ++i) {
    const RowCut cut = cuts_ptr[i];
    const float* row = p.logits_ptr + i * V;
    const int32_t draft = p.drafts_ptr[i];
    if (cut.greedy) {
      if (draft == cut.last) continue;
      if (threadIdx.x == 0) p.result_ptr[0] = static_cast<int32_t>(i), p.result_ptr[1] = cut.last;
      return;
    }
    const float pd = Prob(cut, row[draft], draft, T);
    const float qd = p.maybe_q_ptr == nullptr ? 1.f : p.maybe_q_ptr[i * V + draft];
    if (p.uniforms_ptr[i] < static_cast<double>(pd) / qd) continue;
    // Rejected: the recovered token from norm(max(0, p - q)), with the next uniform.
    const float* q = p.maybe_q_ptr == nullptr ? nullptr : p.maybe_q_ptr + i * V;
    const int64_t next = DrawIndexOrder(V, p.uniforms_ptr[i + 1], [&](int64_t v) {
      const float qv = q == nullptr ? (v == draft ? 1.f : 0.f) : q[v];
      return fmaxf(0.f, Prob(cut, row[v], v, T) - qv);
    });
    if (threadIdx.x == 0) p.result_ptr[0] = static_cast<int32_t>(i), p.result_ptr[1] = static_cast<int32_t>(next);
    return;
  }
  // All accepted: the bonus token from p_n.
  const RowCut cut = cuts_ptr[n];
  const float* row = p.logits_ptr + n * V;
  int64_t next = cut.last;
  if (!cut.greedy) {
    next = DrawIndexOrder(V, p.uniforms_ptr[n], [&](int64_t v) { return Prob(cut, row[v], v, T); });
  }
  if (threadIdx.x == 0) p.result_ptr[0] = static_cast<int32_t>(n), p.result_ptr[1] = static_cast<int32_t>(next);
}

}  // namespace

void Argmax(const ArgmaxParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  ArgmaxKernel<<<static_cast<unsigned>(p.rows), kSampleThreads, 0, stream>>>(p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void DistributionStats(const DistributionStatsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  DistributionStatsKernel<<<static_cast<unsigned>(p.rows), kSampleThreads, 0, stream>>>(p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

int64_t SamplingWorkspaceBytes(int64_t rows) { return rows * 32; }

void SampleRows(const SampleRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  const bool every_token_kept = (p.dims.top_k == 0 || p.dims.top_k >= p.dims.vocab) && p.dims.top_p >= 1.f;
  if (p.dims.temperature > 0.f && every_token_kept && p.maybe_probs_ptr == nullptr && HopperOrLater()) {
    // Parts per row: the most, up to kDrawParts, that keep the grid in one wave of two blocks per SM.
    int parts = kDrawParts;
    while (parts > 1 && p.rows * parts > 2 * int64_t{MultiprocessorCount()}) parts /= 2;
    LaunchAfterPrevious(SoftmaxDrawKernel, dim3(static_cast<unsigned>(p.rows * parts)), dim3(kSampleThreads), 0,
                        stream, dim3(static_cast<unsigned>(parts)), p, parts);
    ORYX_CUDA_CHECK(cudaGetLastError());
    return;
  }
  auto* cuts = static_cast<RowCut*>(p.workspace_ptr);
  CutKernel<<<static_cast<unsigned>(p.rows), kSampleThreads, 0, stream>>>(p.dims, p.logits_ptr, cuts);
  ORYX_CUDA_CHECK(cudaGetLastError());
  if (p.maybe_probs_ptr != nullptr) {
    DistributionKernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p.dims, p.logits_ptr, cuts,
                                                                             p.maybe_probs_ptr, p.probs_row_stride);
    ORYX_CUDA_CHECK(cudaGetLastError());
  }
  DrawKernel<<<static_cast<unsigned>(p.rows), kSampleThreads, 0, stream>>>(p.dims, p.logits_ptr, cuts, p.uniforms_ptr,
                                                                         p.tokens_ptr, p.tokens_stride);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void AcceptLossless(const AcceptLosslessParams& p, cudaStream_t stream) {
  auto* cuts = static_cast<RowCut*>(p.workspace_ptr);
  CutKernel<<<static_cast<unsigned>(p.drafts + 1), kSampleThreads, 0, stream>>>(p.dims, p.logits_ptr, cuts);
  ORYX_CUDA_CHECK(cudaGetLastError());
  AcceptKernel<<<1, kSampleThreads, 0, stream>>>(p, cuts);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
