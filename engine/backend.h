// The engine's forward contract (DESIGN.md §5): the state a sequence carries, one batched forward over
// spans of tokens with a mode per token, and the Backend interface behind which the CPU and CUDA
// implementations sit. No Eigen, CUDA or LibTorch in this header.
//
// Dimension legend: T tokens in a span, D d_model, H heads, dh head dim, HD = H*dh, V vocab, w conv width.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/aligned_vector.h"
#include "kernels/ops.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/kv_blocks.h"

namespace oryx {

enum class Mode : uint8_t { kLinear = 0, kAttention = 1 };

// Positions per host KV block: attention runs a GEMM per block, and a clone copies at most one block.
inline constexpr int64_t kHostKvBlockTokens = 64;

// A host KV pool for this model with room for `sequences` full-length sequences before it first grows, in
// blocks of `block_tokens` positions of `format` elements.
std::shared_ptr<HostKvPool> NewHostKvPool(const ModelConfig& config, int64_t sequences,
                                          int64_t block_tokens = kHostKvBlockTokens,
                                          kernels::KvFormat format = kernels::KvFormat::kF32);

// A sequence's state held by a device backend (the CUDA one), opaque here so that no device types appear in
// this header. SequenceState forwards its copies, reservations and rollback to it; the backend that made
// it is the only one that reads it.
class DeviceSequence {
 public:
  virtual ~DeviceSequence() = default;
  virtual const void* owner() const = 0;  // the backend that made it
  // A copy of the recurrent state and (when with_kv) of the first `position` tokens' KV cache, which it may
  // share with this one until either writes there, with room for `capacity` positions (< 0: as many as this
  // one has; never fewer than `position`); ResourceExhausted when the device has no room for it.
  virtual absl::StatusOr<std::unique_ptr<DeviceSequence>> Clone(bool with_kv, int64_t position,
                                                                int64_t capacity) const = 0;
  virtual void CopyRecurrentFrom(const DeviceSequence& other) = 0;
  // ResourceExhausted, the state unchanged, when the device has no room for it.
  virtual absl::Status Reserve(int64_t tokens, int64_t position) = 0;
  virtual int64_t kv_bytes() const = 0;
  virtual int64_t kv_capacity() const = 0;  // positions the KV cache has room for
  virtual int64_t kv_block_tokens() const = 0;  // positions per KV block
  virtual int64_t kv_shared_blocks() const = 0;  // KV blocks another sequence holds too
  // The KV blocks held, in position order, by their ids in kv_pool() (an id names one block while any holder
  // keeps it).
  virtual std::span<const int32_t> kv_block_ids() const = 0;
  virtual const void* kv_pool() const = 0;
  // Every KV block another sequence holds too replaced by a copy of its own; ResourceExhausted when the device
  // has no room.
  virtual absl::Status UnshareKv() = 0;
  // Brings the recurrent state and conv window back to after `keep` tokens of the last keep_states span.
  virtual void RestoreSpan(int64_t keep) = 0;
};

struct ForwardItem;

// Everything one sequence carries between forwards, per layer: the KV cache of every token so far (whatever
// its mode), the recurrent state S [H, dh, dh], the conv window of the last w-1 inputs, and the position.
// Move-only; the deep copies are explicit (Clone, CopyRecurrentFrom).
//
// A *draft* sequence (MakeDraft) has no KV cache: it can run linear-mode tokens only, and writes no KV. It
// is what a speculative proposer runs on (DESIGN.md §6).
//
// Rollback: a forward with keep_states records the recurrent state after every token of its span and the
// span's conv inputs, so Truncate() can go back to any position inside that span without running the model.
class SequenceState {
 public:
  // A host sequence with a KV pool of its own (shared with its clones).
  explicit SequenceState(const ModelConfig& config);
  // A host sequence whose KV blocks come from `kv_pool` (a backend's, shared by all its sequences).
  SequenceState(const ModelConfig& config, std::shared_ptr<HostKvPool> kv_pool);
  // A sequence whose KV cache and recurrent state live in `device` (made by a device backend).
  SequenceState(const ModelConfig& config, std::unique_ptr<DeviceSequence> device);
  SequenceState(SequenceState&&) = default;
  SequenceState& operator=(SequenceState&&) = default;
  SequenceState(const SequenceState&) = delete;
  SequenceState& operator=(const SequenceState&) = delete;

