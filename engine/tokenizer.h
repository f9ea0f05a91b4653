// The Oryx tokenizer: a SentencePiece BPE model with a fixed special-token layout and an exact,
// byte-level round trip (Decode(Encode(s)) == s for every byte string), plus deterministic training.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace sentencepiece {
class SentencePieceProcessor;
}  // namespace sentencepiece

namespace oryx {

// Special-token convention, identical in every Oryx tokenizer (Load() rejects models that differ):
//
//   id 0  <pad>   padding; decodes to ""
//   id 1  <unk>   never produced by Encode() (byte fallback covers everything); decodes to "\u2047"
//   id 2  <s>     BOS; the engine prepends it to every prompt, Encode() never adds it; decodes to ""
//   id 3  </s>    EOS; generation stops at it, Encode() never adds it; decodes to ""
//   ids 4..17     task tokens, in kTaskTokenNames order. They are SentencePiece *control* symbols:
//                 text never encodes to them (a document that contains the string "<|key|>" gets the
//                 characters, not the token), so only code that inserts them by id (MQAR,
//                 needle-in-a-haystack) produces them. They decode to their names.
//   id 18   "\n"  newline and
//   id 19   "\t"  tab: user-defined symbols, so each is always exactly one token. (SentencePiece's trainer
//                 never puts a tab into a piece and reads its input line by line, so without these
//                 both would fall back to byte pieces.)
//   ids 20..275   byte pieces <0x00>..<0xFF> (byte fallback), then the learned BPE pieces.
inline constexpr int32_t kPadId = 0;
inline constexpr int32_t kUnkId = 1;
inline constexpr int32_t kBosId = 2;
inline constexpr int32_t kEosId = 3;
inline constexpr int32_t kFirstTaskTokenId = 4;
inline constexpr std::array<std::string_view, 14> kTaskTokenNames = {
    "<|sep|>", "<|query|>", "<|answer|>", "<|needle|>", "<|key|>", "<|value|>", "<|t0|>",
    "<|t1|>",  "<|t2|>",    "<|t3|>",     "<|t4|>",     "<|t5|>",  "<|t6|>",    "<|t7|>"};
inline constexpr int32_t kNewlineId = kFirstTaskTokenId + static_cast<int32_t>(kTaskTokenNames.size());
inline constexpr int32_t kTabId = kNewlineId + 1;
inline constexpr int32_t kFirstByteId = kTabId + 1;
// The smallest vocabulary that holds the fixed pieces above plus one learned piece.
inline constexpr int32_t kMinVocabSize = kFirstByteId + 256 + 1;

// A loaded tokenizer. Immutable after Load(); all const methods are safe to call from several threads.
// Move-only (it owns the SentencePiece processor).
class Tokenizer {
 public:
  // Loads a SentencePiece model file and checks that it follows the convention above and round-trips
  // exactly (identity normalisation, no dummy prefix, no whitespace removal, byte fallback). Errors name
  // the file and the problem.
  static absl::StatusOr<Tokenizer> Load(const std::string& path);
  // Same, from the model file's bytes; `name` is used in error messages.
  static absl::StatusOr<Tokenizer> FromBytes(std::string_view model_bytes, std::string_view name);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Tokenises arbitrary bytes (valid UTF-8 or not). Adds no BOS/EOS. Never fails: bytes that are not
  // valid UTF-8 (and the character U+2581, which SentencePiece uses for space) become byte pieces.
  std::vector<int32_t> Encode(std::string_view text) const;
  // Appends the tokens of `text` to `out` (the allocation-friendly form for bulk tokenisation).
  void EncodeAppend(std::string_view text, std::vector<int32_t>* out) const;

  // Concatenates the text of each id: byte pieces give their raw byte, "▁" gives a space, task tokens
  // give their names, pad/bos/eos give "", unk and ids outside [0, vocab_size) give "\u2047".
  std::string Decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const { return static_cast<int32_t>(piece_text_.size()); }
  int32_t pad_id() const { return kPadId; }
  int32_t unk_id() const { return kUnkId; }
  int32_t bos_id() const { return kBosId; }
  int32_t eos_id() const { return kEosId; }
  int32_t newline_id() const { return kNewlineId; }
  int32_t tab_id() const { return kTabId; }
  // The id of a task token by name, e.g. "<|sep|>"; NotFound for other names.
  absl::StatusOr<int32_t> TaskTokenId(std::string_view name) const;
  // The SentencePiece piece of `id` (e.g. "▁the", "<0x0A>", "<s>"); "" when out of range.
  std::string_view IdToPiece(int32_t id) const;
  // True for pad, unk, bos, eos and the task tokens.
  bool IsSpecial(int32_t id) const { return id >= 0 && id < kNewlineId; }

 private:
  Tokenizer();
  absl::Status Init(std::string_view name);
  void EncodeValidUtf8(std::string_view text, std::vector<int32_t>* out) const;

  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::vector<std::string> pieces_;      // [vocab] SentencePiece piece of each id
  std::vector<std::string> piece_text_;  // [vocab] decoded bytes of each id
  std::array<int32_t, 256> byte_ids_{};  // byte value -> id of its <0xNN> piece
};

// Options for training an Oryx tokenizer (SentencePiece BPE, byte fallback, the special tokens above).
struct TokenizerTrainOptions {
  std::vector<std::string> input_files;  // plain text; every non-empty line is one training sentence
  int32_t vocab_size = 8192;             // including the 276 fixed pieces; in [kMinVocabSize, 65536]
  int64_t max_sentences = 1'000'000;     // a deterministic, evenly spaced sample of lines beyond this
  int32_t max_sentence_bytes = 8192;     // longer lines are skipped
  std::string out_path;                  // the .model file, written atomically
};

// Trains on the given files. Deterministic: the same files and options give a byte-identical model.
absl::Status TrainTokenizer(const TokenizerTrainOptions& options);

// Trains on sentences already in memory (each one line of text, without '\n') and returns the model
// file's bytes. `sentences` is used as given: no sampling, no shuffling.
absl::StatusOr<std::string> TrainTokenizerFromSentences(const std::vector<std::string>& sentences,
                                                        int32_t vocab_size);

}  // namespace oryx
