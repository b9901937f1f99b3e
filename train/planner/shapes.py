"""GEMM shape analysis: tile quantization, wave quantization, tensor-core alignment, hidden-size advice.

A GPU computes the m x n output of a GEMM in tiles of tm x tn elements, one thread block per tile, and runs
the tiles on its streaming multiprocessors (SMs) in waves of one tile per SM. NVIDIA's "Matrix
Multiplication Background User's Guide" names the two ways a shape wastes that machine
(https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/index.html,
sections "Tile Quantization" and "Wave Quantization"):

- tile quantization: when m or n is not a multiple of the tile, the last row or column of tiles is partly
  padding that is computed and thrown away. tile efficiency = m * n / (padded m * padded n).
- wave quantization: when the tile count is not a multiple of the SM count, the last wave leaves SMs idle.
  wave efficiency = tiles / (ceil(tiles / SMs) * SMs), with `batch` independent GEMMs multiplying the tiles.

The same guide ("Requirements to Use Tensor Cores") asks for m, n and k to be multiples of 16 bytes (8
elements in fp16/bf16, 4 in TF32) for full-rate tensor-core kernels; a head dimension such as
14400 / 96 = 150 breaks it for the attention GEMMs. Misalignment is flagged, not folded into the
efficiency: its cost depends on the library version rather than on arithmetic.

Modelling assumptions (this is arithmetic, not a cuBLAS replay):
- candidate tiles are the guide's cuBLAS list, 256x128 and 128x256 down to 64x64;
- the library picks the largest tile whose tile x wave efficiency is within SMALLER_TILE_MARGIN of the best
  candidate: a smaller tile re-reads its operands more often per FLOP, so it only pays when it recovers
  more quantization loss than that;
- k does not quantize the output, so it only enters the alignment check;
- an unknown SM count (hw.num_sms None) gives wave efficiency 1.0, and the report says so.

Worked example behind the BLOOM notes' "nhidden = 864 * c" rule (seed 001): on an A100 (108 SMs) at TP=8,
hidden 13824 = 108 x 128 makes the attention projection and MLP-out GEMMs (n = 13824) exactly 108
columns of 128-wide tiles, so every row of tiles is one whole wave, while 13824 / 8 = 1728 = 27 x 64 keeps
the sharded QKV and MLP-in GEMMs tile-exact and whole-wave as well. 14400 fits neither, and its head
dimension 150 is misaligned; `shape_report` shows both.

Must not import torch (see train/__init__.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from conf.schema import HardwareConfig, ModelConfig, ParallelismConfig, Precision
from train.planner.flops import Gemm, layer_gemms, logits_gemm
from train.planner.sizes import total_params

TILE_SHAPES: tuple[tuple[int, int], ...] = (
    (256, 128),
    (128, 256),
    (128, 128),
    (256, 64),
    (64, 256),
    (128, 64),
    (64, 128),
    (64, 64),
)
"""cuBLAS tile shapes (tm, tn) from the NVIDIA guide, largest (most operand reuse) first."""

SMALLER_TILE_MARGIN = 0.02
"""Quantization efficiency a smaller tile must win back before the tile chooser prefers it (fraction)."""

ALIGN_BYTES = 16
"""Tensor cores want every GEMM dimension to be a multiple of 16 bytes of its element type."""

HIDDEN_MULTIPLE = 128
"""Hidden sizes the advisor proposes are multiples of the 128-wide tile."""

PER_RANK_MULTIPLE = 64
"""hidden / tp must be a multiple of this (128 preferred) in the advisor's suggestions."""

GEMM_WARN_LOSS = 0.01
"""A GEMM gets its own warning when its quantization loses this share of the model's FLOPs (fraction)."""

MAIN_GEMMS: tuple[str, ...] = ("qkv", "attn_proj", "mlp_in", "mlp_out")
"""The per-layer GEMMs that carry almost all of a layer's FLOPs (whole waves matter most here)."""

_EPS = 1e-9


