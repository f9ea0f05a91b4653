// The `oryx` command: dispatches to a subcommand. Lists only subcommands that work.
#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const oryx::cli::Args& args);
};

constexpr Command kCommands[] = {
    {"generate", "generate text with a mode policy, speculation included", oryx::cli::RunGenerate},
    {"eval", "perplexity by mode, task accuracy by policy (engine or LibTorch), speculation agreement",
     oryx::cli::RunEval},
    {"bench", "decode / prefill throughput against the roofline; speculative decoding speed", oryx::cli::RunBench},
#ifdef ORYX_HAVE_SERVER
    {"serve", "serve a model over HTTP (OpenAI-style completions, streaming, continuous batching)",
     oryx::cli::RunServe},
#endif
    {"tokenizer", "train a SentencePiece BPE tokenizer (oryx tokenizer train ...)", oryx::cli::RunTokenizer},
    {"data", "build the training corpus from Debian packages (oryx data prepare ...)", oryx::cli::RunData},
#ifdef ORYX_HAVE_TORCH
    {"train", "train an Oryx model with fragmented mixed-mode training", oryx::cli::RunTrain},
    {"train-router", "train a learned routing policy (counterfactual warm start, then REINFORCE)",
     oryx::cli::RunTrainRouter},
#endif
};

void PrintHelp() {
  std::cout << "usage: oryx <command> [flags]\n\n"
               "Oryx Engine: multi-mixer language models (attention and linear-recurrent modes over one\n"
               "shared state), trained, run and measured.\n\ncommands:\n";
  for (const Command& c : kCommands) {
    std::string name = c.name;
    name.resize(14, ' ');
    std::cout << "  " << name << c.summary << "\n";
  }
  std::cout << "\nRun 'oryx <command> --help' for a command's flags.\n";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    PrintHelp();
    return args.empty() ? 2 : 0;
  }
  for (const Command& c : kCommands) {
    if (args[0] == c.name) return c.run(oryx::cli::Args(args.begin() + 1, args.end()));
  }
  std::cerr << "oryx: error: unknown command '" << args[0] << "' (run 'oryx --help' for the list)\n";
  return 2;
}