  int64_t position() const { return position_; }  // tokens processed so far
  bool has_kv() const { return has_kv_; }
  // The mode each position ran in (with a KV cache; a draft keeps none): what recomputing the sequence from its
  // tokens needs to come back to the same state.
  std::span<const Mode> modes() const { return modes_; }

  SequenceState Clone() const;  // a snapshot: restore it by move-assigning it back
  // A draft sequence with this one's recurrent state, conv window and position and no KV cache.
  SequenceState MakeDraft() const;
  // The same, ResourceExhausted when the device has no room for the copy (Clone and MakeDraft abort then,
  // naming the shortage: for tests and tools that hold few sequences).
  absl::StatusOr<SequenceState> TryClone() const;
  // A clone whose KV cache is its own copy, shared with nobody, as a sequence prefilled apart would have (a
  // Clone shares the blocks): for benchmarks, where sequences that share memory would read less of it.
  absl::StatusOr<SequenceState> TryCopy() const;
  // A clone with room for `tokens` positions in all and no more (the blocks past the shared ones reserved):
  // the prefix cache keeps clones with no room past their position, and gives back ones with the room their
  // requests reserve.
  absl::StatusOr<SequenceState> TryCloneWithRoom(int64_t tokens) const;
  absl::StatusOr<SequenceState> TryMakeDraft() const;
  // Overwrites the recurrent state, conv window and position with `other`'s (any KV cache is left alone,
  // and allocation happens only the first time). For refreshing a draft sequence each round.
  void CopyRecurrentFrom(const SequenceState& other);

  // Makes room for `tokens` positions in all, so forwards up to there allocate nothing (the KV blocks that
  // cover them, unless a clone shares the one being written). ResourceExhausted, the sequence unchanged, when
  // the memory (host or device) is not there.
  absl::Status Reserve(int64_t tokens);
  // Bytes held by the KV cache (the blocks held, shared or not: all layers).
  int64_t kv_bytes() const;
  // Positions the KV cache has room for before it grows (0 for a draft).
  int64_t kv_capacity() const;
  // Bytes of the recurrent state and conv window (all layers).
  int64_t recurrent_bytes() const;
  // KV blocks this sequence holds that others hold too (clones, the prefix cache).
  int64_t kv_shared_blocks() const;
  // The KV blocks held, in position order, by their ids in kv_pool() (the pool they come from: ids of one
  // pool name one block while any holder keeps it), each of kv_block_bytes(): what the prefix cache counts
  // once, however many of its snapshots share a block.
  std::span<const int32_t> kv_block_ids() const;
  const void* kv_pool() const;
  int64_t kv_block_bytes() const;
  // Positions per KV block: the granularity of Reserve and kv_bytes.
  int64_t kv_block_tokens() const;

  // Goes back to `position` (<= position()). The KV cache is cut there. The recurrent state and conv window
  // can be brought back only to a position inside the last span forwarded with keep_states (its start
  // included): FailedPrecondition otherwise; InvalidArgument past the current position.
  absl::Status Truncate(int64_t position);

  DeviceSequence* device() const { return device_.get(); }  // null for a host (CPU) sequence