def element_bytes(precision: Precision | str) -> int:
    """Bytes per GEMM operand element: 2 for fp16/bf16, 4 for fp32 (TF32 reads fp32 storage)."""
    return 4 if Precision(precision) == Precision.fp32 else 2


def alignment_elements(precision: Precision | str) -> int:
    """Multiple every GEMM dimension needs for full-rate tensor cores: 8 in fp16/bf16, 4 in fp32/TF32."""
    return ALIGN_BYTES // element_bytes(precision)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tile_efficiency(m: int, n: int, tile: tuple[int, int]) -> float:
    """Useful over computed output elements when an m x n output is covered by tm x tn tiles."""
    tm, tn = tile
    return (m * n) / (_ceil_div(m, tm) * tm * _ceil_div(n, tn) * tn)


def tile_count(m: int, n: int, tile: tuple[int, int], batch: int = 1) -> int:
    """Thread blocks launched: tiles per output times the batch of independent GEMMs."""
    tm, tn = tile
    return _ceil_div(m, tm) * _ceil_div(n, tn) * batch


def wave_efficiency(tiles: int, num_sms: int | None) -> float:
    """Busy over available SM slots when `tiles` run one per SM per wave; 1.0 when num_sms is unknown."""
    if num_sms is None:
        return 1.0
    if num_sms < 1 or tiles < 1:
        raise ValueError(f"need num_sms >= 1 and tiles >= 1, got num_sms={num_sms}, tiles={tiles}")
    return tiles / (_ceil_div(tiles, num_sms) * num_sms)


@dataclass(frozen=True)
class GemmEfficiency:
    """Quantization of one GEMM under the tile the chooser picked."""

    gemm: Gemm
    tile: tuple[int, int]
    """(tm, tn) tile along (m, n)."""
    tile_efficiency: float
    """m * n over the padded output the tiles cover (fraction)."""
    wave_efficiency: float
    """Tiles over SM slots in whole waves; 1.0 when the SM count is unknown (fraction)."""
    waves: float
    """Tiles / SMs (waves); nan when the SM count is unknown."""
    aligned: bool
    """m, n and k are all multiples of `alignment` (full-rate tensor cores)."""
    tiles: int = 0
    """Thread blocks launched, batch included."""
    alignment: int = 8
    """Element multiple the alignment check used (8 for fp16/bf16, 4 for fp32/TF32)."""

    @property
    def efficiency(self) -> float:
        """Tile x wave efficiency: the share of the launched tile work that is useful (fraction)."""
        return self.tile_efficiency * self.wave_efficiency

    @property
    def misaligned_dims(self) -> tuple[str, ...]:
        """Names of the dimensions ('m', 'n', 'k') that are not multiples of `alignment`."""
        g = self.gemm
        return tuple(name for name, d in (("m", g.m), ("n", g.n), ("k", g.k)) if d % self.alignment)


def _evaluate(gemm: Gemm, tile: tuple[int, int], num_sms: int | None, alignment: int) -> GemmEfficiency:
    tiles = tile_count(gemm.m, gemm.n, tile, gemm.batch)
    return GemmEfficiency(
        gemm=gemm,
        tile=tile,
        tile_efficiency=tile_efficiency(gemm.m, gemm.n, tile),
        wave_efficiency=wave_efficiency(tiles, num_sms),
        waves=tiles / num_sms if num_sms is not None else math.nan,
        aligned=all(d % alignment == 0 for d in (gemm.m, gemm.n, gemm.k)),
        tiles=tiles,
        alignment=alignment,
    )


