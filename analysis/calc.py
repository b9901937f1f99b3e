"""`python -m analysis.calc`: TFLOPs per device, aggregate PFLOPs, MFU and HFU of a measured iteration.

    python -m analysis.calc model=gpt_1.3b hardware=a100_80gb parallelism.tp=2 sec_per_iter=1.9 devices=16
    python -m analysis.calc model=bloom_181b_l72_h14336 hardware=a100_80gb parallelism.tp=8 \\
        parallelism.pp=6 parallelism.global_batch_size=2048 parallelism.recompute=full \\
        sec_per_iter=114.11 devices=384 convention=megatron_eq3

The model, parallelism and hardware come from the same Hydra config (and override syntax) as
`python -m train`; the calculator's own keys are sec_per_iter=<seconds> (required),
devices=<count> (required), convention=gemm|megatron_eq3|mpt (default gemm),
output=text|json (default text), and predict=true|false (default false): the time model's seconds
per iteration and where they go (train.planner.perf), for the software stack=megasweep|deepspeed|
megatron_deepspeed (default: the one `python -m train` runs); with predict=true, sec_per_iter may be
left out and the figures are then those of the predicted time, labelled predicted (JSON:
sec_per_iter_source "predicted" and a note). A predicted layout must pass the
planner's rules, as in the dry run (micro_batch_size=auto resolved as the planner resolves it), and
the layout predicted is printed. One iteration is one optimizer step over
parallelism.global_batch_size samples (batch ramp-up is ignored).

Conventions (see train.planner.flops for the arithmetic):
- gemm: megasweep's per-GEMM count. TFLOPs are model FLOPs (no recomputation); HFU adds the
  recomputed forwards of parallelism.recompute.
- megatron_eq3: Narayanan et al. Eq. 3 as Megatron-DeepSpeed prints it. TFLOPs include the
  recompute factor (4 for any recompute != none, as that code does, else 3); MFU uses factor 3.
- mpt: MosaicML's 2 x parameters per token plus attention. TFLOPs are model FLOPs (factor 3);
  HFU uses factor 4 when recompute != none.
Aggregate PFLOPs = TFLOPs per device x devices / 1024, as the BLOOM notes write it.

Bad input ends with one paragraph on stderr and exit status 2. No torch is imported.
"""

from __future__ import annotations

import difflib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

import conf
from analysis import finite_above_zero, whole_at_least_one
from conf.overrides import override_problem
from conf.schema import (
    Engine,
    HardwareConfig,
    Offload,
    Precision,
    Recompute,
    RunConfig,
    to_run_config,
    unknown_override,
)
from train.contract import EXIT_USAGE
from train.metrics import tflops_text
from train.planner.flops import (
    ImpossibleUtilization,
    achieved_tflops,
    hardware_flops_per_iteration,
    megatron_eq3_flops_per_iteration,
    model_flops_per_iteration,
    mpt_flops_per_seq,
    peak_tflops,
    utilization,
)
from train.planner.layout import Layout
from train.planner.memory import Stack, stack_of
from train.planner.perf import UnknownHardwareFigure, predict_time
from train.planner.rules import advise, resolve_auto_micro_batch, validate
from train.planner.sizes import total_params

STACKS = tuple(s.value for s in Stack)

CONVENTIONS = ("gemm", "megatron_eq3", "mpt")
OUTPUTS = ("text", "json")
OWN_KEYS = ("sec_per_iter", "devices", "convention", "output", "predict", "stack")
BOOLEANS = {"true": True, "false": False}


USAGE = (
    "usage: python -m analysis.calc [HYDRA OVERRIDES...] sec_per_iter=<seconds> devices=<count> "
    "[convention=gemm|megatron_eq3|mpt] [output=text|json] [predict=true|false] [stack=" + "|".join(STACKS) + "]\n"
    "sec_per_iter may be left out with predict=true (the time model's seconds are then taken); stack, with "
    "predict=true only, is the software whose time is predicted (default: the one python -m train runs); "
    "the module's docstring (pydoc analysis.calc) explains conventions, stacks and the output.\n"
    "Overrides are those of `python -m train`, e.g. model=gpt_1.3b hardware=a100_80gb parallelism.tp=2."
)
OVERRIDE_HINT = (
    "Overrides use Hydra's syntax group=option or group.key=value (e.g. model=gpt_1.3b "
    "hardware=a100_80gb parallelism.tp=2), and the calculator's own keys are " + ", ".join(OWN_KEYS) + "."
)