 private:
  friend class CpuBackend;
  friend class CudaBackend;
  friend absl::Status ValidateForwardBatch(const ModelConfig& config, std::span<const ForwardItem> batch,
                                           const void* device_owner);
  SequenceState(const SequenceState& other, int);  // copies the scalars only
  // Host KV cache: blocks of kv_block_tokens() positions, each holding every layer's rotated keys and
  // values (kv_); blocks past the position are reserved room. A clone shares the blocks (reference
  // counts); a block shared or published to the prefix cache is copied before it is written (PrepareKv).
  // A block holds a layer's keys head by head, [heads][block_tokens][row], so that one head's rows (what a
  // decode step's attention reads) are contiguous; likewise its values. KeyAt is head h's key at a position:
  // a row of kernels::KvHeadRowElements elements in the pool's format (float, uint16_t, or int8_t and a scale).
  void* KeyAt(int64_t layer, int64_t position, int64_t head) { return HeadRow(false, layer, position, head); }
  void* ValueAt(int64_t layer, int64_t position, int64_t head) { return HeadRow(true, layer, position, head); }
  void* HeadRow(bool values, int64_t layer, int64_t position, int64_t head) {
    HostKvPool& pool = *kv_.pool();
    const int64_t b = pool.block_tokens(), block = kv_[position / b];
    return static_cast<std::byte*>(values ? pool.values(block, layer) : pool.keys(block, layer)) +
           (head * b + position % b) * kernels::KvHeadRowElements(pool.format(), head_dim_) * pool.element_bytes();
  }
  // Blocks for positions [0, end), those from the position on writable by this sequence alone.
  absl::Status PrepareKv(int64_t end);
  // After a backend ran a span in `modes` on this sequence: the position, the mode log and the keep_states span.
  void Advance(std::span<const Mode> modes, bool keep_states);
  // The host's side of CopyRecurrentFrom and of Truncate, after a device backend moved the states itself (a
  // whole speculative round refreshes its drafts and rolls its sequences back in its own launches).
  void RecordRecurrentCopy(const SequenceState& other);
  absl::Status TruncateRestored(int64_t position) { return Cut(position, /*restore=*/false); }
  absl::Status Cut(int64_t position, bool restore);  // Truncate; restore: the states too
  // 64-byte aligned (kernels/aligned_vector.h): a forward's bits must not depend on where these lie.
  using Floats = kernels::AlignedVector<float>;
  struct Layer {
    Floats s;     // [H, dh, dh]     recurrent state
    Floats conv;  // [w-1, 2*HD]     the last w-1 conv inputs, oldest first
    // keep_states history of the last span of T tokens:
    Floats span_states;  // [H, T+1, dh, dh]: before the span, then after each token
    Floats span_inputs;  // [w-1+T, 2*HD]:    the conv window before the span, then its inputs
  };
  std::vector<Layer> layers_;
  HostKvTable kv_;  // host sequences: their KV blocks (no pool: a device sequence)
  std::vector<Mode> modes_;  // of every position, when has_kv_
  int64_t position_ = 0;
  bool has_kv_ = true;
  int64_t span_start_ = -1, span_len_ = 0;  // the keep_states span (span_start_ < 0: none)
  int64_t heads_ = 0, head_dim_ = 0, conv_rows_ = 0;
  std::unique_ptr<DeviceSequence> device_;  // set: the state lives there and layers_ hold no data
};

class Sampler;
struct LogitStats;  // engine/sampler.h

// Which rows of logits a forward returns for a span.
enum class LogitsRows : uint8_t { kNone, kLast, kAll };

// One sequence's part of a batched forward: tokens[i] runs in modes[i] at position seq->position() + i.
struct ForwardItem {
  SequenceState* seq = nullptr;
  std::span<const int32_t> tokens;
  std::span<const Mode> modes;
  LogitsRows logits = LogitsRows::kLast;
  std::vector<float>* logits_out = nullptr;  // resized to rows * V, row-major; required unless kNone
  bool keep_states = false;                  // record the span for Truncate (speculative verification)
  // Set (with logits kLast): the backend also draws the span's next token from its last row, as
  // sampler->Next(row) would (the sampler's stream advanced the same way), into *next_token. logits_out may
  // then be null. The CUDA backend draws on the device when the batch's samplers share their parameters: only
  // the tokens come back to the host, not V floats a row (and the rows of the items that ask for logits_out).
  Sampler* sampler = nullptr;
  int32_t* next_token = nullptr;
  // Set (with a sampler): the backend also writes the last row's LogitStats (LogitStatsOf). The CUDA backend computes
  // them on the device beside its draw, so that a router that reads them still gets two numbers back, not V floats.
  LogitStats* stats_out = nullptr;
};

// How many rows of logits a forward gives the item.
inline int64_t LogitRowsOf(const ForwardItem& it) {
  return it.logits == LogitsRows::kAll ? static_cast<int64_t>(it.tokens.size()) : it.logits == LogitsRows::kLast;
}

// One sequence's part of a speculative round run whole by the backend (Backend::SpeculativeRound).
struct RoundResult;
struct RoundItem {
  SequenceState* seq = nullptr;    // has a KV cache; `pending` is its next token, not yet run
  // A draft sequence of the same backend, which the round refreshes from seq (recurrent state, conv window,
  // position) before its drafts.
  SequenceState* draft = nullptr;
  int32_t pending = 0;
  // The slot's sampler: greedy, or the distribution drafts are drawn from and judged against. The backend
  // peeks its uniforms and leaves the stream where it is; the caller skips the ones the round used
  // (UniformsOfSampledRound).
  Sampler* sampler = nullptr;
  RoundResult* result = nullptr;  // out
};

// What a round run by the backend gives back for one sequence. The backend runs the drafts and the verify
// span and judges them; cutting the sequence back to after the accepted drafts is the backend's (cut) or the
// caller's.
struct RoundResult {
  std::vector<int32_t> drafts;  // d_1..d_k
  // Greedy: the argmax of each verify row p_0..p_k, which the caller's accept rule compares with the drafts.
  std::vector<int32_t> targets;
  // Sampled: the verdict of the backend's own lossless rule (it ran on the device): how many drafts it
  // accepted, and the recovered or bonus token.
  int64_t accepted = 0;
  int32_t next = 0;
  // The backend cut seq back to after `pending` and the `accepted` drafts itself (greedy rounds count them
  // too, with the greedy rule, and set `next`); the caller's commit then only hands out the tokens. Otherwise
  // seq is after the whole verify span [pending, d_1..d_k], and the caller cuts it.
  bool cut = false;
};

// The uniforms a slot's sampler gives a sampled lossless round of k drafts of which `accepted` are accepted:
// one per draft (the linear drafts), one per judged draft and one for the recovered or bonus token
// (speculative::AcceptLossless). A backend that peeks all 2k + 1 up front leaves the caller to skip this many.
inline int64_t UniformsOfSampledRound(int64_t k, int64_t accepted) {
  return k + (accepted < k ? accepted + 2 : k + 1);
}

// The greedy rule over a round's verify argmaxes (targets [n + 1]): d_i is accepted while it equals
// targets[i - 1]; *next = the target after the accepted prefix. speculative::AcceptLossless's greedy branch,
// the judge of rounds a backend ran whole (RoundResult::targets), and the count a backend that cuts greedy
// rounds itself reports.
inline int64_t AcceptGreedy(std::span<const int32_t> drafts, std::span<const int32_t> targets, int32_t* next) {
  const int64_t n = static_cast<int64_t>(drafts.size());
  int64_t accepted = 0;
  while (accepted < n && drafts[accepted] == targets[accepted]) ++accepted;
  *next = targets[accepted];
  return accepted;
}

// Paths of the CUDA backend that can be turned off, each on by default: for measuring what a path brings.
// The command line sets them from ORYX_CUDA_* environment variables (FromEnvironment; "0" turns a path off,
// ORYX_CUDA_PROFILE=1 and ORYX_CUDA_GEMV_ROWS=N set the last two).
struct CudaSwitches {
  bool fused_gemv = true;           // FUSED: norms and SwiGLU fused into the products (CudaBackend::set_fused_gemv)
  bool decode_mixer = true;         // DECODE_MIXER: a decode step's conv, window and recurrence as one kernel
  // SPLIT_NORMS: a batch's forward (2-32 rows on the tensor-core GEMV) splits each residual RMSNorm between the
  // product that adds into the residual and the one that reads the norm (no norm kernel between them).
  bool split_norms = true;
  // MIXER_NORM: a batch's decode step with no attention row runs the gated norm in the decode mixer kernel.
  bool mixer_norm = true;
  bool skip_q_linear = true;        // SKIP_Q_LINEAR: no q_linear rows when every token attends
  bool chunked_scan = true;         // CHUNKED_SCAN: long linear spans in chunks
  bool tiled_attention = true;      // TILED_ATTENTION: prefill attention on tensor cores
  bool group_mma = true;            // GROUP_MMA: verify spans of 3 or more rows attend on tensor cores
  bool wide_gemv = true;            // GEMV_WIDE: the wide single-row product where its grid fits
  bool early_loads = true;          // EARLY_LOADS: loads of constants before the wait for the previous kernel
  bool programmatic_launch = true;  // PDL: programmatic dependent launch (a Hopper or later)
  bool split_ragged_gemm = true;    // SPLIT_GEMM: cuBLAS products of a ragged output count as two products
  int multirow_bf16 = -1;           // MULTIROW: 2-8 rows by the several-row GEMV: 1 on, 0 off, -1 (auto) small products
  int fused_rows = 1;               // FUSED_ROWS: forwards of up to this many rows (at most 8) take the fused path
  // MIXER_PREFETCH: MiB (0-64) of the up projection's bf16 weights that a decode step's mixer asks L2 to fetch
  // before its wait, in steps where no row attends; 0: none (docs/CUDA.md, "The up projection's first weights in
  // L2").
  int mixer_prefetch_mib = 12;
  // DOWN_PREFETCH: MiB (0-64) of the next layer's input projection (the last layer: the LM head) that the down
  // projection asks L2 to fetch before its wait, on the tensor-core GEMV at batches of 2-8, in bf16 steps where no
  // row attends; 0: none (docs/CUDA.md, "The up projection's first weights in L2").
  int down_prefetch_mib = 8;
  int gemv_rows_per_warp = 0;       // GEMV_ROWS: rows per warp of the single-row products; 0: chosen per product
  // GRAPH_AFTER: a forward or round shape is captured as a CUDA graph at its n-th use (earlier uses run its
  // launches directly). A server meets shapes (batch size x draft length) that never come back; capturing each
  // on first use costs more than running it.
  int graph_after = 2;
  // ROUND_PADDING: a whole speculative round's batch is padded with idle sequences to the next of 1, 2, 4
  // and the multiples of 8, so that a server's changing batch meets a few round graphs, not one per size.
  bool round_padding = true;
  // MIXED_DRAWS: a forward whose samplers share their parameters draws on the device even where other items ask
  // for their logits (a verify span beside decoding sequences); off, any such item sends every draw to the host.
  bool mixed_draws = true;
  // GROUP_MMA_ROWS: a verify span's groups of at least this many attention rows attend on tensor cores; ATTN_CHUNK
  // and MMA_CHUNK: the most keys one block of the CUDA-core kernels (at most 512) and of the tensor-core group
  // kernel (at most 1024) takes. Measured on the H200 (docs/CUDA.md, "Verify attention at 16K").
  int group_mma_min_rows = 3;
  int attention_chunk = 256;
  int group_mma_chunk = 1024;
  // FP8_MMA_ROWS: FP8 products of at least this many rows (at most 128) run on tensor cores (fewer: the GEMVs).
  int fp8_mma_min_rows = 8;
  // BF16_MMA_ROWS: bf16 products of 2 to this many rows (at most 32) run on the tensor-core GEMV; 0: none (the
  // several-row GEMV and cuBLAS take them, as they take more rows).
  int bf16_mma_gemv_rows = 32;
  // FP8_GEMV_ROWS: the same for FP8 weights (at most 32; 0: none, so that the several-row GEMV and the FP8
  // tensor-core kernel take them).
  int fp8_mma_gemv_rows = 32;
  // HEAD_MIXER_SEQS and HEAD_MIXER_DIM: decode steps of at least this many sequences (0: none), of a model whose
  // head_dim is at least this, run the decode mixer a head per block, the head's state streaming into shared
  // memory during the input projection; others, a head per cluster of dh/32 blocks (a lone sequence spread over
  // more SMs). Measured faster at head_dim 128 from batch 8; at 64 slower at batch 32 (results/2026-12-07-mixer-b8).
  // HEAD_MIXER_CARVEOUT: the percent of shared memory that mixer asks for (-1: the driver's choice, which left
  // the GEMVs after it too little L1); KernelSwitches::head_mixer_carveout.
  int head_mixer_seqs = 2;
  int head_mixer_dim = 128;
  int head_mixer_carveout = 0;
  // PREFILL_ROWS and PREFILL_SPAN: prompt rows of one prefill forward at most (shared by the prompts prefilled
  // together; 0: as many as 1.25 GiB of activations hold, 2,048 to 32,768), and tokens of one prompt in it
  // at most (Backend::PrefillSpan). Long spans fill the GPU: a 16K prompt of models/default prefilled in one
  // span took 28 ms against 38.7 ms in spans of 2,048 (H100).
  int prefill_rows = 0;
  int prefill_span = 16384;
  bool profile = false;             // PROFILE: time every op with events (graphs off), printed at the end
  static CudaSwitches FromEnvironment();
};

struct BackendOptions {
  std::string device = "cpu";  // cpu | cuda (the CUDA backend, in builds with ORYX_CUDA)
  int threads = 0;             // CPU worker threads; 0: one per hardware thread
  // The projection weights: fewer bytes read per token (kernels/ops.h WeightFormat). The CPU backend's "f32"
  // (as loaded), "bf16", "int8" (per-row scales) or "w8a8"; the CUDA backend's "bf16" (also "f32": as loaded,
  // in bf16) or "fp8" (e4m3, a scale per row).
  std::string weights = "f32";
  // The CPU backend's KV cache: "f32", or "bf16" (half the bytes an attention step reads from it). The CUDA
  // backend's is bf16 and accepts only "bf16"; "" takes the backend's own (f32 on the CPU).
  std::string kv_dtype = {};
  // A backend that can run whole speculative rounds (Backend::runs_rounds) does, when asked; off: the
  // decoder runs them forward by forward.
  bool device_rounds = true;
  CudaSwitches cuda = {};  // the CUDA backend's
};

// A loaded model that runs batched forwards. Immutable weights; Forward may be called from several threads
// on disjoint sequences (calls are serialised inside the backend).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual const ModelConfig& config() const = 0;
  virtual SequenceState NewSequence() const { return SequenceState(config()); }
  // NewSequence, or ResourceExhausted when the device has no room for one (NewSequence aborts then).
  virtual absl::StatusOr<SequenceState> TryNewSequence() const { return NewSequence(); }
  // Device memory free for sequences (and what the backend holds for reuse); 0 for a host backend, whose
  // sequences take host memory as they need it.
  virtual int64_t AvailableDeviceBytes() const { return 0; }
  // Sizes the backend's KV pool at start: memory for `bytes` of KV blocks allocated now, from which its
  // sequences take their blocks first (a server's --kv-memory). The pool may still grow past it while memory
  // allows. ResourceExhausted, naming the shortage, when that memory is not there.
  virtual absl::Status ReserveKv(int64_t bytes) {
    (void)bytes;
    return absl::OkStatus();
  }
  // Bytes of memory the backend's KV pool holds (blocks in use and free ones kept for reuse); 0 where unknown.
  virtual int64_t KvPoolBytes() const { return 0; }
  // CUDA graphs (or the like) recorded so far.
  virtual int64_t graphs_recorded() const { return 0; }
  // Forwards and rounds of a shape that a graph serves which did not replay it: the uses before its capture
  // (CudaSwitches::graph_after), launched one kernel at a time, and the capture itself. Their time is not what
  // the shape costs from then on, so a caller that times its forwards (the draft-length controller) leaves
  // out the ones during which this count moved.
  virtual int64_t graph_warmups() const { return 0; }
  // Cumulative measures of the backend's own work by name (times in seconds end in "_s"), for benchmarks to
  // take differences of. The CUDA backend's: graph_warmup_s (the wall time of the forwards and rounds during
  // which graph_warmups() moved, the replays they stood in for included), device_mallocs, device_malloc_s and
  // device_shortages (allocations its memory pool's cache could not serve), and whole rounds' count and wall
  // time by stage: round_prepare_s (checks, plans, metadata), round_launch_s (the launches, or the graph's
  // replay or capture), round_wait_s (the synchronisation), round_finish_s (the host's bookkeeping after); and
  // its forwards (Forward): forwards, forward_rows, forward_attention_rows, logit_rows_back (rows of logits
  // copied to the host) and host_draws (tokens drawn on the host, where a forward's samplers differ).
  virtual std::vector<std::pair<std::string, double>> Counters() const { return {}; }
  // Bytes of the KV cache of a sequence with room for `positions` (what Reserve(positions) holds), for
  // admission against a memory budget; 0 where unknown.
  virtual int64_t KvBytes(int64_t positions) const {
    (void)positions;
    return 0;
  }

