// SequenceState (engine/backend.h): a sequence's KV cache, recurrent state and conv window on the host, or a
// handle to them on a device; copies, reservations and rollback. And the checks every Backend::Forward makes.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/backend.h"

namespace oryx {
SequenceState::SequenceState(const ModelConfig& c, std::shared_ptr<HostKvPool> kv_pool)
    : layers_(c.n_layers), heads_(c.n_heads), head_dim_(c.head_dim), conv_rows_(c.conv_width - 1) {
  for (Layer& l : layers_) {
    l.s.assign(c.n_heads * c.head_dim * c.head_dim, 0.f);
    l.conv.assign(conv_rows_ * 2 * c.qk_dim(), 0.f);
  }
  kv_ = HostKvTable(std::move(kv_pool));
}

// A pool of its own, shared with its clones, that grows as they need (its blocks' memory is allocated only
// when handed out).
SequenceState::SequenceState(const ModelConfig& c) : SequenceState(c, NewHostKvPool(c, 1)) {}

std::shared_ptr<HostKvPool> NewHostKvPool(const ModelConfig& c, int64_t sequences, int64_t block_tokens,
                                          kernels::KvFormat format) {
  const int64_t per_sequence = (c.max_position + block_tokens - 1) / block_tokens;
  return std::make_shared<HostKvPool>(sequences * per_sequence + 1, block_tokens, c.n_layers,
                                      c.n_heads * kernels::KvHeadRowElements(format, c.head_dim),
                                      /*max_capacity=*/0, format);
}

absl::Status SequenceState::PrepareKv(int64_t end) {
  const int64_t bt = kv_.pool()->block_tokens();
  // The blocks this forward writes into that others hold too (a clone, the prefix cache): copied first.
  for (int64_t j = position_ / bt; j < kv_.size() && j * bt < end; ++j) ORYX_RETURN_IF_ERROR(kv_.Own(j));
  return kv_.Grow((end + bt - 1) / bt);
}

SequenceState::SequenceState(const ModelConfig& c, std::unique_ptr<DeviceSequence> device)
    : layers_(c.n_layers),
      heads_(c.n_heads),
      head_dim_(c.head_dim),
      conv_rows_(c.conv_width - 1),
      device_(std::move(device)) {}

namespace {
SequenceState OrAbort(absl::StatusOr<SequenceState> s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "fatal: %s: %s\n", what, std::string(s.status().message()).c_str());
    std::abort();
  }
  return std::move(*s);
}
}  // namespace

SequenceState SequenceState::Clone() const { return OrAbort(TryClone(), "SequenceState::Clone"); }
SequenceState SequenceState::MakeDraft() const { return OrAbort(TryMakeDraft(), "SequenceState::MakeDraft"); }

absl::StatusOr<SequenceState> SequenceState::TryClone() const {
  SequenceState copy(*this, 0);
  if (device_) {
    copy.layers_.resize(layers_.size());
    ORYX_ASSIGN_OR_RETURN(copy.device_, device_->Clone(has_kv_, position_, /*capacity=*/-1));
    return copy;
  }
  copy.layers_ = layers_;
  // The blocks that hold positions, shared; the reserved ones stay this sequence's.
  const int64_t bt = kv_block_tokens();
  copy.kv_ = kv_.Share(has_kv_ ? (position_ + bt - 1) / bt : 0);
  return copy;
}

absl::StatusOr<SequenceState> SequenceState::TryCloneWithRoom(int64_t tokens) const {
  if (!device_) {
    ORYX_ASSIGN_OR_RETURN(SequenceState copy, TryClone());  // shares the blocks of its positions and no more
    ORYX_RETURN_IF_ERROR(copy.Reserve(tokens));
    return copy;
  }
  SequenceState copy(*this, 0);
  copy.layers_.resize(layers_.size());
  ORYX_ASSIGN_OR_RETURN(copy.device_, device_->Clone(has_kv_, position_, has_kv_ ? tokens : 0));
  return copy;
}

absl::StatusOr<SequenceState> SequenceState::TryCopy() const {
  ORYX_ASSIGN_OR_RETURN(SequenceState copy, TryClone());
  if (copy.device_) {
    ORYX_RETURN_IF_ERROR(copy.device_->UnshareKv());
    return copy;
  }
  for (int64_t j = 0; j < copy.kv_.size(); ++j) ORYX_RETURN_IF_ERROR(copy.kv_.Own(j));
  return copy;
}