def gemm_efficiency(
    gemm: Gemm,
    *,
    num_sms: int | None,
    tile: tuple[int, int] | None = None,
    alignment: int = 8,
    tiles: tuple[tuple[int, int], ...] = TILE_SHAPES,
) -> GemmEfficiency:
    """Tile and wave efficiency of `gemm` on `num_sms` SMs, under `tile` or the chooser's pick.

    The chooser takes the largest tile (by area, then the orientation that pads less) whose
    tile x wave efficiency is within SMALLER_TILE_MARGIN of the best candidate in `tiles`.
    """
    if min(gemm.m, gemm.n, gemm.k, gemm.batch) < 1:
        raise ValueError(f"GEMM {gemm.name} has a non-positive dimension: {gemm}")
    if tile is not None:
        return _evaluate(gemm, tile, num_sms, alignment)
    options = [_evaluate(gemm, t, num_sms, alignment) for t in tiles]
    best = max(o.efficiency for o in options)
    # Stable sort keeps the listed order among equal areas and equal efficiency.
    by_size = sorted(options, key=lambda o: (-o.tile[0] * o.tile[1], -o.efficiency))
    return next(o for o in by_size if o.efficiency >= best - SMALLER_TILE_MARGIN - _EPS)


@dataclass(frozen=True)
class HiddenSizeAdvice:
    """One hidden size (and head count) the advisor proposes, scored like the original."""

    hidden_size: int
    num_attention_heads: int
    params_delta_pct: float
    """Total parameters relative to the original model (percent; negative = smaller)."""
    efficiency: float
    """FLOPs-weighted tile x wave efficiency, as ShapeReport.efficiency (fraction)."""
    reasons: tuple[str, ...]
    """Which of the advisor's rules the size meets, in words."""

    @property
    def head_dim(self) -> int:
        """Elements per attention head."""
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ShapeReport:
    """Quantization of one layer's GEMMs (on one TP rank) plus the logits, for one micro-batch."""

    gemms: list[GemmEfficiency]
    efficiency: float
    """FLOPs-weighted tile x wave efficiency over the whole model (layers x num_layers, logits once)."""
    warnings: list[str]
    model: str = ""
    hardware: str = ""
    num_sms: int | None = None
    tp: int = 1
    micro_batch_size: int = 1
    precision: str = "bf16"
    repeats: list[int] = field(default_factory=list)
    """How often each GEMM of `gemms` runs per forward pass of the model (num_layers, or 1 for logits)."""
    advice: list[HiddenSizeAdvice] = field(default_factory=list)
    """The advisor's hidden sizes when a warning concerns the shapes, else empty."""


def _analyse(
    model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig
) -> tuple[list[GemmEfficiency], list[int], float]:
    """Per-GEMM efficiencies, their repeat counts, and the FLOPs-weighted overall efficiency."""
    alignment = alignment_elements(par.precision)
    gemms = layer_gemms(model, micro_batch_size=par.mbs, tp=par.tp)
    gemms.append(logits_gemm(model, micro_batch_size=par.mbs, tp=par.tp))
    # Weight by FLOPs over the whole model so the logits (once) are not counted like a layer GEMM.
    repeats = [1 if g.name == "logits" else model.num_layers for g in gemms]
    results = [_chosen_tile(g, hw.num_sms, alignment) for g in gemms]
    weights = [g.flops * r for g, r in zip(gemms, repeats, strict=True)]
    overall = sum(w * e.efficiency for w, e in zip(weights, results, strict=True)) / sum(weights)
    return results, repeats, overall


@functools.lru_cache(maxsize=1 << 14)
def _chosen_tile(gemm: Gemm, num_sms: int | None, alignment: int) -> GemmEfficiency:
    # The layouts of a sweep repeat a few hundred GEMM shapes; the chooser evaluates every tile of each.
    return gemm_efficiency(gemm, num_sms=num_sms, alignment=alignment)


def shape_efficiency(model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig) -> float:
    """ShapeReport.efficiency alone, without the warnings and the advisor (cheap enough for sweeps)."""
    return _analyse(model, par, hw)[2]