  // Runs every item's span, advancing each sequence. Sequences in one batch must be distinct. Validates the
  // whole batch before touching any state: InvalidArgument for an empty span, mismatched lengths, an id
  // outside the vocabulary, a span past max_position, an attention token on a draft sequence, a missing
  // logits_out, a sampler without kLast or without next_token, stats_out without a sampler, or a sequence
  // given twice.
  virtual absl::Status Forward(std::span<const ForwardItem> batch) = 0;

  // Speculative rounds run whole by the backend (DESIGN.md §6), for backends where returning to the host
  // between a round's forwards costs. The capability: runs_rounds(). For every item, the draft sequence
  // refreshed from seq, k linear-mode draft steps from `pending` on it, each drawing from the last step's
  // distribution (greedy: its argmax); one attention-mode verify span [pending, d_1..d_k] on seq, its states
  // kept for rollback (ForwardItem::keep_states); the verdict in *result (RoundResult), and seq cut back to
  // after the accepted drafts by the backend (RoundResult::cut) or else left after the whole span for the
  // caller to cut. Every item's sampler must have the same parameters. Backends without the capability
  // return Unimplemented.
  virtual bool runs_rounds() const { return false; }
  virtual absl::Status SpeculativeRound(std::span<const RoundItem> items, int64_t k) {
    (void)items, (void)k;
    return absl::UnimplementedError("this backend does not run speculative rounds itself");
  }

