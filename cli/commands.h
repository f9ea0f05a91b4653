// The `oryx` subcommands. Each takes the arguments after its own name and returns the exit code.
#pragma once

#include <string>
#include <vector>

namespace oryx::cli {

using Args = std::vector<std::string>;

int RunTokenizer(const Args& args);  // oryx tokenizer train ...
int RunData(const Args& args);       // oryx data prepare|pack|unpack ...
int RunGenerate(const Args& args);   // oryx generate ...
int RunEval(const Args& args);       // oryx eval ppl|niah|mqar (engine or LibTorch) | agreement (LibTorch)
int RunBench(const Args& args);      // oryx bench decode|spec ...
#ifdef ORYX_HAVE_SERVER
int RunServe(const Args& args);      // oryx serve ...
#endif
#ifdef ORYX_HAVE_TORCH
int RunTrain(const Args& args);      // oryx train ... (needs LibTorch)
int RunTrainRouter(const Args& args);  // oryx train-router ... (needs LibTorch)
#endif

// The commands that need LibTorch (train, train-router, eval on the LibTorch reference, bench decode's
// LibTorch comparison) live in a second binary, oryx-torch, beside oryx: oryx itself loads no LibTorch, so
// that it starts in milliseconds and generates in a small fraction of LibTorch's memory. This replaces the
// process with `oryx-torch COMMAND ARGS...` and returns only on failure (with an error printed).
int ExecTorchBinary(const std::string& command, const Args& args);

// Whether args hold `--NAME VALUE` or `--NAME=VALUE`.
bool HasFlagValue(const Args& args, const std::string& name, const std::string& value);

// The help of the backend flags (EngineFlags in cli/engine_flags.h for generate and serve; eval and bench too).
inline constexpr const char* kWeightsHelp =
    "projection weights, fewer bytes per token: cpu f32 | bf16 | int8 (per-row scales) | w8a8 (int8 activations "
    "too); cuda bf16 (f32 loads as bf16) | fp8 (e4m3, a power-of-two scale per row; on an H200 faster than bf16 up "
    "to 8 sequences a step, even at 16, slower from 32)";
inline constexpr const char* kKvDtypeHelp =
    "cpu: the KV cache's element type f32 | bf16 (half the bytes an attention step reads from the cache) | int8 (a "
    "scale per head and position: about a quarter); cuda: bf16 only (default: f32 on the CPU)";

}  // namespace oryx::cli