def shape_report(model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig) -> ShapeReport:
    """Tile/wave efficiency of every GEMM of a layer after TP sharding, plus the logits, with warnings.

    Warnings cover a hidden size off the 128 grid, a per-rank slice off the 64 grid, a head dimension (or
    any other dimension) off the tensor-core alignment, each GEMM whose quantization wastes GEMM_WARN_LOSS
    of the model's FLOPs or more, and an unknown SM count. When any of these concerns the shapes, the
    advisor runs: its suggestions are in `advice`, and each shape warning ends with the short form.
    Raises ValueError (from train.planner.flops) when tp does not split the heads or the MLP evenly.
    """
    results, repeats, overall = _analyse(model, par, hw)
    warnings, advice = _warnings(model, par, hw, results, repeats)
    return ShapeReport(
        gemms=results,
        efficiency=overall,
        warnings=warnings,
        model=model.name,
        hardware=hw.name,
        num_sms=hw.num_sms,
        tp=par.tp,
        micro_batch_size=par.mbs,
        precision=Precision(par.precision).value,
        repeats=repeats,
        advice=advice,
    )


_HEAD_DIM_GEMMS = ("attn_scores", "attn_values")


def _warnings(
    model: ModelConfig,
    par: ParallelismConfig,
    hw: HardwareConfig,
    results: list[GemmEfficiency],
    repeats: list[int],
) -> tuple[list[str], list[HiddenSizeAdvice]]:
    h, heads, tp = model.hidden_size, model.num_attention_heads, par.tp
    alignment = alignment_elements(par.precision)
    precision = Precision(par.precision).value
    head_dim, per_rank = h // heads, h // tp
    # (message, wants the hidden-size suggestion appended)
    found: list[tuple[str, bool]] = []
    if h % HIDDEN_MULTIPLE:
        found.append(
            (
                f"hidden_size={h} is not a multiple of {HIDDEN_MULTIPLE}: GEMMs with the hidden size as an output "
                f"dimension pad their last {HIDDEN_MULTIPLE}-wide tile column (tile quantization).",
                True,
            )
        )
    if per_rank % PER_RANK_MULTIPLE:
        found.append(
            (
                f"hidden_size/tp = {h}/{tp} = {per_rank} is not a multiple of {PER_RANK_MULTIPLE}: the sharded QKV "
                f"and MLP-in outputs and the projection inputs cannot be tiled exactly on any TP rank.",
                True,
            )
        )
    if head_dim % alignment:
        fixes = _head_counts(h, heads, tp, alignment)
        keep_h = (
            f" Keeping hidden_size={h}, {' or '.join(str(n) for n in fixes)} heads give head dim "
            f"{' or '.join(str(h // n) for n in fixes)}."
            if fixes
            else ""
        )
        found.append(
            (
                f"head dim {head_dim} (hidden_size {h} / {heads} heads) is not a multiple of {alignment}: the "
                f"attention score GEMM's k and the value GEMM's n break the {ALIGN_BYTES}-byte tensor-core alignment "
                f"for {precision}, so those GEMMs run on slower kernels.{keep_h}",
                True,
            )
        )
    # One warning for every misalignment the head dim does not already explain, not one per GEMM.
    misaligned = [
        r for r in results if not r.aligned and not (r.gemm.name in _HEAD_DIM_GEMMS and head_dim % alignment)
    ]
    if misaligned:
        listed = "; ".join(
            f"{r.gemm.name} " + " ".join(f"{d}={getattr(r.gemm, d)}" for d in r.misaligned_dims)
            for r in misaligned
        )
        tokens = any("m" in r.misaligned_dims and r.gemm.name not in _HEAD_DIM_GEMMS for r in misaligned)
        found.append(
            (
                f"GEMM dimensions off the {alignment}-element ({ALIGN_BYTES}-byte) tensor-core alignment for "
                f"{precision}: {listed}."
                + (f" m is micro_batch_size x seq_length = {results[0].gemm.m} tokens." if tokens else ""),
                # A hidden size cannot fix the token dimension m.
                any(r.gemm.name in MAIN_GEMMS and r.misaligned_dims != ("m",) for r in misaligned),
            )
        )
    total = sum(r.gemm.flops * n for r, n in zip(results, repeats, strict=True))
    for r, n in zip(results, repeats, strict=True):
        g = r.gemm
        loss = (1 - r.efficiency) * g.flops * n / total
        if loss >= GEMM_WARN_LOSS:
            found.append((f"{g.name} {_loss_description(r, loss)}{_gemm_hint(r, tp)}", g.name in MAIN_GEMMS))
    advice = advise_hidden_sizes(model, par, hw) if any(wants for _, wants in found) else []
    short = ""
    if advice:
        sizes = [f"{a.hidden_size} ({a.num_attention_heads} heads)" for a in advice]
        short = (
            f" Advisor: try hidden_size {', '.join(sizes[:-1])}{' or ' if len(sizes) > 1 else ''}{sizes[-1]}."
        )
    warnings = [message + (short if wants else "") for message, wants in found]
    if hw.num_sms is None:
        warnings.append(
            f"unknown SM count for hardware '{hw.name}' (num_sms is null): wave efficiency taken as 1.0, "
            "only tile quantization is reported."
        )
    return warnings, advice


