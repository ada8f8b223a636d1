"""A stranger's MoE layer with LoRA, driven the way a serving engine drives vLLM's FusedMoEWithLoRA.

Pure PyTorch and self-contained (no harness import): it stands for a layer you did not write. The engine
builds it once with the base weights, allocates the stacked LoRA buffers once (`create_lora_weights`),
then per request set loads and resets adapter slots (`set_lora` / `reset_lora`), per batch sets the
token -> slot mapping (`update_mapping`, punica's metadata update) and runs `forward`, which routes itself.

Rounding points (each GEMM accumulates in float32; `rnd` is the cast to the layer dtype):
    cache1 = rnd(x @ w13[e]^T + b13[e])
    cache1[:, slice s] = rnd(cache1[:, s] + rnd(B13_s @ rnd(A13_s @ x)))         tokens with an enabled slot
    act    = rnd(rnd(f(gate)) * up)  gated  |  rnd(f(cache1))  non-gated (`*_no_mul`)
    cache3 = rnd(w * (act @ w2[e]^T + b2[e]))                                    w: fp32 router weight
    cache3 = rnd(cache3 + rnd(w * (B2 @ rnd(A2 @ act))))                         tokens with an enabled slot
    out    = rnd(sum_k cache3)                                                   fp32 sum over the k experts
A token without an adapter (mapping -1, or a disabled slot) never enters the LoRA steps: its rows are the
base computation, bit for bit what the same layer built without LoRA returns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# activation name -> (f, gated). Gated: f(gate) * up with gate = the first I columns of cache1.
_ACTIVATIONS = {
    "silu": (F.silu, True),
    "gelu": (F.gelu, True),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), True),
    "silu_no_mul": (F.silu, False),
    "gelu_no_mul": (F.gelu, False),
    "gelu_tanh_no_mul": (lambda x: F.gelu(x, approximate="tanh"), False),
    "relu2_no_mul": (lambda x: torch.relu(x).square(), False),
}
ACTIVATIONS = tuple(_ACTIVATIONS)


class MoELoRALayer:
    """An MoE layer (softmax top-k router, w13 -> activation -> w2) with per-token LoRA adapters in
    vLLM's stacked-slot layout; a serving engine's view of FusedMoEWithLoRA."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, top_k: int, renormalize: bool = True,
                 activation: str = "silu", w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None):
        """Base weights w13 (E, 2I gated / I, H), w2 (E, H, I), optional biases (E, N1), (E, H); the layer's
        dtype and device are w13's."""
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.act_fn, self.gated = _ACTIVATIONS[activation]
        self.activation = activation
        E, N1, H = w13.shape
        I = w2.shape[2]
        if tuple(w2.shape) != (E, H, I) or N1 != (2 * I if self.gated else I):
            raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not form a "
                             f"{'gated' if self.gated else 'non-gated'} layer (w13 (E, {'2I' if self.gated else 'I'}, "
                             f"H), w2 (E, H, I))")
        if not 1 <= top_k <= E:
            raise ValueError(f"top_k must lie in [1, E={E}], got {top_k}")
        self.E, self.H, self.I, self.N1 = E, H, I, N1
        self.top_k, self.renormalize = top_k, renormalize
        self.dtype, self.device = w13.dtype, w13.device
        self.w13, self.w2 = w13, w2
        self.w13_bias, self.w2_bias = w13_bias, w2_bias
        self.lora_enabled = False
        self.token_lora_mapping: torch.Tensor | None = None

    # ------------------------------------------------------------------ LoRA state (vLLM's method names)

    def create_lora_weights(self, max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> None:
        """Allocate the zeroed stacked buffers once: w13_lora_a S x (L, E, R, H), w13_lora_b S x (L, E, I, R)
        (S = 2 gated: gate, up; 1 non-gated), w2_lora_a (L, E, R, I), w2_lora_b (L, E, H, R), adapter_enabled (L+1,)."""
        L, R, E, H, I = max_loras, max_rank, self.E, self.H, self.I
        dt, dev = dtype or self.dtype, self.device
        S = 2 if self.gated else 1
        self.max_loras, self.max_rank, self.lora_dtype = L, R, dt
        self.w13_lora_a = tuple(torch.zeros(L, E, R, H, dtype=dt, device=dev) for _ in range(S))
        self.w13_lora_b = tuple(torch.zeros(L, E, I, R, dtype=dt, device=dev) for _ in range(S))
        self.w2_lora_a = torch.zeros(L, E, R, I, dtype=dt, device=dev)
        self.w2_lora_b = torch.zeros(L, E, H, R, dtype=dt, device=dev)
        self.adapter_enabled = torch.zeros(L + 1, dtype=torch.int32, device=dev)
        self.lora_enabled = True

    def reset_lora(self, index: int) -> None:
        """Zero slot `index` and disable it: tokens mapped there get no adapter."""
        self._check_slot(index)
        for t in (*self.w13_lora_a, *self.w13_lora_b, self.w2_lora_a, self.w2_lora_b):
            t[index] = 0
        self.adapter_enabled[index] = 0

    def set_lora(self, index: int, lora_a: list, lora_b: list) -> None:
        """Load slot `index` from vLLM's lists (cast, scaled): lora_a = [w1_a, w2_a, w3_a], lora_b = [w1_b, w2_b,
        w3_b] (w3 None non-gated); reset, then copied into the rank corner, so a reused slot keeps nothing."""
        self.reset_lora(index)
        w1_a, w2_a, w3_a = lora_a
        w1_b, w2_b, w3_b = lora_b
        r = int(w1_a.shape[1])
        if not 1 <= r <= self.max_rank:
            raise ValueError(f"adapter rank {r} outside [1, max_rank={self.max_rank}]")
        w13 = [(w1_a, w1_b)] + ([(w3_a, w3_b)] if self.gated else [])
        if self.gated and (w3_a is None or w3_b is None):
            raise ValueError("a gated layer needs the up_proj (w3) factors")
        E, H, I = self.E, self.H, self.I
        for s, (a, b) in enumerate(w13):
            _check(f"w{1 if s == 0 else 3}_a", a, (E, r, H))
            _check(f"w{1 if s == 0 else 3}_b", b, (E, I, r))
            self.w13_lora_a[s][index, :, :r, :].copy_(a)
            self.w13_lora_b[s][index, :, :, :r].copy_(b)
        _check("w2_a", w2_a, (E, r, I))
        _check("w2_b", w2_b, (E, H, r))
        self.w2_lora_a[index, :, :r, :].copy_(w2_a)
        self.w2_lora_b[index, :, :, :r].copy_(w2_b)
        self.adapter_enabled[index] = 1

    def update_mapping(self, token_lora_mapping: torch.Tensor) -> None:
        """Per batch, as punica's metadata update: (T,) int32, each token's slot or -1 (no adapter)."""
        if not self.lora_enabled:
            raise RuntimeError("update_mapping on a layer built without LoRA (call create_lora_weights first)")
        m = token_lora_mapping.to(device=self.device, dtype=torch.int32).reshape(-1)
        if m.numel() and (int(m.min()) < -1 or int(m.max()) >= self.max_loras):
            raise ValueError(f"token_lora_mapping values must lie in [-1, max_loras={self.max_loras})")
        self.token_lora_mapping = m

    def _check_slot(self, index: int) -> None:
        """Raise unless LoRA buffers exist and `index` is one of their slots."""
        if not self.lora_enabled:
            raise RuntimeError("this layer was built without LoRA buffers (create_lora_weights not called)")
        if not 0 <= index < self.max_loras:
            raise IndexError(f"slot {index} outside [0, max_loras={self.max_loras})")

    # ------------------------------------------------------------------ forward

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights fp32 (T, k), topk_ids int64 (T, k)) as vLLM's topk_softmax: fp32 softmax, ties to the
        lower expert, renormalized by the fp32 sum of the selected weights (accumulated in selection order)."""
        x = router_logits.to(device=self.device, dtype=torch.float32)
        e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        scores = e * (1.0 / e.sum(dim=-1, keepdim=True))
        ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        w = torch.gather(scores, -1, ids)
        if self.renormalize:
            denom = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device)
            for j in range(self.top_k):
                denom = denom + w[:, j]
            denom = torch.where(denom > 0, denom, torch.ones_like(denom))
            w = w * (torch.tensor(1.0, dtype=torch.float32, device=w.device) / denom)[:, None]
        return w, ids

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """(T, H) output of the T tokens: route, base experts, LoRA deltas for tokens with an enabled slot,
        weighted sum over the k experts (the rounding points in the module docstring)."""
        T, dt, k = hidden_states.shape[0], self.dtype, self.top_k
        topk_w, topk_ids = self.route(router_logits)
        P = T * k
        tok = torch.arange(P, device=self.device) // k         # pair p = (token p // k, its j-th expert)
        expert = topk_ids.reshape(P)
        w = topk_w.reshape(P, 1)
        x = hidden_states.float()
        groups = self._lora_groups(tok, expert, T) if self.lora_enabled else []

        # w13: base GEMM (+ bias), one rounding; then the LoRA delta per slice for the adapter's pairs
        cache1 = torch.empty(P, self.N1, dtype=dt, device=self.device)
        for e, rows in _by_expert(expert):
            c = x[tok[rows]] @ self.w13[e].float().t()
            if self.w13_bias is not None:
                c = c + self.w13_bias[e].float()
            cache1[rows] = c.to(dt)
        for slot, e, rows in groups:
            xr = x[tok[rows]]
            for s, (A, B) in enumerate(zip(self.w13_lora_a, self.w13_lora_b)):
                u = (xr @ A[slot, e].float().t()).to(dt)                  # rank intermediate
                d = (u.float() @ B[slot, e].float().t()).to(dt)           # delta
                cols = slice(s * self.I, (s + 1) * self.I)                # gate slice first, then up
                cache1[rows, cols] = (cache1[rows, cols].float() + d.float()).to(dt)

        act = self._activate(cache1)

        # w2: base GEMM (+ bias), times the fp32 router weight, one rounding; then the weighted LoRA delta
        cache3 = torch.empty(P, self.H, dtype=dt, device=self.device)
        for e, rows in _by_expert(expert):
            c = act[rows].float() @ self.w2[e].float().t()
            if self.w2_bias is not None:
                c = c + self.w2_bias[e].float()
            cache3[rows] = (w[rows] * c).to(dt)
        for slot, e, rows in groups:
            u = (act[rows].float() @ self.w2_lora_a[slot, e].float().t()).to(dt)
            d = (w[rows] * (u.float() @ self.w2_lora_b[slot, e].float().t())).to(dt)
            cache3[rows] = (cache3[rows].float() + d.float()).to(dt)

        return cache3.view(T, k, self.H).float().sum(dim=1).to(dt)   # moe_sum: fp32, one rounding

    __call__ = forward

    def _activate(self, cache1: torch.Tensor) -> torch.Tensor:
        """act-and-mul: rnd(rnd(f(gate)) * up), the kernel rounding f(gate) first; `_no_mul`: rnd(f(x))."""
        if not self.gated:
            return self.act_fn(cache1.float()).to(self.dtype)
        gate, up = cache1[:, : self.I].float(), cache1[:, self.I:].float()
        return (self.act_fn(gate).to(self.dtype).float() * up).to(self.dtype)

    def _lora_groups(self, tok: torch.Tensor, expert: torch.Tensor, T: int) -> list:
        """[(slot, expert, pair rows)] of the pairs whose token maps to an enabled slot; nothing else is touched."""
        m = self.token_lora_mapping
        if m is None or m.numel() != T:
            raise RuntimeError(f"forward of {T} tokens but the last update_mapping covered "
                               f"{None if m is None else m.numel()} (set the mapping for every batch)")
        slot = m.long()[tok]
        active = slot >= 0
        active &= self.adapter_enabled.long()[slot.clamp(min=0)] != 0
        if not bool(active.any()):
            return []
        key = slot * self.E + expert
        out = []
        for kv in torch.unique(key[active]).tolist():
            rows = torch.nonzero(active & (key == kv)).flatten()
            out.append((kv // self.E, kv % self.E, rows))
        return out


def _by_expert(expert: torch.Tensor):
    """(expert, pair rows) for every expert some pair is routed to."""
    for e in torch.unique(expert).tolist():
        yield e, torch.nonzero(expert == e).flatten()


def _check(name: str, t: torch.Tensor, shape: tuple) -> None:
    """Raise ValueError naming the factor unless it has `shape`."""
    if t is None or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {None if t is None else tuple(t.shape)}")