SequenceState::SequenceState(const SequenceState& other, int)
    : modes_(other.has_kv_ ? other.modes_ : std::vector<Mode>()),
      position_(other.position_),
      has_kv_(other.has_kv_),
      span_start_(other.span_start_),
      span_len_(other.span_len_),
      heads_(other.heads_),
      head_dim_(other.head_dim_),
      conv_rows_(other.conv_rows_) {}

absl::StatusOr<SequenceState> SequenceState::TryMakeDraft() const {
  SequenceState draft(*this, 0);
  draft.has_kv_ = false;
  draft.modes_.clear();
  draft.span_start_ = -1;
  draft.span_len_ = 0;
  draft.layers_.resize(layers_.size());
  if (device_) {
    ORYX_ASSIGN_OR_RETURN(draft.device_, device_->Clone(false, position_, /*capacity=*/0));
    return draft;
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    draft.layers_[i].s = layers_[i].s;
    draft.layers_[i].conv = layers_[i].conv;
  }
  draft.kv_ = kv_.Share(0);
  return draft;
}

void SequenceState::CopyRecurrentFrom(const SequenceState& other) {
  if (device_) {
    device_->CopyRecurrentFrom(*other.device_);  // both made by the same backend
  } else {
    for (size_t i = 0; i < layers_.size(); ++i) {
      std::copy(other.layers_[i].s.begin(), other.layers_[i].s.end(), layers_[i].s.begin());
      std::copy(other.layers_[i].conv.begin(), other.layers_[i].conv.end(), layers_[i].conv.begin());
    }
  }
  RecordRecurrentCopy(other);
}

void SequenceState::RecordRecurrentCopy(const SequenceState& other) {
  position_ = other.position_;
  span_start_ = -1;
  span_len_ = 0;
}

absl::Status SequenceState::Reserve(int64_t tokens) {
  if (!has_kv_) return absl::OkStatus();
  modes_.reserve(static_cast<size_t>(tokens));  // the mode log, so that decoding allocates nothing either
  if (device_) return device_->Reserve(tokens, position_);
  const int64_t bt = kv_.pool()->block_tokens();
  absl::Status grown = kv_.Grow((tokens + bt - 1) / bt);
  if (!grown.ok()) return absl::ResourceExhaustedError(Cat("a KV cache of ", tokens, " positions: ", grown.message()));
  return absl::OkStatus();
}

int64_t SequenceState::kv_bytes() const {
  if (device_) return device_->kv_bytes();
  return kv_.pool() ? kv_.size() * kv_.pool()->block_bytes() : 0;
}

int64_t SequenceState::kv_capacity() const {
  if (!has_kv_) return 0;
  if (device_) return device_->kv_capacity();
  return kv_.size() * kv_.pool()->block_tokens();
}

void SequenceState::Advance(std::span<const Mode> modes, bool keep_states) {
  const int64_t T = static_cast<int64_t>(modes.size());
  span_start_ = keep_states ? position_ : -1;
  span_len_ = keep_states ? T : 0;
  position_ += T;
  if (has_kv_) modes_.insert(modes_.end(), modes.begin(), modes.end());
}

int64_t SequenceState::recurrent_bytes() const {
  const int64_t hd = heads_ * head_dim_;
  return static_cast<int64_t>(layers_.size()) * (hd * head_dim_ + conv_rows_ * 2 * hd) *
         static_cast<int64_t>(sizeof(float));
}

int64_t SequenceState::kv_shared_blocks() const { return device_ ? device_->kv_shared_blocks() : kv_.shared(); }

std::span<const int32_t> SequenceState::kv_block_ids() const { return device_ ? device_->kv_block_ids() : kv_.ids(); }

const void* SequenceState::kv_pool() const { return device_ ? device_->kv_pool() : kv_.pool(); }

int64_t SequenceState::kv_block_bytes() const {
  const int64_t blocks = static_cast<int64_t>(kv_block_ids().size());
  if (device_) return blocks > 0 ? device_->kv_bytes() / blocks : 0;
  return kv_.pool() ? kv_.pool()->block_bytes() : 0;
}

int64_t SequenceState::kv_block_tokens() const {
  if (device_) return device_->kv_block_tokens();
  return kv_.pool() ? kv_.pool()->block_tokens() : 1;
}

absl::Status SequenceState::Truncate(int64_t position) { return Cut(position, /*restore=*/true); }