class CalcError(ValueError):
    """Bad input: the message is one paragraph naming the key, its value, the rule and the alternatives."""


@dataclass(frozen=True)
class CalcArgs:
    """The calculator's own keys, parsed and checked, plus the Hydra overrides left for composition."""

    sec_per_iter: float
    devices: int
    convention: str
    output: str
    overrides: tuple[str, ...]
    predict: bool = False
    stack: str | None = None


@dataclass(frozen=True)
class CalcResult:
    """Everything the calculator reports; `tflops_per_device` is the convention's headline figure."""

    convention: str
    model: str
    hardware: str
    precision: str
    recompute: str
    global_batch_size: int
    devices: int
    sec_per_iter: float
    flops_per_iteration: float
    model_flops_per_iteration: float
    hardware_flops_per_iteration: float
    tflops_per_device: float
    model_tflops_per_device: float
    hardware_tflops_per_device: float
    aggregate_pflops: float
    peak_tflops: float | None
    peak_note: str
    mfu: float | None
    hfu: float | None
    predicted_sec_per_iter: float | None = None
    predicted_breakdown: dict[str, float] | None = None
    """Seconds per iteration of each part of train.planner.perf.PARTS (predict=true only)."""
    predicted_layout: dict[str, int | str | bool] | None = None
    """The layout predicted: dp, tp, pp, micro_batch_size (auto resolved), virtual_stages, sequence_parallel,
    zero_stage, recompute, offload and the software stack priced (predict=true only)."""
    prediction_error: float | None = None
    """predicted_sec_per_iter / sec_per_iter - 1 (fraction; negative: predicted faster than measured), as
    results.md's Err (analysis.records.prediction_error): predict=true with a measured sec_per_iter only."""
    advisories: list[str] = field(default_factory=list)
    """The planner's notes on the predicted layout (train.planner.rules.advise, as the dry run's table shows
    them: '[rule] why'): a cost the user may not intend, such as a CPU calibration measured with another
    number of ranks per node (predict=true only)."""
    sec_per_iter_source: str = "measured"
    """'measured': sec_per_iter was given; 'predicted': predict=true without it, so sec_per_iter and every
    figure computed from it (TFLOPs, PFLOPs, MFU, HFU) are the time model's, not a measurement."""


