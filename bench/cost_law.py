"""The time cost law of router/cost_model.cc, replicated in Python for offline study of `oryx bench cost --json`
files: a span's work terms from the model config (WorkOf) and the fit (non-negative least squares on relative
error over every subset of terms, CostModel::Fit). The feature lists are the caller's: the result scripts
try variants of the law. Needs torch.
"""
import torch

torch.set_default_dtype(torch.float64)


def work_of(cfg):
    """work(batch, tokens, context, attention, all_logits) -> (dense FLOPs, KV bytes, attention FLOPs,
    recurrent FLOPs) of a span, for a model config (config.json as a dict)."""
    D, H, dh, F, L, V = (cfg[k] for k in ("d_model", "n_heads", "head_dim", "mlp_hidden", "n_layers", "vocab_size"))
    HD, gates = H * dh, H

    def work(b, t, ctx, att, all_logits):
        tokens, keys = b * t, ctx + 0.5 * (t + 1)
        layer_params = (4 * HD + gates + (HD if att else 0)) * D + HD * D + 3 * F * D
        rows = b * (t if all_logits else 1)
        dense = 2 * (tokens * L * layer_params + rows * V * D)
        kv = b * L * (ctx + t) * 2 * HD * 4 if att else 0.0
        attention = tokens * L * keys * 4 * HD if att else 0.0
        recurrent = tokens * L * H * dh * dh * 6
        return dense, kv, attention, recurrent

    return work


def fit(rows, seconds):
    """Coefficients (a tensor) of the feature rows that best predict the times, relative error, non-negative."""
    X = torch.tensor(rows) / torch.tensor(seconds)[:, None]
    y = torch.ones(len(seconds))
    scale = X.abs().max(0).values
    scale[scale == 0] = 1
    X = X / scale
    best, k = (float("inf"), None), X.shape[1]
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        A = X[:, cols]
        sol = torch.linalg.lstsq(A, y[:, None], driver="gelsd").solution[:, 0]
        if (sol < 0).any():
            continue
        err = ((A @ sol - y) ** 2).sum().item()
        if err < best[0]:
            c = torch.zeros(k)
            c[cols] = sol
            best = (err, c / scale)
    return best[1]


def base_features(work, shape, long_terms=True):
    """The law's terms before the short-span ones (fixed, GEMV, small product per FLOP, GEMM packing and
    FLOPs, sequences, KV bytes, attention and recurrent FLOPs; with long_terms, a long span's fixed cost and
    KV bytes in place of the short KV term) for shape = (batch, tokens, context, attention, all_logits)."""
    b, t = shape[0], shape[1]
    dense, kv, attention, recurrent = work(*shape)
    m, long = b * t, t > 64
    f = [1.0, dense if m == 1 else 0, dense if 2 <= m <= 6 else 0, 1.0 if m > 6 else 0, dense if m > 6 else 0,
         float(b), kv if not (long_terms and long) else 0, attention, recurrent]
    if long_terms:
        f += [1.0 if long else 0, kv if long else 0]
    return f
