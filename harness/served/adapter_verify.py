"""`adapter verify`: the harness's reading of PEFT adapter files (harness.served.peft_adapters + pack_moe_lora +
reference.experts) against PEFT's own float64 forward of the same files on the model's MoE blocks.

Per adapter and MoE layer: each adapted parameter's delta weight (PEFT's get_delta_weight against ours), then the
experts' output for a batch whose tokens map to every adapter's slot and to none (-1), PEFT's forward with the
adapter (and disabled) against `moe_experts_forward` with all adapters packed in float64. The bound (float64
rounding of both computations) and what is compared: docs/adapters.md.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from moe_lora_harness.harness.served.hf_moe_block import MoEModel, build_moe_model, fresh_copy, hf, hf_session, model_config
from moe_lora_harness.harness.served.peft_adapters import (
    READINGS, W2_PARAM, W13_PARAM, AdapterFileError, factor_keys, other_keys, read_adapter_layers, read_folder,
)
from moe_lora_harness.reference.adapters import ExpertAdapter, pack_moe_lora
from moe_lora_harness.reference.experts import LoRAInputs, moe_experts_forward
from moe_lora_harness.reference.precision import precision as make_precision
from moe_lora_harness.reference.routing import fused_topk, grouped_topk

__all__ = ["Line", "Report", "verify", "forward_bound_depth"]

U64 = 2.0 ** -53          # float64 unit roundoff
ACTIVATION_OPS = 16       # roundings inside an activation and the bias / router-weight steps, counted generously
_EXACT = make_precision("exact", None)


@dataclass
class Line:
    """One checked tensor or forward: what, its relative error (2-norm), the worst element against its bound."""

    label: str
    rel: float = 0.0
    worst: float = 0.0          # max |ours - PEFT| / bound over the elements (<= 1 passes)
    ok: bool = True
    note: str = ""
    informative: bool = False   # a note that neither passes nor fails

    def text(self) -> str:
        if self.informative:
            return f"  note  {self.label}: {self.note}"
        head = f"  {'ok  ' if self.ok else 'FAIL'}  {self.label}"
        nums = f": rel err {self.rel:.2e}, worst {self.worst:.2g}x bound" if self.rel == self.rel else ""
        return head + nums + (f"; {self.note}" if self.note else "")


@dataclass
class Report:
    """Every line of a verification, grouped under headers; `ok` when every non-informative line passed."""

    lines: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(x.ok for x in self.lines if isinstance(x, Line))

    def add(self, item) -> None:
        self.lines.append(item)

    def text(self) -> str:
        return "\n".join(x.text() if isinstance(x, Line) else x for x in self.lines)


def forward_bound_depth(H: int, I: int, R: int, top_k: int) -> int:
    """K of the forward's bound 2 K u scale: the accumulation depth of the longest path through the experts (the
    H- and I-long GEMMs, four rank-R LoRA products (PEFT merges s B A into the weight first), the top-k sum)
    plus the roundings of the activation and the bias / router-weight steps."""
    return H + I + 4 * R + top_k + ACTIVATION_OPS


def _compare(ours: torch.Tensor, truth: torch.Tensor, bound: torch.Tensor) -> tuple[float, float]:
    """(||ours - truth|| / ||truth||, max |ours - truth| / bound)."""
    if truth.numel() == 0:
        return 0.0, 0.0
    d = (ours - truth).abs()
    n = float(torch.linalg.vector_norm(truth))
    rel = float(torch.linalg.vector_norm(d)) / n if n > 0 else (0.0 if float(d.max()) == 0 else math.inf)
    worst = float((d / bound.clamp_min(torch.finfo(torch.float64).tiny)).max())
    return rel, worst


# ----------------------------------------------------------------------------- per-parameter delta weights


def param_delta(ad: ExpertAdapter, param: str, *, interleaved: bool, transposed: bool, absolute: bool = False):
    """The delta weight an adapter adds to a fused expert parameter, in that parameter's own layout (E, out, in),
    or (E, in, out) when the model stores it transposed (GPT-OSS). `absolute`: |s| |B| |A| (the bound's scale)."""
    f = torch.abs if absolute else (lambda t: t)

    def prod(b, a, s):
        return (abs(s) if absolute else s) * torch.bmm(f(b), f(a))

    if param == W2_PARAM:
        d = prod(ad.down_b, ad.down_a, ad.w2_scaling)
    elif ad.gated:
        g, u = prod(ad.gate_b, ad.gate_a, ad.scaling), prod(ad.up_b, ad.up_a, ad.scaling)
        if interleaved:
            d = torch.empty(g.shape[0], 2 * g.shape[1], g.shape[2], dtype=g.dtype)
            d[:, 0::2], d[:, 1::2] = g, u
        else:
            d = torch.cat([g, u], dim=1)
    else:
        d = prod(ad.gate_b, ad.gate_a, ad.scaling)
    return d.transpose(1, 2) if transposed else d


def _wrappers(experts) -> tuple[dict, torch.nn.Module]:
    """({parameter name: PEFT ParamWrapper}, the experts module under them)."""
    out, mod = {}, experts
    while hasattr(mod, "parameter_name") and hasattr(mod, "base_layer"):
        out[mod.parameter_name] = mod
        mod = mod.base_layer
    return out, mod


def _check_registration(experts, gated: bool, interleaved: bool) -> None:
    """The reader's rules hold for this experts class: the w13 parameter is registered before down_proj (the
    nesting), and its gate/up rows interleave exactly when the config's activation says so."""
    names = [n for n, p in experts.named_parameters(recurse=False) if p.dim() == 3]
    want = [W13_PARAM[gated], W2_PARAM]
    if [n for n in names if n in want] != want:
        raise AdapterFileError(f"{type(experts).__name__} registers its expert parameters as {names}; the adapter "
                               f"reader's nesting rule needs {want} in that order")
    if gated and bool(getattr(experts, "is_concatenated", True)) == interleaved:
        raise AdapterFileError(f"{type(experts).__name__} has is_concatenated={experts.is_concatenated} but the "
                               f"config's activation is {'' if interleaved else 'not '}interleaved")


# ----------------------------------------------------------------------------- forward with hooks


@dataclass
class _Run:
    """One forward of a block: the experts' inputs (hidden, ids, fp32-rounded weights) and output, the shared
    expert's output (if any) and the router's logits."""

    hidden: torch.Tensor = None
    ids: torch.Tensor = None
    weights: torch.Tensor = None
    out: torch.Tensor = None
    shared: torch.Tensor = None
    logits: torch.Tensor = None


def _router(block, experts_name: str):
    """The block's router: the child that is neither the experts nor a shared expert and owns an (E, H) weight."""
    for name, child in block.named_children():
        if name != experts_name and "shared" not in name and getattr(child, "weight", None) is not None:
            return child
    return None


def _shared(block):
    for name in ("shared_experts", "shared_expert"):
        if hasattr(block, name):
            return getattr(block, name)
    return None


def _forward(block, x: torch.Tensor) -> _Run:
    """Run `block` on x (1, T, H), capturing what its experts see: the router's top-k weights are rounded to fp32
    and handed to the experts in float64 (vLLM's experts read fp32 weights; the reference does too)."""
    run = _Run()
    experts = block.experts

    def pre(mod, args):
        hidden, ids, w = args[0], args[1], args[2]
        w = w.to(torch.float32).to(torch.float64)
        run.hidden, run.ids, run.weights = hidden.detach().clone(), ids.detach().clone(), w.detach().clone()
        return (hidden, ids, w) + tuple(args[3:])

    hooks = [experts.register_forward_pre_hook(pre),
             experts.register_forward_hook(lambda m, a, o: setattr(run, "out", o.detach().clone()))]
    shared, router = _shared(block), _router(block, "experts")
    if shared is not None:
        hooks.append(shared.register_forward_hook(lambda m, a, o: setattr(run, "shared", o.detach().clone())))
    if router is not None:
        hooks.append(router.register_forward_hook(
            lambda m, a, o: setattr(run, "logits", (o[0] if isinstance(o, tuple) else o).detach().clone())))
    try:
        with torch.no_grad():
            block(x)
    finally:
        for h in hooks:
            h.remove()
    return run


# ----------------------------------------------------------------------------- the verification


@dataclass
class _Adapter:
    """One adapter under test: its folder, the folder PEFT loads as the truth, our reading, PEFT's model."""

    index: int                  # its position on the command line: the [i] of its lines
    path: str
    truth: str
    ours: dict = None           # layer -> ExpertAdapter
    peft: object = None
    error: str = ""
    load_notes: list = field(default_factory=list)


def _load_peft(peft_mod, m: MoEModel, folder: str) -> tuple[object, list]:
    """PeftModel.from_pretrained of `folder` on a fresh skeleton, float64; the warnings it gave about the checked
    layers (keys of other layers are absent from the skeleton by design)."""
    checked = [f"{p}." for p in m.blocks.values()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft_mod.PeftModel.from_pretrained(fresh_copy(m), folder)
    model.eval()
    notes = []
    for w in caught:
        msg = str(w.message)
        if "missing" in msg.lower() and any(c in msg for c in checked):
            notes.append(msg[:300])
    return model, notes


def _routing_note(m: MoEModel, n: int, run: _Run) -> str:
    """Whether the reference's router (reference.routing) picks the experts the model's router picked."""
    L = m.layer
    if run.logits is None:
        return "the model's router was not found; the experts are compared with the top-k it handed them"
    logits = run.logits.reshape(-1, run.logits.shape[-1])
    if L.n_group > 1 or L.correction_bias:
        gate = _router(m.block(m.skeleton, n), "experts")
        bias = getattr(gate, "e_score_correction_bias", None) if L.correction_bias else None
        w, ids = grouped_topk(logits, L.top_k, L.renormalize, L.n_group, L.topk_group, L.scoring,
                              L.routed_scaling_factor, bias)
        how = f"grouped_topk({L.routing_text()})"
    else:
        w, ids = fused_topk(logits, L.top_k, L.renormalize, L.scoring, L.routed_scaling_factor)
        how = f"fused_topk({L.routing_text()})"
    same = (ids.sort(dim=1).values.long() == run.ids.sort(dim=1).values.long()).all(dim=1)
    return (f"experts compared with the router's own top-k ids and fp32 weights; the reference's {how} picks the "
            f"same experts for {int(same.sum())}/{same.numel()} tokens")


NO_AGAINST = ("without --against, PEFT's truth is read from the same file as ours: a layout mistake inside a file "
              "(e.g. B written expert-major) cannot show; give the checkpoint a file was converted from with --against")


def base_model_note(adapter_config: dict, model_type: str) -> str:
    """'' when the adapter's record of its base model (PEFT's `auto_mapping`) is of the model config's family (or
    absent); else a warning naming both: the adapter is then verified on a model it was not trained for."""
    mapping = adapter_config.get("auto_mapping") or {}
    library = str(mapping.get("parent_library") or "") if isinstance(mapping, dict) else ""
    parts = library.split(".")
    family = parts[2] if len(parts) > 2 and parts[:2] == ["transformers", "models"] else ""
    if not family or family == model_type:
        return ""
    return (f"WARNING: its adapter_config.json names {mapping.get('base_model_class') or family} ({family}), but "
            f"--model-config is a {model_type} model: verified on the latter, not the model it was made for")


def verify(dirs, config, *, layers: int = 1, against=None, tokens: int = 16, seed: int = 0,
           readings: dict | None = None) -> Report:
    """Verify each adapter folder of `dirs` on the model of config.json `config`, its first `layers` adapted MoE
    layers.

    PEFT's truth is each folder itself, or the folder of `against` at the same position (the checkpoint a file was
    converted from: a layout mistake in the file shows only against that). `readings` (tensor key -> a READINGS
    name) makes our reading take a key's data as laid out so (a planted reader mistake)."""
    dirs = [str(d) for d in dirs]
    own_truth = not against
    against = [str(a) for a in against] if against else list(dirs)
    if not dirs:
        raise ValueError("dirs must name at least one adapter folder")
    if len(against) != len(dirs):
        raise ValueError(f"against must name one folder per adapter ({len(dirs)}), got {len(against)}")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be an int >= 1, got {layers!r}")
    _, peft_mod = hf()
    _, layer = model_config(config)
    report = Report()
    report.add(f"model: {layer.model_type} H={layer.H} I={layer.I} E={layer.E} top_k={layer.top_k} "
               f"{layer.activation}{' +bias' if layer.bias else ''}, routing {layer.routing_text()}")
    if own_truth:
        report.add(Line("layout", informative=True, note=NO_AGAINST))
    ads = [_Adapter(i, d, t) for i, (d, t) in enumerate(zip(dirs, against))]
    sizes = dict(num_experts=layer.E, hidden_size=layer.H, intermediate_size=layer.I, gated=layer.gated,
                 interleaved=layer.interleaved, dtype=torch.float64)
    for i, ad in enumerate(ads):
        try:
            folder = read_folder(ad.path)
            ad.ours = read_adapter_layers(ad.path, readings=readings, folder=folder, **sizes)
        except AdapterFileError as e:
            ad.error = str(e)
            report.add(Line(f"[{i}] read {ad.path}", float("nan"), ok=False, note=str(e)))
            continue
        warning = base_model_note(folder.config, layer.model_type)
        if warning:
            report.add(Line(f"[{i}] {ad.path}", informative=True, note=warning))
        rest = other_keys(folder)
        if rest:
            report.add(Line(f"[{i}] {ad.path}", informative=True,
                            note=f"{len(rest)} tensor(s) outside the routed experts are not verified (e.g. {rest[0]})"))
    readable = [a for a in ads if not a.error]
    chosen = sorted(set().union(*(a.ours for a in readable)))[:layers] if readable else []
    if not chosen:
        return report
    with hf_session():
        m = build_moe_model(config, chosen, seed=seed)
        for ad in readable:
            try:
                ad.peft, ad.load_notes = _load_peft(peft_mod, m, ad.truth)
            except Exception as e:  # noqa: BLE001 - PEFT's refusal of the file is the finding, reported as such
                ad.error = f"PEFT cannot load {ad.truth}: {type(e).__name__}: {str(e)[:400]}"
                report.add(Line(f"load {ad.truth} with PEFT", float("nan"), ok=False, note=ad.error))
        live = [a for a in readable if not a.error]
        for n in chosen:
            _verify_layer(report, m, n, live, tokens, seed, readings, sizes)
    return report


def _verify_layer(report: Report, m: MoEModel, n: int, ads: list, tokens: int, seed: int, readings, sizes) -> None:
    L = m.layer
    report.add(f"layer {n} ({m.blocks[n]}):")
    g = torch.Generator().manual_seed(seed * 7919 + n)
    x = torch.randn(1, tokens, L.H, generator=g, dtype=torch.float64)
    runs_on, runs_off = [], []
    for ad in ads:
        i = ad.index
        block = m.block(ad.peft, n)
        wrappers, experts = _wrappers(block.experts)
        _check_registration(experts, L.gated, L.interleaved)
        transposed = bool(getattr(experts, "is_transposed", False))
        for line in ad.load_notes:
            report.add(Line(f"[{i}] {ad.truth}: PEFT load", float("nan"), ok=False, note=line))
        ours = ad.ours.get(n)
        for param, wrapper in reversed(wrappers.items()):      # registration order: the innermost first
            report.add(_param_line(i, ad, n, param, wrapper, ours, transposed, readings, sizes))
        runs_on.append(_forward(block, x))
        with ad.peft.disable_adapter():
            runs_off.append(_forward(block, x))
    if not ads:
        return
    base = runs_off[0]
    for r in runs_on + runs_off:
        if not torch.equal(r.ids, base.ids):
            report.add(Line("routing", float("nan"), ok=False, note="the router picked different experts across runs"))
            return
    report.add(Line("routing", informative=True, note=_routing_note(m, n, base)))
    _forward_lines(report, m, n, ads, runs_on, runs_off)


def _param_line(i, ad, n, param, wrapper, ours, transposed, readings, sizes) -> Line:
    """PEFT's delta weight of one adapted parameter against ours; on a mismatch, the reading of a factor that
    would fit (a mis-laid-out file, or reader)."""
    keys = _factor_keys(ad, n, param)
    saved = ", ".join(k.rpartition(".experts")[2].lstrip(".") for k in keys) or "per-expert keys, converted by PEFT"
    label = f"[{i}] {param} delta weight ({saved})"
    with torch.no_grad():
        truth = wrapper.get_delta_weight("default").detach().to(torch.float64)
    if ours is None:
        return Line(label, float("nan"), ok=False, note=f"PEFT adapts layer {n} but our reading has no factors there")
    interleaved = sizes["interleaved"]
    d = param_delta(ours, param, interleaved=interleaved, transposed=transposed)
    if d.shape != truth.shape:
        return Line(label, float("nan"), ok=False, note=f"delta shape {tuple(d.shape)} != PEFT's {tuple(truth.shape)}")
    r = int(wrapper.r["default"])
    bound = 2 * (r + 2) * U64 * param_delta(ours, param, interleaved=interleaved, transposed=transposed, absolute=True)
    rel, worst = _compare(d, truth, bound)
    line = Line(label, rel, worst, worst <= 1.0)
    if not line.ok:
        line.note = _diagnose(ad, n, param, keys, truth, transposed, readings, sizes)
    return line


def _factor_keys(ad: _Adapter, n: int, param: str) -> list:
    """The saved keys (A, B) of `param`'s factors in layer n (empty for a per-expert file)."""
    ours = ad.ours.get(n)
    keys = factor_keys(read_folder(ad.path), n, ours.gated) if ours is not None else {}
    return list(keys.get(param, {}).values())


def _diagnose(ad: _Adapter, n: int, param: str, keys: list, truth, transposed, readings, sizes) -> str:
    """Try every other layout of each factor of `param` alone (PEFT's own included, when the key was read in
    another); name the one whose reading reproduces PEFT's delta weight."""
    folder = read_folder(ad.path)
    fits = []
    for key in keys:
        current = (readings or {}).get(key, "peft")
        for name, rd in READINGS.items():
            if name == current:
                continue
            trial = {**(readings or {}), key: name}
            try:
                alt = read_adapter_layers(ad.path, readings=trial, folder=folder, **sizes)[n]
            except (ValueError, AdapterFileError):
                continue                       # this reading does not apply to the key
            d = param_delta(alt, param, interleaved=sizes["interleaved"], transposed=transposed)
            bound = 2 * (alt.rank + 2) * U64 * param_delta(alt, param, interleaved=sizes["interleaved"],
                                                            transposed=transposed, absolute=True)
            if d.shape == truth.shape and _compare(d, truth, bound)[1] <= 1.0:
                fits.append(f"{key}: the data matches {rd.describes} (reading {name!r}); it was read as {current!r}")
    return "; ".join(fits) if fits else "no other layout of a single factor reproduces PEFT's delta weight"


def _forward_lines(report: Report, m: MoEModel, n: int, ads: list, runs_on: list, runs_off: list) -> None:
    """The experts' output of a mixed batch (S adapters: token t -> slot t mod (S+1), residue S -> -1) against PEFT's
    per-adapter forwards; the disabled forward against the reference without LoRA; the shared expert untouched."""
    L = m.layer
    base = runs_off[0]
    experts = _wrappers(m.block(ads[0].peft, n).experts)[1]
    w13, w2, b13, b2 = _base_weights(experts, L)
    T = base.hidden.shape[0]
    S = len(ads)
    mapping = torch.tensor([(t % (S + 1)) if t % (S + 1) < S else -1 for t in range(T)], dtype=torch.int32)
    adapters = [a.ours.get(n) for a in ads]
    R = max((a.rank for a in adapters if a is not None), default=1)
    stacked = pack_moe_lora(adapters, max_loras=S, max_rank=R, num_experts=L.E, hidden_size=L.H,
                            intermediate_size=L.I, dtype=torch.float64, gated=L.gated)
    args = (base.hidden, w13, w2, base.weights, base.ids.to(torch.int32))
    kw = dict(activation=L.activation, precision=_EXACT, w13_bias=b13, w2_bias=b2)
    ref = moe_experts_forward(*args, lora=LoRAInputs(stacked, mapping), **kw)
    ref_off = moe_experts_forward(*args, **kw)
    K = forward_bound_depth(L.H, L.I, R, L.top_k)
    bound, bound_off = 2 * K * U64 * ref.scale, 2 * K * U64 * ref_off.scale
    for slot, (ad, on, off) in enumerate(zip(ads, runs_on, runs_off)):
        rows, i = mapping == slot, ad.index
        if adapters[slot] is None:
            report.add(Line(f"[{i}] {ad.path}", informative=True, note=f"does not adapt layer {n}"))
            continue
        effect = float(torch.linalg.vector_norm(on.out - off.out)) / max(float(torch.linalg.vector_norm(off.out)),
                                                                          1e-300)
        rel, worst = _compare(ref.value[rows], on.out[rows], bound[rows])
        src = ad.path if ad.truth == ad.path else f"{ad.path} against PEFT's {ad.truth}"
        line = Line(f"[{i}] experts forward, {int(rows.sum())} tokens in slot {slot} ({src})", rel, worst,
                    worst <= 1.0, f"the adapter moves the output by {effect:.2g} relative")
        if effect < 1e-6:
            line.ok, line.note = False, "the adapter changes nothing here (B all zero?): its layout cannot be checked"
        report.add(line)
    rows = mapping < 0
    rel, worst = _compare(ref.value[rows], base.out[rows], bound[rows])
    report.add(Line(f"experts forward, {int(rows.sum())} tokens without an adapter (-1)", rel, worst, worst <= 1.0))
    rel, worst = _compare(ref_off.value, base.out, bound_off)
    report.add(Line(f"experts forward, PEFT adapter disabled ({T} tokens)", rel, worst, worst <= 1.0))
    if base.shared is not None:
        same = all(torch.equal(r.shared, base.shared) for r in runs_on)
        report.add(Line("shared expert: not adapted (the routed experts' LoRA only)", float("nan"), ok=same,
                        note="bit-identical with and without the adapter" if same else
                        "its output changes with the adapter: the file adapts the shared expert, which the "
                        "harness's routed-expert LoRA does not cover"))


def _base_weights(experts, L) -> tuple:
    """(w13 (E, N1, H), w2 (E, H, I), w13 bias, w2 bias) in the reference's layout from the experts' parameters."""
    transposed = bool(getattr(experts, "is_transposed", False))
    w13 = getattr(experts, W13_PARAM[L.gated]).detach()
    w2 = getattr(experts, W2_PARAM).detach()
    if transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    b13 = getattr(experts, f"{W13_PARAM[L.gated]}_bias", None)
    b2 = getattr(experts, f"{W2_PARAM}_bias", None)
    return (w13.contiguous(), w2.contiguous(), None if b13 is None else b13.detach(),
            None if b2 is None else b2.detach())
