"""Attention-pooling head: a small transformer over a step's token features, pooled by learned
attention, then an MLP -> logit of P(wrong).

Why not just mean-pool: the evidence that a step is wrong often sits in a few tokens (a digit, an
operator), and mean pooling dilutes it over long steps; learned attention can pick those tokens.
The recipe's ``pooling`` is not used here — this head pools itself.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm.auto import tqdm

from ..features import FeatureRecipe
from ..metrics import roc_auc
from .base import HeadMismatchError, StepsLike, UncertaintyHead, check_labels
from .token_inputs import TokenInputs


class AttentionPoolingNet(nn.Module):
    """Standardise -> Linear+LayerNorm -> +positional embedding -> TransformerEncoder ->
    attention pooling (learned scorer, softmax over real tokens) -> MLP -> logit."""

    def __init__(self, n_features: int, d_model: int, nhead: int, num_layers: int,
                 dim_feedforward: int, dropout: float, max_len: int):
        super().__init__()
        # Train-set feature statistics live in the state dict so they are saved with the weights.
        self.register_buffer("feat_mean", torch.zeros(n_features))
        self.register_buffer("feat_std", torch.ones(n_features))
        self.in_proj = nn.Linear(n_features, d_model)
        self.in_norm = nn.LayerNorm(d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.scorer = nn.Linear(d_model, 1)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_model, 1))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """``x [B, t, F]``, ``pad [B, t]`` (True = padding) -> logits ``[B]``."""
        return self.from_inputs(self.in_proj((x - self.feat_mean) / self.feat_std), pad)

    def from_inputs(self, pre: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` from the tokens' ``in_proj`` outputs ``pre [B, t, d_model]``."""
        h = self.in_norm(pre) + self.pos(torch.arange(pre.shape[1], device=pre.device))
        h = self.encoder(h, src_key_padding_mask=pad)
        h = h.masked_fill(pad.unsqueeze(-1), 0.0)
        weights = torch.softmax(self.scorer(h).squeeze(-1).masked_fill(pad, float("-inf")), dim=-1)
        return self.mlp((weights.unsqueeze(-1) * h).sum(dim=1)).squeeze(-1)