def _loss_description(r: GemmEfficiency, loss: float) -> str:
    g = r.gemm
    tm, tn = r.tile
    causes = []
    if r.tile_efficiency < 1 - _EPS:
        causes.append(
            f"{tm}x{tn} tiles pad the output to {_ceil_div(g.m, tm) * tm}x{_ceil_div(g.n, tn) * tn} "
            f"(tile efficiency {r.tile_efficiency:.3f})"
        )
    if r.wave_efficiency < 1 - _EPS:
        causes.append(f"{r.tiles} tiles make {r.waves:.2f} waves (wave efficiency {r.wave_efficiency:.3f})")
    return (
        f"(m={g.m}, n={g.n}, k={g.k}, batch={g.batch}) reaches {r.efficiency:.3f} and wastes {100 * loss:.1f}% "
        f"of the model's FLOPs: {'; '.join(causes)}."
    )


def _gemm_hint(r: GemmEfficiency, tp: int) -> str:
    # What the user can change for this GEMM; the hidden-size advice itself is appended by the caller.
    if r.gemm.name == "logits" and r.gemm.n % r.tile[1]:
        return " A larger make_vocab_size_divisible_by changes the padded vocabulary."
    if r.gemm.name in _HEAD_DIM_GEMMS:
        return " The head count sets these shapes (hidden_size / num_attention_heads)."
    if not math.isnan(r.waves) and r.waves < 1:
        fix = "a larger micro_batch_size or a smaller tp" if tp > 1 else "a larger micro_batch_size"
        return f" Too few tiles to fill the GPU: {fix} helps."
    return ""


