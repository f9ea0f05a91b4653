// The router's cost model (DESIGN.md §7): what a forward span costs, from the work it does, calibrated
// against the backend's measured step times so that a router (and the speculative draft-length choice)
// can compare modes, draft lengths and batch sizes before running them.
//
// A span's work, summed over its sequences: tokens through the dense layers (projections, MLP; the LM head
// for the rows whose logits are computed), the KV-cache bytes that attention tokens read, the attention
// score work (queries x keys), the recurrence work of every token, and the number of sequences
// (per-sequence work: conv, cache appends, dispatch).
// The dense work is split by the regime the CPU backend's product runs in, which depends on the rows of
// the whole batch (m = batch x tokens): one row is a bandwidth-bound GEMV, 2..6 rows the small-product
// path, which reads each weight once whatever its rows (a cost per forward, not per FLOP: a rate per FLOP
// fitted at 4 rows put 2 rows at half their time on the H200), more rows a GEMM. Spans of
// up to kLongSpanTokens tokens a sequence (decode steps, verify and draft spans) also pay per row (the
// CUDA backend's products of a few rows loop over them) and, with more than one token a sequence, a cost of
// their own (their kernels and the scan's steps: 8 tokens of one sequence took 1.5 times 8 sequences of one
// on the H200). Longer spans (prefill segments) get their own fixed cost and KV rate: on the CUDA backend
// they run the tiled prefill attention, whose blocks walk the keys in turn (its time grows with the context
// nearly regardless of the queries), outside CUDA graphs, where shorter spans replay graphs and read the KV
// in parallel splits. The predicted time is a non-negative combination:
//   t = c_fixed + c_gemv * dense[m = 1] + c_small[2 <= m <= 6] + [m >= 7] (c_pack + c_gemm * dense)
//       + c_seq * sequences + c_kv * kv_bytes[short] + c_attn * attention_flops + c_rec * recurrent_flops
//       + [long] (c_long + c_kv_long * kv_bytes) + [short] (c_row * m + c_multi [tokens > 1])
// (c_pack: the GEMM packs each weight matrix once per forward).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "nlohmann/json.hpp"

namespace oryx::router {

// One forward: `batch` sequences, each running `tokens` new tokens in `mode` after `context` earlier ones,
// with the logits of every token (a verify span) or of the last one only (a prefill segment, a decode step).
// Tokens a sequence above which a span counts as long (above): the CUDA backend graphs spans of up to 64.
inline constexpr int64_t kLongSpanTokens = 64;

struct SpanShape {
  int64_t batch = 1;
  int64_t tokens = 1;
  int64_t context = 0;
  Mode mode = Mode::kAttention;
  bool all_logits = false;
};

// The work terms of a span (FLOPs, and bytes for the KV read), from the model config.
struct SpanWork {
  double dense_flops = 0;      // 2 * (dense parameters) per token, and the LM head's per row of logits
  double kv_bytes = 0;         // KV cache read by attention tokens (fp32)
  double attention_flops = 0;  // q.k and p.v over the visible keys
  double recurrent_flops = 0;  // the state update and read, every token
};
SpanWork WorkOf(const ModelConfig& config, const SpanShape& shape);

// The bytes a forward of the span must move at least where decoding is bound by memory bandwidth (a GPU):
// every weight matrix it uses once whatever its rows (bf16), the KV cache its attention tokens read and the
// entries every token writes (bf16), each sequence's recurrent state read and written (fp32). A verify span
// of a few tokens then costs about one decode step, as on the H200 (docs/CUDA.md). Relative costs only:
// over a bandwidth it is a time.
double SpanBytes(const ModelConfig& config, const SpanShape& shape);

// The calibration grid of `oryx bench cost` and `train-router --cost time`: batch 1, 4, 16 with spans of 1
// and 8 tokens (every token's logits, as verify spans), and batch 1 with spans of 64, 256, 512 and 1,024
// (prefill segments: the last token's logits); contexts 128, a quarter and three quarters of max_position;
// both modes.
std::vector<SpanShape> CalibrationShapes(const ModelConfig& config);

struct Measurement {
  SpanShape shape;
  double seconds = 0;
};

class CostModel {
 public:
  // Least squares on relative error with non-negative coefficients. InvalidArgument for fewer than 5
  // measurements or a non-positive time.
  static absl::StatusOr<CostModel> Fit(const ModelConfig& config, std::span<const Measurement> measurements);
  double PredictSeconds(const SpanShape& shape) const;
  nlohmann::json ToJson() const;

 private:
  ModelConfig config_;
  std::vector<double> coef_;  // seconds per unit of each term, in the order of the formula above
};

// Times forwards of the given shapes on `backend` (median of `repeats` after a warm-up, leaving out runs
// during which the backend recorded a CUDA graph), on synthetic sequences prefilled to each context.
// Contexts + tokens must fit the model's max_position.
absl::StatusOr<std::vector<Measurement>> MeasureSpans(Backend& backend, std::span<const SpanShape> shapes,
                                                      int repeats);

}  // namespace oryx::router
