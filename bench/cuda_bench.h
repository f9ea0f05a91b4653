// `oryx bench decode --device cuda`: the CUDA backend's decode steps and prefill against the bandwidth
// roofline of the device (bytes a step must move over the copy bandwidth the stream probe measures on it).
#pragma once

#include "bench/engine_bench.h"

namespace oryx::bench {

// Bytes a decode step must move at least (the roofline's numerator): every weight it uses read once (not
// the unused query projection of the mode, only the batch's embedding rows), the KV cache read (attention)
// and the new entries written (bf16), the recurrent state and conv window read and written (fp32), the
// logits written (fp32). The same count as bench/torch_reference.py's step_bytes, but for the fp32 logits
// and small fp32 vectors. fp8_weights: the matrices in FP8 and their fp32 row scales.
double StepBytes(const ModelConfig& config, Mode mode, int64_t context, int64_t batch, bool fp8_weights = false);

// Decode step time by mode, context and batch (contexts filled by linear-mode prefill: every token writes
// the KV cache whatever its mode), and prefill throughput by mode; JSON lines as RunDecodeBench's.
//
// With options.spec_ks, also speculative rounds at each point (bench "speculative"), run by
// speculative::SpeculativeDecoder with its LinearProposer exactly as `--policy speculative:K` runs them: k
// linear-mode draft steps on a draft copy of the state, one attention-mode verify forward over the k+1
// tokens keeping the states, and Truncate to the accepted prefix. Random weights make real acceptance
// meaningless, so there the accept step is simulated: each draft is accepted with probability
// options.acceptance, independently, until the first rejection (seeded); tokens per round and the speed-up
// over the attention-mode step of the same point then use the expected 1 + a + ... + a^k tokens. With
// options.data_dir (and a trained model) the contexts are validation windows of that corpus, the accept
// step is the real greedy one (speculative::AcceptLossless) and the acceptance is measured.
absl::Status RunCudaDecodeBench(const DecodeBenchOptions& options, const Emit& emit);

}  // namespace oryx::bench