def _head_counts(h: int, heads: int, tp: int, alignment: int, count: int = 2) -> list[int]:
    """Head counts nearest to `heads` that divide h, split evenly over tp, and give an aligned head dim."""
    valid = [n for n in range(tp, h // alignment + 1, tp) if h % n == 0 and (h // n) % alignment == 0]
    # Nearest by ratio: halving the heads is as far as doubling them (10 -> 5 or 25, not 1).
    return sorted(sorted(valid, key=lambda n: (abs(math.log(n / heads)), n))[:count])


def advise_hidden_sizes(
    model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, *, count: int = 4, window: float = 0.25
) -> list[HiddenSizeAdvice]:
    """The nearest hidden sizes on both sides of model.hidden_size that suit the GEMMs, nearest first.

    Rules: hidden % 128 == 0; hidden / tp a multiple of 64 (of the alignment where no size within
    `window`, a fraction of the hidden size, reaches 64 on that side); a head count that splits evenly
    over tp with a head dim that is a multiple of the tensor-core alignment (the original count when it
    qualifies, else the nearest that does). Each side lists its nearest qualifying size, then a further
    one only when it is more efficient (FLOPs-weighted tile x wave efficiency, so whole waves on
    hw.num_sms count) than every nearer one on that side, or as efficient with hidden / tp a multiple of
    128: a size further away has to buy something. When the model itself meets the rules, a suggestion
    must also beat its efficiency, so a well-shaped model gets few or none. At most `count` are returned,
    the sides alternating.

    Why 64 and not 128 per rank: on an A100 at TP=8, 13824 / 8 = 1728 = 27 x 64 is tile-exact with
    64-wide tiles and fills whole waves, and beats 14336 (1792 = 14 x 128), as the BLOOM runs measured.
    """
    h0, tp = model.hidden_size, par.tp
    alignment = alignment_elements(par.precision)
    base_params = total_params(model, tp)
    low = max(HIDDEN_MULTIPLE, math.floor(h0 * (1 - window) / HIDDEN_MULTIPLE) * HIDDEN_MULTIPLE)
    high = math.ceil(h0 * (1 + window) / HIDDEN_MULTIPLE) * HIDDEN_MULTIPLE
    start_below = (h0 - 1) // HIDDEN_MULTIPLE * HIDDEN_MULTIPLE
    start_above = (h0 // HIDDEN_MULTIPLE + 1) * HIDDEN_MULTIPLE
    sides = [range(start_below, low - 1, -HIDDEN_MULTIPLE), range(start_above, high + 1, HIDDEN_MULTIPLE)]
    # A model that already follows the rules sets the bar; one that breaks them is beaten by any valid size.
    floor, floor_128 = -1.0, False
    if _follows_rules(model, tp, alignment):
        floor, floor_128 = _analyse(model, par, hw)[2], (h0 // tp) % 128 == 0
    fronts: list[list[HiddenSizeAdvice]] = []
    for sizes in sides:
        front: list[HiddenSizeAdvice] = []
        best, has_128 = floor, floor_128
        for h in _per_rank_filter(list(sizes), tp, alignment):
            advice = _score(model, par, hw, h, alignment, base_params)
            if advice is None:
                continue
            is_128 = (h // tp) % 128 == 0
            if advice.efficiency > best + _EPS or (
                advice.efficiency > best - _EPS and is_128 and not has_128
            ):
                front.append(advice)
                best, has_128 = max(best, advice.efficiency), has_128 or is_128
        fronts.append(front)
    merged: list[HiddenSizeAdvice] = []
    for i in range(max(len(f) for f in fronts)):
        merged.extend(f[i] for f in fronts if i < len(f))
    return sorted(merged[: max(count, 0)], key=lambda a: (abs(a.hidden_size - h0), a.hidden_size))


def _follows_rules(model: ModelConfig, tp: int, alignment: int) -> bool:
    h, heads = model.hidden_size, model.num_attention_heads
    return (
        h % HIDDEN_MULTIPLE == 0
        and h % tp == 0
        and (h // tp) % PER_RANK_MULTIPLE == 0
        and heads % tp == 0
        and h % heads == 0
        and (h // heads) % alignment == 0
        and model.ffn % tp == 0
    )


def _per_rank_filter(sizes: list[int], tp: int, alignment: int) -> list[int]:
    # The coarsest per-rank multiple that some size on this side reaches; nearest-first order kept.
    for multiple in (PER_RANK_MULTIPLE, alignment):
        ok = [h for h in sizes if h % tp == 0 and (h // tp) % multiple == 0]
        if ok:
            return ok
    return []


def _score(
    model: ModelConfig,
    par: ParallelismConfig,
    hw: HardwareConfig,
    h: int,
    alignment: int,
    base_params: int,
) -> HiddenSizeAdvice | None:
    heads0, tp = model.num_attention_heads, par.tp
    keeps_heads = h % heads0 == 0 and (h // heads0) % alignment == 0 and heads0 % tp == 0
    heads_options = [heads0] if keeps_heads else _head_counts(h, heads0, tp, alignment, count=1)
    if not heads_options:
        return None
    heads = heads_options[0]
    ffn = model.ffn_hidden_size
    if ffn is not None:
        # Keep the MLP ratio, on the per-rank grid the hidden size is held to.
        grid = PER_RANK_MULTIPLE * tp
        ffn = max(grid, round(ffn * h / model.hidden_size / grid) * grid)
    candidate = replace(model, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn)
    results, _, overall = _analyse(candidate, par, hw)
    per_rank = h // tp
    if per_rank % 128 == 0:
        split = f"{per_rank // 128} x 128"
    elif per_rank % 64 == 0:
        split = f"{per_rank // 64} x 64"
    else:
        split = f"{per_rank // alignment} x {alignment} (no multiple of 64 within reach)"
    reasons = [
        f"{h} = {h // HIDDEN_MULTIPLE} x {HIDDEN_MULTIPLE}",
        f"hidden/tp = {h}/{tp} = {split}",
        (f"keeps {heads} heads" if keeps_heads else f"{heads} heads instead of {heads0}")
        + f", head dim {h // heads} = {h // heads // alignment} x {alignment}",
    ]
    if hw.num_sms is not None:
        main = [r for r in results if r.gemm.name in MAIN_GEMMS]
        whole = [r.gemm.name for r in main if r.wave_efficiency >= 1 - _EPS]
        if len(whole) == len(main):
            reasons.append(f"all of {', '.join(whole)} in whole waves on {hw.num_sms} SMs")
        elif whole:
            reasons.append(f"whole waves on {hw.num_sms} SMs for {', '.join(whole)}")
    new_params = total_params(candidate, tp)
    return HiddenSizeAdvice(
        hidden_size=h,
        num_attention_heads=heads,
        params_delta_pct=100.0 * (new_params - base_params) / base_params,
        efficiency=overall,
        reasons=tuple(reasons),
    )


def format_shape_report(report: ShapeReport) -> str:
    """A fixed-width table of the report's GEMMs, its overall efficiency, then its warnings."""
    sms = "unknown SM count" if report.num_sms is None else f"{report.num_sms} SMs"
    lines = [
        f"GEMM shapes: model={report.model or '?'} hardware={report.hardware or '?'} ({sms}) "
        f"tp={report.tp} micro_batch_size={report.micro_batch_size} precision={report.precision}",
    ]
    total = (
        sum(r.gemm.flops * n for r, n in zip(report.gemms, report.repeats, strict=True))
        if report.repeats
        else 0
    )
    header = (
        f"{'GEMM':<12} {'batch':>5} {'m':>7} {'n':>7} {'k':>7} {'tile':>8} {'tile eff':>8} "
        f"{'waves':>8} {'wave eff':>8} {'eff':>6} {'aligned':>7} {'FLOPs':>6}"
    )
    lines += [header, "-" * len(header)]
    for i, r in enumerate(report.gemms):
        g = r.gemm
        waves = "?" if math.isnan(r.waves) else f"{r.waves:.2f}"
        share = f"{100 * g.flops * report.repeats[i] / total:5.1f}%" if total else f"{'':>6}"
        lines.append(
            f"{g.name:<12} {g.batch:>5} {g.m:>7} {g.n:>7} {g.k:>7} {f'{r.tile[0]}x{r.tile[1]}':>8} "
            f"{r.tile_efficiency:>8.3f} {waves:>8} {r.wave_efficiency:>8.3f} {r.efficiency:>6.3f} "
            f"{'yes' if r.aligned else 'NO':>7} {share}"
        )
    lines.append("-" * len(header))
    lines.append(f"FLOPs-weighted tile x wave efficiency: {report.efficiency:.3f}")
    if report.warnings:
        lines.append("Warnings:")
        lines += [f"- {w}" for w in report.warnings]
    else:
        lines.append("No warnings.")
    if report.advice:
        lines.append("Suggested hidden sizes:")
        lines += [f"  {format_advice(a)}" for a in report.advice]
    return "\n".join(lines)


def format_advice(advice: HiddenSizeAdvice) -> str:
    """One suggestion on one line: size, heads, parameter change, efficiency, and the rules it meets."""
    return (
        f"hidden_size={advice.hidden_size} heads={advice.num_attention_heads} (head dim {advice.head_dim}) "
        f"params {advice.params_delta_pct:+.1f}% efficiency {advice.efficiency:.3f}: {'; '.join(advice.reasons)}"
    )
