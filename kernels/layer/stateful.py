"""`StatefulMoELoRALayer`: a serving-style MoE+LoRA layer (the shape of vLLM's FusedMoEWithLoRA), built once
and driven batch after batch: adapters set into slots, a token -> slot mapping, eager forwards, graph replays.

Every batch is copied into static buffers sized for `max_tokens`; one MoELoRAContext over the stacked LoRA
buffers is built at construction. The per-batch function (`_run`) recomputes the LoRA metadata from the
buffers' first T rows and then runs FusedMoEKernel on views of the buffers, so a captured graph recomputes
the metadata at every replay. On the CPU a "graph" is that function, re-run over the static buffers.
"""
from __future__ import annotations

import torch

from moe_lora_harness.kernels.experts.config import MoEConfig
from moe_lora_harness.kernels.experts.dual_stream import EVENTS
from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
from moe_lora_harness.kernels.validate import checks_enabled


def _pos(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    return v


class StatefulMoELoRALayer:
    """One MoE layer with LoRA slots and static batch buffers (`config.lora_enabled=False`: the twin, the
    same layer with no LoRA buffers and no context).

    Public: set_lora, reset_lora, set_mapping, forward, capture, replay. Weights: w13 (E, N1, H), w2 (E, H, I)
    in config.dtype on `device` (QuantWeights for a quantized config), biases (E, N1) / (E, H) or None.
    Stacked LoRA buffers in vLLM's layout: w13_lora_a S x (L, E, R, H), w13_lora_b S x (L, E, I, R),
    w2_lora_a [(L, E, R, I)], w2_lora_b [(L, E, H, R)], adapter_enabled (L+1,) int32; S = 2 gated, 1 not.
    """

    def __init__(self, experts_cls, config: MoEConfig, w13, w2, *, w13_bias=None, w2_bias=None,
                 max_loras: int, max_tokens: int, device=None):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a kernels.experts.config.MoEConfig; got {type(config).__name__}")
        if config.expert_map or config.fully_sharded or config.apply_router_weight_on_input:
            raise ValueError("StatefulMoELoRALayer runs one unsharded rank: expert_map, fully_sharded and "
                             "apply_router_weight_on_input must be off")
        self.config = config
        self.max_loras = _pos(max_loras, "max_loras")
        self.max_tokens = _pos(max_tokens, "max_tokens")
        dev = torch.device(device if device is not None else w13.device)
        if dev.type == "cuda" and dev.index is None:        # as tensors report it: cuda:N
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        if self.device.type != config.device:
            raise ValueError(f"device {self.device} is not of config.device kind {config.device!r}")
        self.experts = experts_cls(config)
        self.kernel = FusedMoEKernel(NoEPPrepareAndFinalize(), self.experts)
        self.w13, self.w2, self.w13_bias, self.w2_bias = w13, w2, w13_bias, w2_bias
        c, dev, n = config, self.device, self.max_tokens
        self._hidden = torch.zeros(n, c.H, dtype=c.dtype, device=dev)
        self._topk_weights = torch.zeros(n, c.top_k, dtype=torch.float32, device=dev)
        self._topk_ids = (torch.arange(c.top_k, device=dev) % c.E).to(torch.int32).repeat(n, 1)
        self._out = torch.zeros(n, c.H, dtype=c.dtype, device=dev)
        self._mapping = torch.full((n,), -1, dtype=torch.int32, device=dev)   # what set_mapping wrote
        self._num_tokens: int | None = None                                  # T of the last set_mapping
        self._graphs: dict = {}
        self.lora_ctx: MoELoRAContext | None = None
        if c.lora_enabled:
            self._build_lora()

    # ------------------------------------------------------------------ construction
    def _build_lora(self) -> None:
        """The stacked buffers (zero), adapter_enabled, the metadata buffer and the one context over them."""
        c, dev, L, R = self.config, self.device, self.max_loras, self.config.max_lora_rank
        S = 2 if c.gated else 1
        z = lambda *shape: torch.zeros(*shape, dtype=c.dtype, device=dev)  # noqa: E731
        self.w13_lora_a = [z(L, c.E, R, c.H) for _ in range(S)]
        self.w13_lora_b = [z(L, c.E, c.I, R) for _ in range(S)]
        self.w2_lora_a = [z(L, c.E, R, c.I)]
        self.w2_lora_b = [z(L, c.E, c.H, R)]
        self.adapter_enabled = torch.zeros(L + 1, dtype=torch.int32, device=dev)
        # the per-batch LoRA metadata the kernels read: each token's slot when that slot is live, else -1
        self._token_lora = torch.full((self.max_tokens,), -1, dtype=torch.int32, device=dev)
        dual = isinstance(self.experts, DualStreamTritonExperts)
        aux = events = None
        if dual and dev.type == "cuda":   # the layer's own aux stream and events, created once
            aux = torch.cuda.Stream(device=dev)
            events = tuple(torch.cuda.Event() for _ in EVENTS)
        self.lora_ctx = MoELoRAContext(
            w13_lora_a_stacked=self.w13_lora_a, w13_lora_b_stacked=self.w13_lora_b,
            w2_lora_a_stacked=self.w2_lora_a, w2_lora_b_stacked=self.w2_lora_b,
            adapter_enabled=self.adapter_enabled, max_loras=L, top_k=c.top_k, w13_num_slices=S,
            local_num_experts=c.E, token_lora_mapping=self._token_lora, dual_stream=dual,
            aux_stream=aux, events=events)

    def _need_lora(self, what: str) -> None:
        if self.lora_ctx is None:
            raise RuntimeError(f"{what}: this layer was built with LoRA disabled (config.lora_enabled=False)")

    # ------------------------------------------------------------------ adapters
    def set_lora(self, index: int, w13_a: list, w13_b: list, w2_a: torch.Tensor, w2_b: torch.Tensor) -> None:
        """Load slot `index`: factors already cast and scaled, w13_a S x (E, r, H), w13_b S x (E, I, r),
        w2_a (E, r, I), w2_b (E, H, r); the slot is zeroed, then rank r fills its top-left corner."""
        self._need_lora("set_lora")
        self._check_slot(index)
        r = self._check_factors(w13_a, w13_b, w2_a, w2_b)
        self._zero_slot(index)
        for dst, src in zip(self.w13_lora_a, w13_a):
            dst[index, :, :r, :].copy_(src)
        for dst, src in zip(self.w13_lora_b, w13_b):
            dst[index, :, :, :r].copy_(src)
        self.w2_lora_a[0][index, :, :r, :].copy_(w2_a)
        self.w2_lora_b[0][index, :, :, :r].copy_(w2_b)
        self.adapter_enabled[index] = 1

    def reset_lora(self, index: int) -> None:
        """Empty slot `index`: zero its factors and disable it."""
        self._need_lora("reset_lora")
        self._check_slot(index)
        self._zero_slot(index)
        self.adapter_enabled[index] = 0

    def _zero_slot(self, index: int) -> None:
        for w in (*self.w13_lora_a, *self.w13_lora_b, *self.w2_lora_a, *self.w2_lora_b):
            w[index].zero_()

    def _check_slot(self, index) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.max_loras:
            raise ValueError(f"slot index must be an int in [0, max_loras={self.max_loras}); got {index!r}")

    def _check_factors(self, w13_a, w13_b, w2_a, w2_b) -> int:
        """The rank r of a slot's factors after checking count, shapes, dtype and device."""
        c, S, R = self.config, len(self.w13_lora_a), self.config.max_lora_rank
        if not isinstance(w13_a, (list, tuple)) or not isinstance(w13_b, (list, tuple)) \
                or len(w13_a) != S or len(w13_b) != S:
            raise ValueError(f"w13_a and w13_b must be lists of {S} slice(s) ({'gated' if S == 2 else 'non-gated'})")
        if not isinstance(w2_a, torch.Tensor) or w2_a.dim() != 3:
            raise ValueError(f"w2_a must be a 3-D tensor (E, r, I); got {getattr(w2_a, 'shape', type(w2_a).__name__)}")
        r = int(w2_a.shape[1])
        if not 1 <= r <= R:
            raise ValueError(f"LoRA rank r={r} must lie in [1, max_rank={R}]")
        want = [(f"w13_a[{s}]", t, (c.E, r, c.H)) for s, t in enumerate(w13_a)]
        want += [(f"w13_b[{s}]", t, (c.E, c.I, r)) for s, t in enumerate(w13_b)]
        want += [("w2_a", w2_a, (c.E, r, c.I)), ("w2_b", w2_b, (c.E, c.H, r))]
        for name, t, shape in want:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}; got {tuple(getattr(t, 'shape', ()))}")
            if t.dtype != c.dtype or t.device != self.device:
                raise TypeError(f"{name} must be {c.dtype} on {self.device} (cast and scaled); got {t.dtype} "
                                f"on {t.device}")
        return r

    # ------------------------------------------------------------------ mapping and metadata
    def set_mapping(self, mapping: torch.Tensor) -> None:
        """Each of the next batch's T tokens' slot, or -1 (no adapter): (T,) int32 on the layer's device."""
        self._need_lora("set_mapping")
        if not isinstance(mapping, torch.Tensor) or mapping.dim() != 1 or mapping.dtype != torch.int32:
            raise TypeError(f"mapping must be a 1-D int32 tensor (T,); got {getattr(mapping, 'dtype', type(mapping))} "
                            f"{tuple(getattr(mapping, 'shape', ()))}")
        T = int(mapping.shape[0])
        if T > self.max_tokens or mapping.device != self.device:
            raise ValueError(f"mapping must hold at most max_tokens={self.max_tokens} tokens on {self.device}; "
                             f"got {T} on {mapping.device}")
        if T and checks_enabled(self.device):
            lo, hi = torch.stack([mapping.min(), mapping.max()]).tolist()
            if lo < -1 or hi >= self.max_loras:
                raise ValueError(f"mapping must hold slots in [-1, max_loras={self.max_loras}); got [{lo}, {hi}]")
        self._write_mapping(mapping, T)
        self._num_tokens = T

    def _write_mapping(self, mapping: torch.Tensor, T: int) -> None:
        self._mapping[:T].copy_(mapping)

    def _pad_mapping(self, T: int, S: int) -> None:
        """Rows T..S-1 of a padded replay are padding: no adapter."""
        self._mapping[T:S].fill_(-1)

    def _update_metadata(self, T: int) -> None:
        """The LoRA metadata of this batch from the buffers' first T rows (device ops only: it is captured)."""
        m = self._mapping[:T]
        live = (m >= 0) & (self.adapter_enabled[m.clamp(min=0).long()] != 0)
        self._token_lora[:T].copy_(m.masked_fill(~live, -1))
        self.lora_ctx.token_lora_mapping = self._token_lora[:T]

    # ------------------------------------------------------------------ the per-batch function
    def _apply(self, T: int) -> None:
        """FusedMoEKernel over views of the static buffers' first T rows (output into _out[:T])."""
        self.kernel.apply(self._hidden[:T], self.w13, self.w2, self._topk_weights[:T], self._topk_ids[:T],
                          lora_ctx=self.lora_ctx, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                          output=self._out[:T])

    def _run(self, T: int) -> None:
        if self.lora_ctx is not None:
            self._update_metadata(T)
        self._apply(T)

    def _load_batch(self, hidden, topk_weights, topk_ids, what: str) -> int:
        """Check a batch and copy it into the static buffers; returns its T."""
        c = self.config
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != c.H \
                or hidden.dtype != c.dtype or hidden.device != self.device:
            raise ValueError(f"{what}: hidden_states must be (T, H={c.H}) {c.dtype} on {self.device}; got "
                             f"{getattr(hidden, 'dtype', type(hidden).__name__)} {tuple(getattr(hidden, 'shape', ()))}")
        T = int(hidden.shape[0])
        if T > self.max_tokens:
            raise ValueError(f"{what}: {T} tokens > max_tokens={self.max_tokens}")
        for name, t, ok in (("topk_weights", topk_weights, lambda t: t.is_floating_point()),
                            ("topk_ids", topk_ids, lambda t: t.dtype == torch.int32)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (T, c.top_k) or not ok(t) \
                    or t.device != self.device:
                raise ValueError(f"{what}: {name} must be ({T}, top_k={c.top_k}) on {self.device} "
                                 f"({'float' if name == 'topk_weights' else 'int32'}); got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        self._hidden[:T].copy_(hidden)
        self._topk_weights[:T].copy_(topk_weights)
        self._topk_ids[:T].copy_(topk_ids)
        return T

    def forward(self, hidden_states, topk_weights, topk_ids) -> torch.Tensor:
        """(T, H) output of one eager forward of the T tokens of the last mapping (LoRA on)."""
        T = int(hidden_states.shape[0]) if isinstance(hidden_states, torch.Tensor) else -1
        if self.lora_ctx is not None and T != self._num_tokens:
            raise ValueError(f"forward of {T} tokens, but the last set_mapping covered {self._num_tokens} "
                             f"(set the batch's mapping first)")
        T = self._load_batch(hidden_states, topk_weights, topk_ids, "forward")
        self._run(T)
        return self._out[:T].clone()

    # ------------------------------------------------------------------ graphs
    def _graph_body(self, size: int):
        """What a graph of `size` tokens runs: the whole per-batch function (metadata included)."""
        return lambda: self._run(size)

    def capture(self, size: int) -> None:
        """Record a forward of `size` tokens over the static buffers: a CUDA graph (after a warm-up on a side
        stream) on a GPU; on the CPU the per-batch function itself, re-run at each replay."""
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= self.max_tokens:
            raise ValueError(f"capture size must be an int in [1, max_tokens={self.max_tokens}]; got {size!r}")
        body = self._graph_body(size)
        if self.device.type != "cuda":
            self._graphs[size] = body
            return
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):          # compiles the kernels, creates the dual-stream schedule
                body()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        self._graphs[size] = graph.replay

    @property
    def captured_sizes(self) -> tuple:
        """The sizes a graph was captured at."""
        return tuple(sorted(self._graphs))

    def replay(self, hidden_states, topk_weights, topk_ids) -> torch.Tensor:
        """(S, H) output of the graph captured at S = the batch's size; the mapping covers its first T rows,
        the rest are padding (mapped to -1 here)."""
        S = int(hidden_states.shape[0]) if isinstance(hidden_states, torch.Tensor) else -1
        if S not in self._graphs:
            raise ValueError(f"replay of {S} tokens: no graph captured at that size (captured: "
                             f"{list(self.captured_sizes)})")
        if self.lora_ctx is not None:
            T = self._num_tokens
            if T is None or T > S:
                raise ValueError(f"replay of {S} tokens needs a mapping of at most {S} tokens first; got "
                                 f"{T if T is not None else 'none'}")
            self._pad_mapping(T, S)
        self._load_batch(hidden_states, topk_weights, topk_ids, "replay")
        self._graphs[S]()
        return self._out[:S].clone()