def pad_batch(steps: list[torch.Tensor], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad steps to ``[B, t_max, F]`` with a padding mask; steps longer than ``max_len`` keep
    their last tokens (the end of a step has read all of it)."""
    steps = [s[-max_len:] for s in steps]
    t_max = max(s.shape[0] for s in steps)
    x = steps[0].new_zeros(len(steps), t_max, steps[0].shape[1])
    pad = torch.ones(len(steps), t_max, dtype=torch.bool)
    for i, s in enumerate(steps):
        x[i, : s.shape[0]] = s
        pad[i, : s.shape[0]] = False
    return x, pad


class AttentionPoolingHead(UncertaintyHead):
    """Torch head trained with AdamW on BCE (``pos_weight`` = #correct / #wrong), early-stopped on
    validation ROC-AUC of a stratified, seeded split; the best epoch's weights are kept.

    Fully deterministic for a given ``seed`` (its own RNG state; global RNGs are left untouched).
    With ``val_fraction=0`` or too few examples per class, trains ``max_epochs`` without stopping.
    """

    head_type = "attention_pooling"
    aliases = ("attention",)
    _param_names = ("d_model", "nhead", "num_layers", "dim_feedforward", "dropout", "max_len", "lr",
                    "weight_decay", "batch_size", "max_epochs", "patience", "val_fraction", "seed", "progress")

    def __init__(
        self,
        recipe: FeatureRecipe | dict[str, Any] | None = None,
        model_identity: dict[str, Any] | None = None,
        d_model: int = 128,
        nhead: int = 4,
        num_layers: int = 1,
        dim_feedforward: int = 256,
        dropout: float = 0.1,
        max_len: int = 256,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        batch_size: int = 32,
        max_epochs: int = 100,
        patience: int = 10,
        val_fraction: float = 0.2,
        seed: int = 0,
        progress: bool = True,
    ):
        super().__init__(recipe, model_identity)
        self.d_model = d_model
        self.nhead = nhead
        self.num_layers = num_layers
        self.dim_feedforward = dim_feedforward
        self.dropout = dropout
        self.max_len = max_len
        self.lr = lr
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.max_epochs = max_epochs
        self.patience = patience
        self.val_fraction = val_fraction
        self.seed = seed
        self.progress = progress

    def _new_net(self, n_features: int) -> AttentionPoolingNet:
        return AttentionPoolingNet(n_features, self.d_model, self.nhead, self.num_layers,
                                   self.dim_feedforward, self.dropout, self.max_len)

    def _split(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.arange(len(y))
        n_val = math.ceil(self.val_fraction * len(y))
        if self.val_fraction <= 0 or np.bincount(y).min() < 2 or n_val < 2 or len(y) - n_val < 2:
            return idx, idx[:0]
        train, val = train_test_split(idx, test_size=n_val, stratify=y, random_state=self.seed)
        return np.sort(train), np.sort(val)

    def _logits(self, net: AttentionPoolingNet, steps: list[torch.Tensor],
                run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Eval-mode logits in input order (``run``: the net, or its tail from ``in_proj`` outputs);
        batches are length-sorted to limit padding."""
        run = net if run is None else run
        net.eval()
        order = sorted(range(len(steps)), key=lambda i: steps[i].shape[0])
        out = torch.empty(len(steps))
        with torch.inference_mode():
            for b in range(0, len(order), self.batch_size):
                ids = order[b : b + self.batch_size]
                out[ids] = run(*pad_batch([steps[i] for i in ids], self.max_len))
        return out

    def _train_epoch(self, net: AttentionPoolingNet, opt: torch.optim.Optimizer, loss_fn: nn.Module,
                     steps: list[torch.Tensor], y: np.ndarray, order: np.ndarray) -> float:
        """One pass over ``order`` in mini-batches; returns the mean batch loss."""
        net.train()
        losses = []
        for b in range(0, len(order), self.batch_size):
            ids = order[b : b + self.batch_size]
            x, pad = pad_batch([steps[i] for i in ids], self.max_len)
            loss = loss_fn(net(x, pad), torch.as_tensor(y[ids], dtype=torch.float32))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            losses.append(loss.detach().item())
        return float(np.mean(losses))

    def fit(self, steps: StepsLike, labels: Any) -> "AttentionPoolingHead":
        tensors = self._as_steps(steps, fitting=True)
        y = check_labels(labels, len(tensors))
        train_idx, val_idx = self._split(y)
        y_train = y[train_idx]
        n_wrong = int(y_train.sum())
        if n_wrong == 0 or n_wrong == len(y_train):
            raise ValueError("training split has one class only")
        rng = np.random.default_rng(self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            net = self._new_net(tensors[0].shape[1])
            tokens = torch.cat([tensors[i][-self.max_len :] for i in train_idx])
            net.feat_mean.copy_(tokens.mean(dim=0))
            net.feat_std.copy_(tokens.std(dim=0, unbiased=False).clamp_min(1e-6))
            opt = torch.optim.AdamW(net.parameters(), lr=self.lr, weight_decay=self.weight_decay)
            loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((len(y_train) - n_wrong) / n_wrong))
            best: dict[str, Any] = {"auc": -math.inf, "loss": math.inf, "epoch": -1, "state": None}
            bad_epochs, epoch = 0, 0
            bar = tqdm(range(self.max_epochs), desc=type(self).__name__, disable=not self.progress, leave=False)
            for epoch in bar:
                train_loss = self._train_epoch(net, opt, loss_fn, tensors, y, rng.permutation(train_idx))
                if len(val_idx) == 0:
                    continue
                val_logits = self._logits(net, [tensors[i] for i in val_idx])
                y_val = torch.as_tensor(y[val_idx], dtype=torch.float32)
                val_loss = float(loss_fn(val_logits, y_val))
                val_auc = roc_auc(y[val_idx], val_logits.numpy())
                bar.set_postfix(loss=f"{train_loss:.4f}", val_auc=f"{val_auc:.4f}")
                if val_auc > best["auc"] or (val_auc == best["auc"] and val_loss < best["loss"]):
                    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
                    best = {"auc": val_auc, "loss": val_loss, "epoch": epoch, "state": state}
                    bad_epochs = 0
                else:
                    bad_epochs += 1
                    if bad_epochs >= self.patience:
                        break
            bar.close()
        if best["state"] is not None:
            net.load_state_dict(best["state"])
        net.eval()
        self.net_ = net
        self.n_features_in_ = int(tensors[0].shape[1])
        self.training_summary_ = {
            "n_train": int(len(train_idx)),
            "n_val": int(len(val_idx)),
            "n_wrong_train": n_wrong,
            "epochs_run": epoch + 1,
            "best_epoch": best["epoch"] if best["state"] is not None else epoch,
            "best_val_roc_auc": None if best["state"] is None else float(best["auc"]),
            "best_val_loss": None if best["state"] is None else float(best["loss"]),
        }
        return self

    def decision_function(self, steps: StepsLike) -> np.ndarray:
        """Logit of P(wrong) per step."""
        return self._logits(self.net_, self._as_steps(steps)).numpy().astype(np.float64)

    def predict_proba(self, steps: StepsLike) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.decision_function(steps)))

    def token_inputs(self) -> TokenInputs:
        """``in_proj`` with the standardisation folded in; the network runs on the host."""
        layers, topk = self._reads()
        net, r = self.net_, self.n_features_in_ - topk
        w = net.in_proj.weight.detach().double() / net.feat_std.double()
        bias = net.in_proj.bias.detach().double() - w @ net.feat_mean.double()
        w_lp = w[:, r:]

        def finish(steps: list[torch.Tensor], lps: list[torch.Tensor]) -> np.ndarray:
            pre = [(u.double() + lp.double() @ w_lp.T + bias).float() for u, lp in zip(steps, lps)]
            return self._logits(net, pre, net.from_inputs).numpy().astype(np.float64)

        return TokenInputs(layers, w[:, :r].float().contiguous(), topk, finish)

    def _weights(self) -> dict[str, torch.Tensor]:
        return dict(self.net_.state_dict())

    def _set_weights(self, weights: dict[str, torch.Tensor], n_features: int) -> None:
        have = tuple(weights["in_proj.weight"].shape)
        if have != (self.d_model, n_features):
            raise HeadMismatchError(
                f"weight 'in_proj.weight' has shape {have} but config says ({self.d_model}, {n_features})"
            )
        net = self._new_net(n_features)
        net.load_state_dict(weights, strict=True)
        net.eval()
        self.net_ = net
