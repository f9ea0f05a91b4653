// The `oryx` command (and `oryx-torch`, the same commands with LibTorch linked in): dispatches to a
// subcommand. Lists only subcommands that work. No exception leaves main: one reaching here is a bug, reported
// as one error line and exit code 1 rather than an abort.
#include <exception>
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
    {"eval", "ppl | niah | niah-multikey | passkey | mqar | copy | agreement: perplexity by mode, retrieval by policy",
     oryx::cli::RunEval},
    {"bench", "decode | spec | cost | router | serve: speed against the roofline, speculation, cost model, routing,\n"
              "                the server under load",
     oryx::cli::RunBench},
#ifdef ORYX_HAVE_SERVER
    {"serve", "serve a model over HTTP (OpenAI-style completions, streaming, continuous batching)",
     oryx::cli::RunServe},
#endif
    {"tokenizer", "train | encode | decode: a SentencePiece BPE tokenizer", oryx::cli::RunTokenizer},
    {"data", "prepare | pack | unpack | verify | text: the training corpus from Debian packages", oryx::cli::RunData},
#ifdef ORYX_HAVE_TORCH
    {"train", "train an Oryx model with fragmented mixed-mode training", oryx::cli::RunTrain},
    {"train-router", "train a learned routing policy (counterfactual warm start, then REINFORCE)",
     oryx::cli::RunTrainRouter},
#elif defined(ORYX_HAVE_TORCH_BINARY)
    {"train", "train an Oryx model with fragmented mixed-mode training (runs oryx-torch)",
     [](const oryx::cli::Args& args) { return oryx::cli::ExecTorchBinary("train", args); }},
    {"train-router", "train a learned routing policy (counterfactual warm start, then REINFORCE; runs oryx-torch)",
     [](const oryx::cli::Args& args) { return oryx::cli::ExecTorchBinary("train-router", args); }},
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
  std::cout << "\nRun 'oryx <command> --help' for a command's flags, 'oryx --version' for the build.\n";
}

// `oryx --version`: the version, and what this build holds.
void PrintVersion() {
  std::cout << "oryx " << ORYX_VERSION << "\n";
#ifdef ORYX_HAVE_CUDA
  std::cout << "  CUDA backend     built (--device cuda)\n";
#else
  std::cout << "  CUDA backend     not built (ORYX_CUDA=OFF)\n";
#endif
#ifdef ORYX_HAVE_SERVER
  std::cout << "  HTTP server      built (oryx serve, oryx bench serve)\n";
#else
  std::cout << "  HTTP server      not built (ORYX_SERVER=OFF)\n";
#endif
#if defined(ORYX_HAVE_TORCH)
  std::cout << "  LibTorch         linked (oryx-torch: train, train-router, eval --backend libtorch)\n";
#elif defined(ORYX_HAVE_TORCH_BINARY)
  std::cout << "  LibTorch         in oryx-torch beside this binary (train, train-router, eval --backend libtorch)\n";
#else
  std::cout << "  LibTorch         not built (ORYX_TORCH=OFF)\n";
#endif
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    PrintHelp();
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version" || args[0] == "version") {
    PrintVersion();
    return 0;
  }
  for (const Command& c : kCommands) {
    if (args[0] != c.name) continue;
    try {
      return c.run(oryx::cli::Args(args.begin() + 1, args.end()));
    } catch (const std::exception& e) {
      std::cerr << "oryx: error: internal error in '" << c.name << "': " << e.what() << "\n";
    } catch (...) {
      std::cerr << "oryx: error: internal error in '" << c.name << "': unknown exception\n";
    }
    return 1;
  }
  std::cerr << "oryx: error: unknown command '" << args[0] << "' (run 'oryx --help' for the list)\n";
  return 2;
}