absl::Status SequenceState::Cut(int64_t position, bool restore) {
  if (position > position_ || position < 0) {
    return absl::InvalidArgumentError(Cat("truncate: position ", position, " outside [0, ", position_, "]"));
  }
  if (position == position_) return absl::OkStatus();
  if (span_start_ >= 0 && position >= span_start_ && has_kv_) modes_.resize(position);
  if (span_start_ < 0 || position < span_start_) {
    return absl::FailedPreconditionError(
        Cat("truncate: the recurrent state at position ", position, " was not kept (",
            span_start_ < 0 ? std::string("no span was forwarded with keep_states")
                            : Cat("the kept span starts at ", span_start_),
            "); take a Clone() snapshot instead"));
  }
  const int64_t j = position - span_start_, dd = head_dim_ * head_dim_, hd = heads_ * head_dim_;
  if (device_ || !restore) {
    if (restore) device_->RestoreSpan(j);  // the device KV cache is cut by the position alone
    position_ = position;
    return absl::OkStatus();
  }
  for (Layer& l : layers_) {
    for (int64_t h = 0; h < heads_; ++h) {
      const float* src = l.span_states.data() + (h * (span_len_ + 1) + j) * dd;
      std::copy(src, src + dd, l.s.data() + h * dd);
    }
    // The window before token j of the span: rows j .. j + w - 2 of (window before the span, span inputs).
    const float* rows = l.span_inputs.data() + j * 2 * hd;
    std::copy(rows, rows + conv_rows_ * 2 * hd, l.conv.data());
  }
  // The span's history stays valid up to the new position; the per-head layout keeps its stride. The KV
  // blocks stay: rows past the position are rewritten before they are read.
  position_ = position;
  return absl::OkStatus();
}

absl::Status ValidateForwardBatch(const ModelConfig& c, std::span<const ForwardItem> batch, const void* device_owner) {
  if (batch.empty()) return absl::InvalidArgumentError("forward: empty batch");
  for (size_t b = 0; b < batch.size(); ++b) {
    const ForwardItem& it = batch[b];
    // Built only on error: a forward that passes allocates nothing here.
    auto where = [&] { return batch.size() > 1 ? Cat("forward: item ", b, ": ") : std::string("forward: "); };
    if (it.seq == nullptr) return absl::InvalidArgumentError(where() + "no sequence");
    for (size_t other = 0; other < b; ++other) {
      if (batch[other].seq == it.seq) return absl::InvalidArgumentError(where() + "sequence given twice in one batch");
    }
    if (it.seq->layers_.size() != static_cast<size_t>(c.n_layers) || it.seq->heads_ != c.n_heads ||
        it.seq->head_dim_ != c.head_dim) {
      return absl::InvalidArgumentError(where() + "sequence state made for a different model");
    }
    if ((it.seq->device_ ? it.seq->device_->owner() : nullptr) != device_owner) {
      return absl::InvalidArgumentError(where() + "sequence state made by a different backend");
    }
    const int64_t T = static_cast<int64_t>(it.tokens.size());
    if (T == 0) return absl::InvalidArgumentError(where() + "empty span of tokens");
    if (it.modes.size() != it.tokens.size()) {
      return absl::InvalidArgumentError(Cat(where(), T, " tokens but ", it.modes.size(), " modes"));
    }
    if (it.seq->position_ + T > c.max_position) {
      return absl::InvalidArgumentError(Cat(where(), "positions ", it.seq->position_, "..", it.seq->position_ + T - 1,
                                            " exceed the model's max_position ", c.max_position));
    }
    for (int32_t t : it.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(Cat(where(), "token id ", t, " outside the vocabulary [0, ", c.vocab_size, ")"));
      }
    }
    if (!it.seq->has_kv_) {
      for (Mode m : it.modes) {
        if (m != Mode::kLinear) return absl::InvalidArgumentError(where() + "an attention-mode token on a draft sequence");
      }
    }
    if (it.sampler != nullptr && (it.logits != LogitsRows::kLast || it.next_token == nullptr)) {
      return absl::InvalidArgumentError(where() + "a sampler needs the last row's logits and a next_token to write");
    }
    if (it.stats_out != nullptr && it.sampler == nullptr) {
      return absl::InvalidArgumentError(where() + "logit statistics asked for without a sampler");
    }
    if (it.logits != LogitsRows::kNone && it.logits_out == nullptr && it.sampler == nullptr) {
      return absl::InvalidArgumentError(where() + "logits asked for but no output buffer given");
    }
  }
  return absl::OkStatus();
}

}  // namespace oryx
