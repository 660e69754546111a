"""Loss-aware early exit (ALTO, loss-aware early exit for multi-adapter tuning, Sec. 5): divergence, overfitting, and warm-up top-k selection.

Per job, an :class:`EarlyExit` detector sees the train loss every step (smoothed by an EMA) and the raw validation
loss at every evaluation, Optuna-pruner style::

    det = EarlyExit()
    det.report_train(step, loss)       # every optimizer step
    det.report(step, val_loss)         # every evaluation: runs the rules
    if det.should_stop(): reason = det.reason   # "diverging" | "overfitting"

Rules, checked at each evaluation (the EMA train loss is sampled at the same points as the val loss):

* divergence: least-squares slopes of the last ``window`` EMA-train and val points both >= ``tau_slope`` for
  ``patience`` consecutive evaluations (the counter resets when either slope drops below);
* overfitting: gap ``(val - ema_train) / ema_train > tau_gap`` for ``patience`` consecutive evaluations; the
  caller keeps the best-validation checkpoint (``best_step`` / ``best_value``);
* a non-finite loss is divergence at once.

:func:`select_after_warmup` ranks a group's jobs at the end of warm-up by validation loss and keeps the top
``ceil(keep_ratio * n)``; the rest exit as ``underperforming``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

DIVERGING = "diverging"
OVERFITTING = "overfitting"
UNDERPERFORMING = "underperforming"


def linreg_slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against 0..n-1."""
    n = len(values)
    if n < 2:
        return 0.0
    xm = (n - 1) / 2.0
    ym = sum(values) / n
    num = sum((i - xm) * (v - ym) for i, v in enumerate(values))
    den = sum((i - xm) ** 2 for i in range(n))
    return num / den


class EarlyExit:
    def __init__(self, window: int = 2, patience: int = 2, tau_slope: float = 0.001, tau_gap: float = 0.1,
                 ema_alpha: float = 0.3, divergence: bool = True, overfitting: bool = True):
        if window < 2:
            raise ValueError("window must be >= 2 (a slope needs two points)")
        self.window, self.patience = int(window), int(patience)
        self.tau_slope, self.tau_gap, self.ema_alpha = float(tau_slope), float(tau_gap), float(ema_alpha)
        self.divergence, self.overfitting = divergence, overfitting
        self.ema: Optional[float] = None
        self.train_hist: list[tuple[int, float]] = []  # (step, ema) sampled at evaluations
        self.val_hist: list[tuple[int, float]] = []
        self.cnt_div = 0
        self.cnt_ovf = 0
        self.best_value = math.inf
        self.best_step: Optional[int] = None
        self.reason: Optional[str] = None

    # -- reporting ---------------------------------------------------------------------------------
    def report_train(self, step: int, loss: float) -> None:
        loss = float(loss)
        if not math.isfinite(loss):
            self.reason = self.reason or DIVERGING
            return
        self.ema = loss if self.ema is None else self.ema_alpha * loss + (1 - self.ema_alpha) * self.ema

    def report(self, step: int, value: float) -> Optional[str]:
        """Reports the validation loss at ``step`` and applies the rules; returns the exit reason or None."""
        value = float(value)
        if not math.isfinite(value):
            self.reason = self.reason or DIVERGING
            return self.reason
        self.val_hist.append((int(step), value))
        if value < self.best_value:
            self.best_value, self.best_step = value, int(step)
        if self.ema is None:
            return self.reason
        self.train_hist.append((int(step), self.ema))
        w = self.window
        if self.divergence and len(self.train_hist) >= w and len(self.val_hist) >= w:
            s_train = linreg_slope([v for _, v in self.train_hist[-w:]])
            s_val = linreg_slope([v for _, v in self.val_hist[-w:]])
            self.cnt_div = self.cnt_div + 1 if (s_train >= self.tau_slope and s_val >= self.tau_slope) else 0
            if self.cnt_div >= self.patience:
                self.reason = self.reason or DIVERGING
        if self.overfitting and self.reason is None:
            gap = (value - self.ema) / self.ema if self.ema > 0 else 0.0
            self.cnt_ovf = self.cnt_ovf + 1 if gap > self.tau_gap else 0
            if self.cnt_ovf >= self.patience:
                self.reason = OVERFITTING
        return self.reason

    def should_stop(self) -> bool:
        return self.reason is not None

    @property
    def is_best_latest(self) -> bool:
        return bool(self.val_hist) and self.best_step == self.val_hist[-1][0]

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, s: dict) -> None:
        for k, v in s.items():
            setattr(self, k, v)
        self.train_hist = [tuple(x) for x in self.train_hist]
        self.val_hist = [tuple(x) for x in self.val_hist]


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return max(1, int(math.ceil(warmup_ratio * total_steps)))


def select_after_warmup(val_losses: dict, keep_ratio: float = 0.25) -> tuple[list, list]:
    """(kept, evicted) job keys: the top ``ceil(keep_ratio * n)`` by validation loss are kept (ties: key order).

    Non-finite losses rank last.
    """
    keys = list(val_losses)
    ranked = sorted(keys, key=lambda k: (not math.isfinite(val_losses[k]),
                                         val_losses[k] if math.isfinite(val_losses[k]) else 0.0, keys.index(k)))
    k = max(1, int(math.ceil(keep_ratio * len(ranked)))) if ranked else 0
    return ranked[:k], ranked[k:]


__all__ = ["DIVERGING", "EarlyExit", "OVERFITTING", "UNDERPERFORMING", "linreg_slope", "select_after_warmup",
           "warmup_steps"]
