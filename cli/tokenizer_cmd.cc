// `oryx tokenizer train|encode|decode`: train the SentencePiece BPE tokenizer with the Oryx special tokens,
// and inspect what it does to a piece of text.
#include <chrono>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "base/flags.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "engine/tokenizer.h"

namespace oryx::cli {
namespace {

constexpr char kUsage[] =
    "usage: oryx tokenizer <train|encode|decode> [flags]\n\n"
    "  train   train a SentencePiece BPE tokenizer (byte fallback, exact round trip, Oryx special tokens)\n"
    "  encode  print the token ids (and pieces with --pieces) of a text\n"
    "  decode  print the text of space-separated token ids\n\n"
    "Run 'oryx tokenizer <subcommand> --help' for its flags.\n";

int Train(const Args& args) {
  TokenizerTrainOptions o;
  int64_t vocab = o.vocab_size;
  int64_t max_sentences = o.max_sentences;
  FlagSet flags(
      "oryx tokenizer train --input FILES... --vocab N --out FILE [--max-sentences N]",
      "Trains a SentencePiece BPE tokenizer on plain-text files (every non-empty line is a training\n"
      "sentence; beyond --max-sentences an evenly spaced sample is used). Deterministic: the same\n"
      "files and flags give a byte-identical model.");
  flags.StringList("input", &o.input_files, "plain-text training files", /*required=*/true);
  flags.Int("vocab", &vocab, "vocabulary size, including the 276 fixed special and byte pieces",
            kMinVocabSize, 65536);
  flags.String("out", &o.out_path, "output model file (written atomically)", /*required=*/true);
  flags.Int("max-sentences", &max_sentences, "cap on training lines (memory and time)", 1);
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    o.vocab_size = static_cast<int32_t>(vocab);
    o.max_sentences = max_sentences;
    const auto start = std::chrono::steady_clock::now();
    std::cerr << "oryx tokenizer: training BPE, vocab " << o.vocab_size << ", on " << o.input_files.size()
              << " file(s)\n";
    ORYX_RETURN_IF_ERROR(TrainTokenizer(o));
    ORYX_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(o.out_path));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cerr << "oryx tokenizer: wrote " << o.out_path << " (vocab " << tok.vocab_size() << ") in "
              << absl::StrCat(static_cast<int64_t>(secs * 10) / 10.0) << " s\n";
    return absl::OkStatus();
  });
}

// Reads the text from --text or --text-file.
absl::StatusOr<std::string> InputText(const std::string& text, const std::string& file) {
  if (!file.empty()) return ReadFile(file);
  return text;
}

int Encode(const Args& args) {
  std::string model, text, text_file;
  bool pieces = false;
  FlagSet flags("oryx tokenizer encode --model FILE (--text T | --text-file F) [--pieces]",
                "Prints the token ids of the text, space-separated (no BOS/EOS).");
  flags.String("model", &model, "tokenizer model file", /*required=*/true);
  flags.String("text", &text, "text to encode");
  flags.String("text-file", &text_file, "file whose bytes to encode");
  flags.Bool("pieces", &pieces, "print one 'id<TAB>piece' line per token instead");
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(model));
    ORYX_ASSIGN_OR_RETURN(std::string input, InputText(text, text_file));
    std::vector<int32_t> ids = tok.Encode(input);
    if (pieces) {
      for (int32_t id : ids) std::cout << id << "\t" << tok.IdToPiece(id) << "\n";
    } else {
      std::cout << absl::StrJoin(ids, " ") << "\n";
    }
    return absl::OkStatus();
  });
}

int Decode(const Args& args) {
  std::string model, ids_text;
  FlagSet flags("oryx tokenizer decode --model FILE --ids \"ID ID ...\"",
                "Prints the text of the token ids (exact bytes, no trailing newline added).");
  flags.String("model", &model, "tokenizer model file", /*required=*/true);
  flags.String("ids", &ids_text, "space-separated token ids", /*required=*/true);
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(model));
    std::vector<int32_t> ids;
    for (absl::string_view part : absl::StrSplit(ids_text, ' ', absl::SkipWhitespace())) {
      int32_t id;
      if (!absl::SimpleAtoi(part, &id)) {
        return absl::InvalidArgumentError(absl::StrCat("--ids: '", part, "' is not an integer"));
      }
      ids.push_back(id);
    }
    std::cout << tok.Decode(ids);
    return absl::OkStatus();
  });
}

}  // namespace

int RunTokenizer(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const Args rest(args.begin() + 1, args.end());
  if (args[0] == "train") return Train(rest);
  if (args[0] == "encode") return Encode(rest);
  if (args[0] == "decode") return Decode(rest);
  std::cerr << "oryx: error: unknown tokenizer subcommand '" << args[0] << "' (train, encode, decode)\n";
  return 2;
}

}  // namespace oryx::cli
