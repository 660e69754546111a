"""Admission control: a memory model predicts the peak of a set of jobs; a job is admitted only if it fits.

Peak bytes = shared(T) + sum_j per_job(j) + masks(T), with T the micro-batch token budget:

* shared(T) = beta0 + beta1 * T + beta2 * T^2 (mLoRA's scheduler model, eq. 5: base weights, activations of one
  packed micro-batch; the T^2 term is left to the fit: no attention route here holds a T x T tensor, as rows are
  capped at the jobs' max_length under a mask, or attend example by example without one);
* per_job(j) = bytes_per_param * P_j + bytes_per_rank_token * r_j * T_j (adapter weights, grads, AdamW states
  and the stored x@A of its layers);
* masks = bytes_per_mask_elem * T * sum of d_in over the modules that some job with lora_dropout > 0 adapts (the
  LoRA-dropout keep-masks saved for backward, one byte per input element: see :meth:`MemoryModel.mask_bytes`).

``analytic()`` gives coefficients from the model shape (the only choice on CPU). On GPU the engine records the
measured peak (``torch.cuda.max_memory_allocated``) of each round and :meth:`MemoryModel.fit` refits the
coefficients by non-negative least squares once it has enough distinct points; the analytic model remains the
fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

GiB = 1024 ** 3
#: what a step holds besides weights and activations (cuBLAS and attention workspaces, the loss's buffers): a
#: micro-batch's peak less its activations was ~1 GiB on the 8B shape
WORKSPACE_BYTES = 5 * GiB // 4


@dataclass
class JobFootprint:
    name: str
    params: int  # trainable parameters
    rank_sum: int  # sum over target layers of the rank (x@A activations per token)
    # lora_dropout > 0: ((module path, d_in), ...) of the modules whose LoRA input it drops out; () without dropout
    dropout_modules: tuple = ()


@dataclass
class MemoryModel:
    beta: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # shared: b0 + b1 T + b2 T^2
    bytes_per_param: float = 16.0  # fp32 param + grad + 2 AdamW moments
    bytes_per_rank_token: float = 8.0
    bytes_per_mask_elem: float = 1.0  # LoRA-dropout keep-mask: int8 (grouped kernel), bool (torch paths, CUDA)
    points: list = field(default_factory=list)  # (T, sum params, sum rank_sum*T, measured bytes less the masks)
    fitted: bool = False

    @classmethod
    def analytic(cls, config, n_base_params: int, base_dtype_bytes: int = 4, act_bytes: int = 4,
                 n_layers: Optional[int] = None, logits: bool = True, checkpointed_layers: int = 0,
                 fused_layers: bool = False, mask_length: int = 0, eager_attention: bool = False) -> "MemoryModel":
        """Coefficients from a transformers config (Llama-like): a deliberately generous estimate. ``n_layers``:
        the decoder layers run here (a pipeline stage's own; default all of the config's); ``logits``: whether
        the LM head's logits are computed here (the last stage only); ``checkpointed_layers``: layers that keep
        only their input for backward (activation checkpointing), one of them at a time holding its activations
        again while it recomputes; ``fused_layers``: Liger's RMSNorm and SwiGLU on the base (they keep fewer
        activations); ``mask_length``: the rows' length where attention runs under a mask over capped rows (0
        where it attends example by example without one); ``eager_attention``: the eager path, which keeps each
        layer's attention probabilities (heads x mask_length per token)."""
        h = int(getattr(config, "hidden_size", 1024))
        inter = int(getattr(config, "intermediate_size", 4 * h))
        layers = int(getattr(config, "num_hidden_layers", 12)) if n_layers is None else int(n_layers)
        vocab = int(getattr(config, "vocab_size", 32000))
        heads = int(getattr(config, "num_attention_heads", 8))
        # activations kept for backward per token and layer: ~ 16 h + 4 inter values through torch's norms and MLP,
        # 10 h + 3.5 inter through Liger's (Llama-3.1-8B's shape, bf16, one H200: the engine's measured peaks, one
        # job at up to 5,150 tokens a micro-batch and three at up to ~14,000, were 0.87x and ~0.86-0.91x what this
        # predicts; BENCHMARKS.md, Training); logits of response tokens in the activations' dtype, in fp32 and their
        # gradient
        per_layer = 10 * h + 7 * inter // 2 if fused_layers else 16 * h + 4 * inter
        ckpt = min(int(checkpointed_layers), layers)
        kept = layers - ckpt + (1 if ckpt else 0)
        per_token = (kept * per_layer + ckpt * h) * act_bytes + (3 * vocab * 4 if logits else 0)
        # a capped row's bool mask (mask_length bytes a token, one mask shared by the layers); eager attention's
        # probabilities and their dropout input, per kept layer
        per_token += mask_length + (kept * heads * mask_length * 2 * act_bytes if eager_attention else 0)
        b0 = n_base_params * base_dtype_bytes + WORKSPACE_BYTES
        return cls(beta=[float(b0), float(per_token), 0.0], bytes_per_param=16.0,
                   bytes_per_rank_token=float(2 * act_bytes))

    @classmethod
    def for_model(cls, model, checkpointed_layers: int = 0, fused_layers: bool = False, mask_length: int = 0,
                  eager_attention: bool = False) -> "MemoryModel":
        """:meth:`analytic` for a causal LM as built or loaded here: its parameters (on a pipeline stage only the
        stage's own), activations in the parameters' dtype (the base is loaded straight in the run's precision),
        the decoder layers that hold parameters (another stage's placeholders hold none) and the logits only where
        the LM head is; the rest as :meth:`analytic` takes it."""
        params = list(model.parameters())
        decoder = getattr(model, getattr(model, "base_model_prefix", ""), model)
        layers = getattr(decoder, "layers", None)
        held = None if layers is None else sum(1 for layer in layers if next(layer.parameters(), None) is not None)
        # activations in the floating parameters' dtype; the base's bytes as stored (a bitsandbytes 4-bit weight is
        # a uint8 tensor of packed pairs, counted here as the bytes it holds)
        floating = [p for p in params if p.is_floating_point()]
        nbytes = floating[0].element_size() if floating else 4
        stored = sum(p.numel() * p.element_size() for p in params)
        return cls.analytic(model.config, -(-stored // nbytes), nbytes, act_bytes=nbytes, n_layers=held,
                            logits=model.get_output_embeddings() is not None, checkpointed_layers=checkpointed_layers,
                            fused_layers=fused_layers, mask_length=mask_length, eager_attention=eager_attention)

    def predict(self, tokens: int, jobs: list[JobFootprint]) -> float:
        t = float(tokens)
        shared = self.beta[0] + self.beta[1] * t + self.beta[2] * t * t
        per = sum(self.bytes_per_param * j.params + self.bytes_per_rank_token * j.rank_sum * t for j in jobs)
        return shared + per + self.mask_bytes(tokens, jobs)

    def mask_bytes(self, tokens: int, jobs: list[JobFootprint]) -> float:
        """LoRA-dropout keep-masks saved for backward (one micro-batch in flight), counted over all T tokens of
        the micro-batch once per module that any dropout job adapts, not per job: the Triton grouped kernel
        (``_LoraLinearFn``) allocates its int8 (T, d_in) mask for every row of a module call as soon as one
        adapter of the call drops out; the cuBLAS path's bool masks and the torch paths' (``F.dropout`` on a job's
        rows: bool on CUDA) cover the dropout jobs' disjoint rows, so at most T of them. Jobs without dropout add
        nothing. On CUDA the cuBLAS path draws the mask inside its kernels (``bdlora.kernels.dropout``) and stores
        none for jobs of rank <= 128: there the term is an upper bound, which the refit on measured peaks absorbs
        (``observe`` subtracts exactly what ``predict`` adds). Not counted (the fit absorbs it per token): the
        cuBLAS path's materialized route and the torch paths also keep the dropped-out copy of the job's rows
        (activation dtype) for the x@A backward, and on CPU ``F.dropout``'s mask is in the activation dtype, not
        bool."""
        d_in = dict(m for j in jobs for m in j.dropout_modules)  # module path -> d_in, each module once
        return self.bytes_per_mask_elem * float(tokens) * sum(d_in.values())

    def observe(self, tokens: int, jobs: list[JobFootprint], measured_bytes: float) -> None:
        # the masks are known (exactly for the grouped kernel): the fit sees the rest, predict adds them back
        self.points.append((float(tokens), float(sum(j.params for j in jobs)),
                            float(sum(j.rank_sum for j in jobs)) * float(tokens),
                            float(measured_bytes) - self.mask_bytes(tokens, jobs)))

    def fit(self, min_points: int = 5) -> bool:
        """Non-negative least squares over [1, T, T^2, params, rank*T]; needs varied points. Returns success."""
        if len(self.points) < min_points:
            return False
        x = torch.tensor([[1.0, t, t * t, p, rt] for t, p, rt, _ in self.points], dtype=torch.float64)
        y = torch.tensor([m for *_, m in self.points], dtype=torch.float64)
        if torch.linalg.matrix_rank(x) < 2:
            return False
        active = list(range(x.shape[1]))
        coef = torch.zeros(x.shape[1], dtype=torch.float64)
        for _ in range(x.shape[1]):  # drop negative coefficients and refit (small active-set NNLS)
            sol = torch.linalg.lstsq(x[:, active], y.unsqueeze(1)).solution.squeeze(1)
            if (sol >= 0).all():
                coef.zero_()
                coef[active] = sol
                break
            active = [a for a, v in zip(active, sol.tolist()) if v >= 0]
            if not active:
                return False
        else:
            return False
        c = coef.tolist()
        # keep the analytic per-parameter cost as a floor: weights+grads+Adam states are certain
        self.beta = c[:3]
        self.bytes_per_param = max(c[3], 16.0)
        self.bytes_per_rank_token = c[4]
        self.fitted = True
        return True


AUTO_TOKEN_BUDGETS = (16384, 8192, 4096, 2048, 1024, 512)  # ``token_budget: auto`` tries these, largest first
CPU_TOKEN_BUDGET = 2048  # auto without a memory limit (CPU): larger micro-batches there only cost RAM


def token_budget_candidates(longest: int) -> list[int]:
    """The micro-batch sizes ``token_budget: auto`` chooses among, largest first: :data:`AUTO_TOKEN_BUDGETS` above
    ``longest`` (the longest example must fit a micro-batch), then ``longest`` itself."""
    return sorted({t for t in AUTO_TOKEN_BUDGETS if t > longest} | {longest}, reverse=True)


def auto_token_budget(memory: MemoryModel, jobs: list[JobFootprint], limit: Optional[float], step_tokens: int,
                      longest: int) -> int:
    """``token_budget: auto``: the micro-batch size for ``jobs`` (the jobs first admitted together).

    With a memory ``limit``: the largest of :data:`AUTO_TOKEN_BUDGETS` at which ``memory`` admits ``jobs``, starting
    from the smallest that holds ``step_tokens`` (one step of every job: a larger budget would only raise the
    prediction), never below ``longest`` (every example must fit a micro-batch); the smallest candidate when none is
    admitted (admission then refuses with its message). Without a limit: :data:`CPU_TOKEN_BUDGET` or ``longest``.
    Larger is faster while it fits: on the 8B shape, 4 to 8 jobs ran 1.3-1.6x the tokens/s at 8192 than at 4096,
    and four jobs at batches of 32 1.09-1.12x at 16384 than at 8192 (one H200, BENCHMARKS.md)."""
    if limit is None:
        return max(CPU_TOKEN_BUDGET, longest)
    cands = token_budget_candidates(longest)
    holding = [t for t in cands if t >= step_tokens]
    start = min(holding) if holding else cands[0]
    for t in cands:
        if t <= start and memory.predict(t, jobs) <= limit:
            return t
    return cands[-1]


def device_budget_bytes(device: torch.device, budget_gb: Optional[float]) -> Optional[float]:
    if budget_gb is not None:
        return float(budget_gb) * GiB
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return 0.9 * total
    return None


__all__ = ["AUTO_TOKEN_BUDGETS", "CPU_TOKEN_BUDGET", "GiB", "JobFootprint", "MemoryModel", "auto_token_budget",
           "token_budget_candidates",
           "device_budget_bytes"]
