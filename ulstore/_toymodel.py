"""The toy model's arithmetic: forward and backward pass (:func:`loss_and_grads`) and AdamW.

Split out of :mod:`ulstore.toytrain` (which holds the configurations, the
corpus and the training loop); like it, numpy only.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["loss_and_grads", "AdamW"]

_LN_EPS = 1e-5
_GELU_C = math.sqrt(2.0 / math.pi)
_BETA1, _BETA2, _ADAM_EPS = 0.9, 0.999, 1e-8


def _gelu(u):
    """tanh-approximate GELU; also returns tanh(.) for the backward pass."""
    t = np.tanh(_GELU_C * (u + 0.044715 * u**3))
    return 0.5 * u * (1.0 + t), t


def _gelu_grad(u, t):
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * u * u)


def _layernorm(x, w, b):
    mu = x.mean(axis=1, keepdims=True)
    xc = x - mu
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=1, keepdims=True) + _LN_EPS)
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd)


def _layernorm_backward(dy, w, cache):
    xhat, rstd = cache
    dxhat = dy * w
    dx = rstd * (dxhat - dxhat.mean(axis=1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)


def loss_and_grads(
    params: dict[str, np.ndarray], tokens: np.ndarray, config, *, need_grads: bool = True
) -> tuple[float, dict[str, np.ndarray] | None]:
    """Mean next-byte cross-entropy and its gradient, by hand.

    Computation runs in the dtype of ``params`` (float32 for training,
    float64 for gradient checks).

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        As returned by :func:`init_params`.
    tokens : numpy.ndarray of int, shape (batch, context + 1)
        Each row: ``context`` input bytes followed by the target byte.
    config : ToyConfig
    need_grads : bool, default True
        False skips the backward pass.

    Returns
    -------
    loss : float
    grads : dict of str to numpy.ndarray or None
        Same names and shapes as ``params``.
    """
    P, L = params, config.num_hidden_layers
    inputs, targets = tokens[:, :-1], tokens[:, -1]
    n_batch = tokens.shape[0]

    # ---- forward, keeping what the backward pass needs
    x_in = P["model.embed_tokens.weight"][inputs].reshape(n_batch, -1)
    x = x_in @ P["model.in_proj.weight"].T + P["model.in_proj.bias"]
    caches = []
    for i in range(L):
        p = f"model.layers.{i}."
        h, ln = _layernorm(x, P[p + "norm.weight"], P[p + "norm.bias"])
        u = h @ P[p + "mlp.up_proj.weight"].T + P[p + "mlp.up_proj.bias"]
        a, t = _gelu(u)
        x = x + a @ P[p + "mlp.down_proj.weight"].T + P[p + "mlp.down_proj.bias"]
        caches.append((h, ln, u, a, t))
    hf, lnf = _layernorm(x, P["model.norm.weight"], P["model.norm.bias"])
    logits = hf @ P["lm_head.weight"].T
    logits -= logits.max(axis=1, keepdims=True)  # stable log-softmax
    logz = np.log(np.exp(logits).sum(axis=1, keepdims=True))
    logp = logits - logz
    loss = float(-logp[np.arange(n_batch), targets].mean())
    if not need_grads:
        return loss, None

    # ---- backward
    G = {}
    dlogits = np.exp(logp)
    dlogits[np.arange(n_batch), targets] -= 1.0
    dlogits /= n_batch
    G["lm_head.weight"] = dlogits.T @ hf
    dx, G["model.norm.weight"], G["model.norm.bias"] = _layernorm_backward(
        dlogits @ P["lm_head.weight"], P["model.norm.weight"], lnf
    )
    for i in reversed(range(L)):
        p = f"model.layers.{i}."
        h, ln, u, a, t = caches[i]
        # residual: dx flows straight through and into the MLP branch
        G[p + "mlp.down_proj.weight"] = dx.T @ a
        G[p + "mlp.down_proj.bias"] = dx.sum(axis=0)
        du = (dx @ P[p + "mlp.down_proj.weight"]) * _gelu_grad(u, t)
        G[p + "mlp.up_proj.weight"] = du.T @ h
        G[p + "mlp.up_proj.bias"] = du.sum(axis=0)
        dh, G[p + "norm.weight"], G[p + "norm.bias"] = _layernorm_backward(
            du @ P[p + "mlp.up_proj.weight"], P[p + "norm.weight"], ln
        )
        dx = dx + dh
    G["model.in_proj.weight"] = dx.T @ x_in
    G["model.in_proj.bias"] = dx.sum(axis=0)
    dx_in = (dx @ P["model.in_proj.weight"]).reshape(n_batch * config.context, -1)
    demb = np.zeros_like(P["model.embed_tokens.weight"])
    np.add.at(demb, inputs.reshape(-1), dx_in)  # repeated bytes accumulate
    G["model.embed_tokens.weight"] = demb
    return loss, {name: G[name] for name in P}


class AdamW:
    """AdamW on fp32 master weights, updated in place.

    Weight decay is decoupled and applied to matrices only (not to biases or
    LayerNorm parameters), as in most LM training recipes.
    """

    def __init__(self, params, weight_decay):
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0
        self.weight_decay = weight_decay

    def step(self, params, grads, lr):
        self.t += 1
        # Python floats (not numpy float64 scalars) keep the arithmetic in float32.
        step_size = lr / (1.0 - _BETA1**self.t)
        inv_sqrt_bc2 = 1.0 / math.sqrt(1.0 - _BETA2**self.t)
        for name, w in params.items():
            g, m, v = grads[name], self.m[name], self.v[name]
            m *= _BETA1
            m += (1.0 - _BETA1) * g
            v *= _BETA2
            v += (1.0 - _BETA2) * (g * g)
            if self.weight_decay and w.ndim > 1:
                w *= 1.0 - lr * self.weight_decay
            denom = np.sqrt(v)
            denom *= inv_sqrt_bc2
            denom += _ADAM_EPS
            w -= step_size * m / denom