  // Prompt tokens per forward span when the engine prefills `sequences` prompts together. The CPU backend's
  // attention holds a span x context score buffer, so spans of 256; a device backend may take longer ones.
  virtual int64_t PrefillSpan(int64_t sequences) const {
    (void)sequences;
    return 256;
  }

  // One sequence: logits of the last token ([V]) or of every token ([T, V]).
  absl::Status Forward(SequenceState& seq, std::span<const int32_t> tokens, std::span<const Mode> modes,
                       bool all_logits, std::vector<float>* logits) {
    ForwardItem item{&seq, tokens, modes, all_logits ? LogitsRows::kAll : LogitsRows::kLast, logits, false};
    return Forward(std::span<const ForwardItem>(&item, 1));
  }
};

// The checks every Backend::Forward makes before touching any state (the InvalidArgument list above), for
// backend implementations: sequences must come from the backend `device_owner` (null: host sequences).
absl::Status ValidateForwardBatch(const ModelConfig& config, std::span<const ForwardItem> batch,
                                  const void* device_owner);

// Loads a checkpoint directory (DESIGN.md §4) onto the device the options name.
absl::StatusOr<std::unique_ptr<Backend>> LoadBackend(const std::string& model_dir, const BackendOptions& options);
// "f32" | "bf16" | "int8" | "w8a8" (BackendOptions::weights); InvalidArgument naming the choices otherwise.
absl::StatusOr<kernels::WeightFormat> ParseWeightFormat(std::string_view name);
// "f32" | "bf16" (BackendOptions::kv_dtype); InvalidArgument naming the choices otherwise.
absl::StatusOr<kernels::KvFormat> ParseKvFormat(std::string_view name);

}  // namespace oryx