def parse_args(argv: Sequence[str]) -> CalcArgs:
    """Split the calculator's own key=value pairs from the Hydra overrides and check them."""
    own: dict[str, str] = {}
    overrides: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in OWN_KEYS:
            if key in own:
                raise CalcError(
                    f"{key} is given twice ({key}={own[key]} and {arg}): give each of "
                    f"{', '.join(OWN_KEYS)} at most once."
                )
            own[key] = value
        else:
            overrides.append(arg)
    for text in overrides:
        if (problem := _unknown_key(text)) is not None:
            raise CalcError(problem)

    predict_text = own.get("predict", "false")
    if predict_text not in BOOLEANS:
        raise CalcError(f"predict={predict_text} is invalid: predict is true or false (default false).")
    predict = BOOLEANS[predict_text]
    stack = own.get("stack")
    if stack is not None and stack not in STACKS:
        raise CalcError(f"stack={stack} is not a modelled software stack: choose one of {', '.join(STACKS)}.")
    if stack is not None and not predict:
        # FLOPs and utilisation do not depend on it: only the time model prices a stack.
        raise CalcError(
            f"stack={stack} applies to predict=true only (the software whose time the model predicts); "
            f"add predict=true, or leave stack out."
        )
    for key, example in (("sec_per_iter", "sec_per_iter=114.11"), ("devices", "devices=384")):
        if key == "sec_per_iter" and predict and key not in own:
            continue
        if key not in own and predict:
            # "needs both sec_per_iter and devices" told a predict=true user to give what it does not need.
            raise CalcError(
                "devices is missing: predict=true needs devices=<number of devices the layout runs on> (its "
                "world size, dp x tp x pp), e.g. devices=8; sec_per_iter may be left out."
            )
        if key not in own:
            raise CalcError(
                f"{key} is missing: analysis.calc needs both sec_per_iter=<measured seconds per training "
                f"iteration> and devices=<number of devices the iteration ran on>, e.g. {example}"
                + (" (or predict=true for the time model's seconds)." if key == "sec_per_iter" else ".")
            )
    sec_per_iter = _parse_seconds(own["sec_per_iter"]) if "sec_per_iter" in own else math.nan
    devices = _parse_devices(own["devices"])
    convention = own.get("convention", "gemm")
    if convention not in CONVENTIONS:
        raise CalcError(
            f"convention={convention} is not a known FLOPs convention: choose one of "
            f"{', '.join(CONVENTIONS)} (default gemm)."
        )
    output = own.get("output", "text")
    if output not in OUTPUTS:
        raise CalcError(f"output={output} is not a known output format: choose one of {', '.join(OUTPUTS)}.")
    return CalcArgs(sec_per_iter, devices, convention, output, tuple(overrides), predict, stack)


def _unknown_key(text: str) -> str | None:
    """One sentence with "did you mean" when the override `text` names a key that is neither the
    calculator's own nor a field of the config (`devics=8`, `parallelism.tpp=2`), an option its group
    lacks (`hardware=h100`), a value its field cannot take, or cannot be parsed: what every entry point
    says of it (conf.overrides.override_problem), with the calculator's own keys as candidates too.
    None when `text` is fine."""
    key = text.partition("=")[0].lstrip("+~")
    if key in OWN_KEYS:  # `+devices=8`: Hydra's prefixes add or remove config keys, not the calculator's
        return f"{text.partition('=')[0]} takes no prefix: the calculator's own keys are given as {key}=<value> (override '{text}')."
    if _is_sweep(text):
        return (
            f"'{text}' gives several values: analysis.calc counts one configuration, so give one value per key "
            f"and run it once per value (python -m train -m ... hydra/launcher=plan plans a whole sweep)."
        )
    if "." not in key and (close := difflib.get_close_matches(key, OWN_KEYS, n=1)) and unknown_override(key, text):
        return f"{key} is not a key of analysis.calc; did you mean {close[0]}? (override '{text}'). {OVERRIDE_HINT}"
    problem = override_problem([text])
    return None if problem is None else f"{problem}. {OVERRIDE_HINT}"


def _is_sweep(text: str) -> bool:
    from launchers.compose import parse_override

    try:
        return parse_override(text).is_sweep_override()
    except HydraException:  # unparsable (OverrideParseException): override_problem says why
        return False


def _parse_seconds(text: str) -> float:
    if (value := finite_above_zero(text)) is None:
        raise CalcError(
            f"sec_per_iter={text} is invalid: sec_per_iter must be a positive, finite number of seconds "
            f"per training iteration, e.g. sec_per_iter=114.11."
        )
    return value


def _parse_devices(text: str) -> int:
    if (value := whole_at_least_one(text)) is None:
        raise CalcError(
            f"devices={text} is invalid: devices must be a positive whole number of devices (GPUs, or CPU "
            f"sockets used as devices) that ran the iteration, e.g. devices=384."
        )
    return value


