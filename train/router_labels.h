// The router trainer's decode labels (train/train_router.h): how much each decode decision of the best
// answer matters, from the same answer decoded by other policies.
#pragma once

#include <cstdint>
#include <map>
#include <span>

#include "engine/backend.h"

namespace oryx::policies {

// One decoding of an example's answer: its mode at each decode position (a speculative round decides for
// its first position only) and its reward at the lambda.
struct AnswerDecoding {
  std::map<int64_t, Mode> modes;
  double reward = 0;
};

// The weight of each of the best decoding's decisions (decodings[best]: the highest reward), labelled with
// its own mode: the regret of the closest decoding that chose the other mode at that position, its reward
// below the best's shared among the positions where the two differ. An answer token that only attention
// gets right so carries the loss of the decoding that ran it in linear mode, even where another decoding
// attends there too and nearly ties with the best. Positions where no other decoding chose otherwise are
// left out: nothing here says what they are worth.
std::map<int64_t, double> DecodeLabelWeights(std::span<const AnswerDecoding> decodings, size_t best);

}  // namespace oryx::policies
