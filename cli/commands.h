// The `oryx` subcommands. Each takes the arguments after its own name and returns the exit code.
#pragma once

#include <string>
#include <vector>

namespace oryx::cli {

using Args = std::vector<std::string>;

int RunTokenizer(const Args& args);  // oryx tokenizer train ...
int RunData(const Args& args);       // oryx data prepare|pack|unpack ...
#ifdef ORYX_HAVE_TORCH
int RunTrain(const Args& args);      // oryx train ... (needs LibTorch)
int RunEval(const Args& args);       // oryx eval ppl|niah|mqar|agreement ... (LibTorch reference)
#endif

}  // namespace oryx::cli