def compose_run(overrides: Sequence[str]) -> RunConfig:
    """Compose conf/config.yaml with the overrides, as `python -m train` does, without Hydra's output dirs."""
    config_dir = str(conf.CONFIG_DIR)
    conf.register_configs()  # the primary config extends megasweep_schema, read from Hydra's ConfigStore
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose("config", overrides=list(overrides))
        return to_run_config(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        given = " ".join(overrides) if overrides else "(none)"
        raise CalcError(
            f"the Hydra overrides ({given}) could not be applied: {_one_paragraph(exc)}. {OVERRIDE_HINT}"
        ) from exc


def _one_paragraph(exc: BaseException) -> str:
    """Hydra's multi-line message (and its cause's) as one line; option lists joined by commas."""
    parts: list[str] = []
    for error in (exc, exc.__cause__):
        if error is None:
            continue
        text = str(error).split("Config search path")[0]
        for line in text.splitlines():
            # OmegaConf's reference_type/object_type lines name internal classes, not user input.
            if not line.strip() or line.strip().startswith(("reference_type=", "object_type=")):
                continue
            if line.startswith("\t") and parts and parts[-1].endswith((":", ",")):
                parts[-1] = f"{parts[-1]} {line.strip()},"
            elif line.startswith(("\t", "    ")) and parts:
                parts[-1] = f"{parts[-1].rstrip(',')} ({line.strip()})"
            else:
                parts.append(line.strip())
    return "; ".join(part.rstrip(",").rstrip(".") for part in parts)


LAYOUT_RULES = (
    "positive",
    "hidden_divisible_by_heads",
    "heads_divisible_by_tp",
    "hidden_divisible_by_tp",
    "ffn_divisible_by_tp",
    "vocab_padding",
    "world_size",
    "hardware_figures",
)
"""The rules (train.planner.rules) a measured figure's layout must pass to be counted: the model's
shapes split by tp (the vocabulary padded for it), `devices` (the world size) holding whole replicas,
and the hardware's figures within what they can be, all of them, as the dry run judges them: one out
of range is a broken description of the device (a peak of 0 was refused by the FLOPs arithmetic, in
words that named no field). The batch, predicted-memory and engine rules are not the calculator's
business: the figure was measured, whatever the planner thinks."""


def check_layout(run: RunConfig, devices: int) -> Layout:
    """The layout of `run` on `devices` devices, or CalcError naming each broken layout rule."""
    par = run.parallelism
    broken = [v for v in validate(run, world_size=devices) if v.rule in LAYOUT_RULES]
    if broken:
        message = " ".join(str(v) for v in broken)
        if any(v.rule == "world_size" for v in broken) and par.dp is not None:
            # The rule names world sizes; the calculator's argument for it is `devices`.
            message += (
                f" Or keep parallelism.dp={par.dp} and give devices={Layout.of(par).world_size}."
            )
        what = (f"the layout cannot run (devices={devices} is its world size)"
                if any(v.rule != "hardware_figures" for v in broken) else "the hardware cannot be counted with")  # fmt: skip
        raise CalcError(f"{what}: {message}")
    return Layout.of(par, devices)


def planned_layout(run: RunConfig, devices: int, stack: str | None = None) -> RunConfig:
    """`run` as the dry run plans it on `devices` devices (micro_batch_size=auto resolved), or CalcError
    naming each rule it breaks: a prediction of a layout that cannot start (a micro-batch larger than
    the batch, a rank out of memory) would be a number for nothing."""
    run = resolve_auto_micro_batch(run, world_size=devices)
    by = _as_run_by(run, stack)
    broken = validate(by, world_size=devices, world_fixed=True)
    if broken:
        engine = Engine(by.parallelism.engine).value
        runs_as = f" (stack={stack} is what python -m train runs with parallelism.engine={engine})" if by is not run else ""
        raise CalcError(
            f"predict=true predicts only a layout the planner accepts, and this one on devices={devices}{runs_as} "
            "breaks its rules (as the dry run, python -m train -m hydra/launcher=plan, reports): "
            + " ".join(str(v) for v in broken)
        )
    return run


def _as_run_by(run: RunConfig, stack: str | None) -> RunConfig:
    """`run` with the engine of `python -m train` that runs `stack`, so that its rules apply (DeepSpeed's
    engine runs no pipeline); Megatron-DeepSpeed, which megasweep models but does not run, keeps `run`'s."""
    engines = {Stack.megasweep.value: Engine.native, Stack.deepspeed.value: Engine.deepspeed}
    if stack not in engines:
        return run
    return replace(run, parallelism=replace(run.parallelism, engine=engines[stack]))


def _flops(run: RunConfig, convention: str) -> tuple[float, float, float]:
    """(headline, model, hardware) FLOPs of one iteration under `convention` (see the module)."""
    model, par = run.model, run.parallelism
    gbs, tp = par.global_batch_size, par.tp
    recompute = Recompute(par.recompute)
    recomputing = recompute != Recompute.none
    if convention == "gemm":
        model_flops = model_flops_per_iteration(model, global_batch_size=gbs, tp=tp)
        hardware_flops = hardware_flops_per_iteration(
            model, global_batch_size=gbs, recompute=recompute, tp=tp
        )
        headline = model_flops
    elif convention == "megatron_eq3":
        # Megatron-DeepSpeed prints factor 4 for selective recomputation as well as full.
        hardware_flops = megatron_eq3_flops_per_iteration(
            model, global_batch_size=gbs, full_recompute=recomputing, tp=tp
        )
        model_flops = megatron_eq3_flops_per_iteration(
            model, global_batch_size=gbs, full_recompute=False, tp=tp
        )
        headline = hardware_flops
    elif convention == "mpt":
        shape = dict(
            n_params=total_params(model, tp),
            n_layers=model.num_layers,
            d_model=model.hidden_size,
            seq_len=model.seq_length,
        )
        model_flops = float(gbs * mpt_flops_per_seq(**shape, passes=3))
        hardware_flops = float(gbs * mpt_flops_per_seq(**shape, passes=4 if recomputing else 3))
        headline = model_flops
    else:
        raise CalcError(
            f"convention={convention} is not a known FLOPs convention: "
            f"choose one of {', '.join(CONVENTIONS)}."
        )
    return headline, model_flops, hardware_flops


def calculate(
    run: RunConfig, *, sec_per_iter: float, devices: int, convention: str = "gemm", predicted: bool = False
) -> CalcResult:
    """FLOPs of one iteration under `convention`, per device per second, and utilization of the peak.

    predicted: sec_per_iter is the time model's, not a measurement, so an MFU above 100% is reported
    (a fault of the model's figures) rather than refused as a mistyped input."""
    model, par, hw = run.model, run.parallelism, run.hardware
    gbs = par.global_batch_size
    recompute = Recompute(par.recompute)
    headline, model_flops, hardware_flops = _flops(run, convention)

    tflops = achieved_tflops(headline, sec_per_iter, devices)
    model_tflops = achieved_tflops(model_flops, sec_per_iter, devices)
    hardware_tflops = achieved_tflops(hardware_flops, sec_per_iter, devices)
    peak = peak_tflops(hw, par.precision)
    peak_note = _peak_note(hw, par.precision, peak)
    utilizations: dict[str, float | None] = {}
    for label, achieved in (("MFU", model_tflops), ("HFU", hardware_tflops)):
        try:
            utilizations[label] = utilization(achieved, peak)
        except ImpossibleUtilization as exc:
            if predicted:
                utilizations[label] = exc.ratio
                continue
            raise CalcError(
                f"{label}={exc.ratio:.1%} is impossible (it must be <= 100%), so an input is wrong: "
                f"{achieved:.2f} TFLOP/s per device against a dense peak of {exc.peak_tflops:g} TFLOP/s. "
                "Check "
                f"sec_per_iter={sec_per_iter:g}, devices={devices}, parallelism.global_batch_size={gbs}, "
                f"model={model.name}, hardware={hw.name} and parallelism.precision={par.precision.value}."
            ) from exc
    mfu, hfu = utilizations["MFU"], utilizations["HFU"]
    return CalcResult(
        convention=convention,
        model=model.name,
        hardware=hw.name,
        precision=par.precision.value,
        recompute=recompute.value,
        global_batch_size=gbs,
        devices=devices,
        sec_per_iter=sec_per_iter,
        flops_per_iteration=headline,
        model_flops_per_iteration=model_flops,
        hardware_flops_per_iteration=hardware_flops,
        tflops_per_device=tflops,
        model_tflops_per_device=model_tflops,
        hardware_tflops_per_device=hardware_tflops,
        # /1024, not /1000: the BLOOM notes' aggregate figures are written this way.
        aggregate_pflops=tflops * devices / 1024,
        peak_tflops=peak,
        peak_note=peak_note,
        mfu=mfu,
        hfu=hfu,
        sec_per_iter_source="predicted" if predicted else "measured",
    )


def _peak_note(hw: HardwareConfig, precision: Precision, peak: float | None) -> str:
    """What the peak is, in words: fp32 on a device whose config says `tf32` is the TF32 tensor
    cores' peak (the trainer allows TF32), half the precision of fp32 and many times a CUDA core's."""
    if peak is None:
        if hw.peak_measured:
            return f"unknown: {hw.name}'s peak is measured at run time by the trainer's matmul calibration"
        return f"unknown: {hw.name} has no dense {precision.value} peak in its config"
    kind = f"dense {precision.value}"
    if precision == Precision.fp32 and hw.tf32:
        kind = "dense TF32 tensor cores (fp32 matmuls run as TF32)"
    return f"{peak:g} TFLOP/s {kind} ({hw.name})"


PREDICTED_NOTE = (
    "no sec_per_iter given: sec_per_iter, TFLOPs, PFLOPs, MFU and HFU are from the time model's predicted "
    "seconds per iteration (train.planner.perf), not a measurement"
)
"""What a result of predict=true without sec_per_iter says of its figures (text and JSON)."""


HEADLINE = {
    "gemm": "model FLOPs, per-GEMM count",
    "megatron_eq3": "Megatron-DeepSpeed Eq. 3, recompute factor included",
    "mpt": "model FLOPs, MosaicML 6N + attention",
}


def format_text(result: CalcResult) -> str:
    """Human-readable summary, one figure per line."""

    # Figures from a predicted time say so on their own line: 'MFU 73.31%' alone reads as measured.
    predicted = result.sec_per_iter_source == "predicted"
    tag = " predicted" if predicted else ""

    def pct(value: float | None) -> str:
        if value is not None and value > 1:
            # Only a predicted time gets here (a measured one is refused): the model's figures are wrong.
            return f"{100 * value:.2f}%{tag} (above 100%: the time model's figures for {result.hardware} are wrong)"
        return "unknown" if value is None else f"{100 * value:.2f}%{tag}"

    source = f"predicted ({PREDICTED_NOTE})" if predicted else "measured (sec_per_iter)"
    return "\n".join(
        [
            f"model / hardware     {result.model} on {result.hardware}, {result.precision}, "
            f"recompute={result.recompute}, global batch {result.global_batch_size}",
            f"convention           {result.convention} ({HEADLINE[result.convention]})",
            f"sec / iteration      {result.sec_per_iter:.4g} {source}",
            f"FLOPs / iteration    {result.flops_per_iteration:.4e} "
            f"(model {result.model_flops_per_iteration:.4e}, "
            f"hardware {result.hardware_flops_per_iteration:.4e})",
            f"TFLOPs / device      {tflops_text(result.tflops_per_device)}{tag} "
            f"(model {tflops_text(result.model_tflops_per_device)}, "
            f"hardware {tflops_text(result.hardware_tflops_per_device)})",
            f"aggregate PFLOPs     {tflops_text(result.aggregate_pflops)}{tag} ({result.devices} devices x TFLOPs / 1024)",
            f"peak                 {result.peak_note}",
            f"MFU                  {pct(result.mfu)}",
            f"HFU                  {pct(result.hfu)}",
            *_prediction_lines(result),
        ]
    )


def _prediction_lines(result: CalcResult) -> list[str]:
    if result.predicted_sec_per_iter is None or result.predicted_breakdown is None:
        return []
    total = result.predicted_sec_per_iter
    lines = []
    if result.predicted_layout is not None:
        lines.append("predicted layout     " + " ".join(f"{k}={v}" for k, v in result.predicted_layout.items()))
    lines.append(f"predicted s/it       {total:.4g} (train.planner.perf; where the time goes:)")
    lines += [
        f"  {part:<18} {seconds:10.4g} s  {100 * seconds / total:5.1f}%"
        for part, seconds in result.predicted_breakdown.items()
        if seconds > 0
    ]
    if result.prediction_error is not None:
        lines.append(f"prediction error     {100 * result.prediction_error:+.1f}% (predicted / measured - 1, as results.md's Err)")
    lines += [f"note                 {note}" for note in result.advisories]
    return lines


def predict(run: RunConfig, *, devices: int, stack: str | None = None) -> tuple[float, dict[str, float]]:
    """The time model's seconds per iteration of `run` on `devices` devices, and its parts."""
    par = run.parallelism
    dp = Layout.of(par, devices).dp
    try:
        prediction = predict_time(run.model, par, run.hardware, dp=dp, stack=Stack(stack) if stack else None)
    except (UnknownHardwareFigure, ValueError, TypeError, KeyError) as exc:
        raise CalcError(f"predict=true has no prediction for this config: {exc}.") from exc
    return prediction.sec_per_iter, dict(prediction.parts)


def _layout_of(run: RunConfig, devices: int, stack: str | None) -> dict[str, int | str | bool]:
    """Every field the prediction depends on: the same line for two predictions means the same layout."""
    par = run.parallelism
    return {
        "dp": Layout.of(par, devices).dp, "tp": par.tp, "pp": par.pp, "micro_batch_size": par.mbs,
        "virtual_stages": par.virtual_stages, "sequence_parallel": par.sequence_parallel,
        "zero_stage": par.zero_stage, "recompute": Recompute(par.recompute).value,
        "offload": Offload(par.offload).value, "stack": stack or stack_of(par).value,
    }  # fmt: skip


def to_json(result: CalcResult) -> str:
    """One JSON object; mfu, hfu and peak_tflops are null when the peak is unknown. sec_per_iter_source
    says whether the figures are measured or predicted; a predicted result also has a 'note' saying so."""
    data: dict[str, Any] = asdict(result)
    if result.sec_per_iter_source == "predicted":
        data["note"] = PREDICTED_NOTE
    return json.dumps(data, sort_keys=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0, or 2 for bad input with one paragraph on stderr)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # `help` too: a bare word is no override, and Hydra's grammar said only that it lacked its '='.
    if any(arg in ("-h", "--help", "help") for arg in args_list):
        print(USAGE)
        return 0
    try:
        args = parse_args(args_list)
        run = compose_run(args.overrides)
        check_layout(run, args.devices)
        predicted: tuple[float | None, dict[str, float] | None] = (None, None)
        layout: dict[str, int | str | bool] | None = None
        notes: list[str] = []
        if args.predict:
            run = planned_layout(run, args.devices, args.stack)
            predicted = predict(run, devices=args.devices, stack=args.stack)
            layout = _layout_of(run, args.devices, args.stack)
            # What the dry run's table says beside the same layout: calc priced it without a word.
            notes = [str(note) for note in advise(run)]
        measured = math.isfinite(args.sec_per_iter)
        seconds = args.sec_per_iter if measured else predicted[0]
        assert seconds is not None  # parse_args requires sec_per_iter unless predict=true
        result = calculate(
            run, sec_per_iter=seconds, devices=args.devices, convention=args.convention, predicted=not measured
        )
        # Both given: the figure results.md's Err shows for a measured run, so that one the user measured
        # elsewhere is judged the same way (it showed the two figures and left the sum to the reader).
        error = predicted[0] / seconds - 1.0 if measured and predicted[0] is not None else None
        result = replace(
            result, predicted_sec_per_iter=predicted[0], predicted_breakdown=predicted[1], predicted_layout=layout,
            prediction_error=error, advisories=notes,
        )  # fmt: skip
    except CalcError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        # train.planner.flops rejects shapes it cannot split (e.g. heads not divisible by tp).
        print(f"error: the configuration cannot be counted: {exc}. {OVERRIDE_HINT}", file=sys.stderr)
        return EXIT_USAGE
    print(to_json(result) if args.output == "json" else format_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
