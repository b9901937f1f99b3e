"""analysis.calc: the FLOPs calculator CLI, through a subprocess and through main(argv)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from analysis.calc import LAYOUT_RULES, compose_run, main
from conf.schema import ModelConfig, Recompute
from train.planner.flops import hardware_flops_per_iteration, model_flops_per_iteration
from train.planner.rules import validate

REPO = Path(__file__).resolve().parents[2]

# BLOOM notes (seed 001), 'GBS Variations', after the Eq. 3 fix:
# | 48 | 181B | 8 | 8 | 6 | 4 | 2048 | 55GB | 114.11 | 141.27 | 02-25 |
BLOOM_ROW = [
    "model=bloom_181b_l72_h14336",
    "hardware=a100_80gb",
    "parallelism.tp=8",
    "parallelism.pp=6",
    "parallelism.micro_batch_size=4",
    "parallelism.global_batch_size=2048",
    "parallelism.recompute=full",
    "parallelism.precision=bf16",
    "sec_per_iter=114.11",
    "devices=384",
    "convention=megatron_eq3",
]
JSON_KEYS = {"tflops_per_device", "aggregate_pflops", "mfu", "hfu"}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "analysis.calc", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def json_main(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    status, out, err = run_main(capsys, *args, "output=json")
    assert status == 0, err
    data = json.loads(out)
    assert isinstance(data, dict)
    return data


def test_cli_reproduces_a_bloom_row_as_json() -> None:
    result = run_cli(*BLOOM_ROW, "output=json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert data.keys() >= JSON_KEYS
    assert data["convention"] == "megatron_eq3"
    # Logged TFLOPs 141.27 (2 decimals, from a rounded Sec/it): 0.05% tolerance.
    assert data["tflops_per_device"] == pytest.approx(141.27, rel=5e-4)
    assert data["aggregate_pflops"] == pytest.approx(141.27 * 384 / 1024, rel=5e-4)
    # Against the A100's dense bf16 peak of 312: HFU from the factor-4 figure, MFU from factor 3.
    assert data["hfu"] == pytest.approx(141.27 / 312, rel=5e-4)
    assert data["mfu"] < data["hfu"]
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("layout", "sec_per_iter", "logged"),
    [
        # | 48 | 181B | 8 | 4 | 12 | 2 | 2048 | 44GB | 110.48 | 145.92 | 02-25 |
        (["parallelism.tp=4", "parallelism.pp=12", "parallelism.micro_batch_size=2"], "110.48", 145.92),
        # | 48 | 181B | 4 | 8 | 12 | 1 | 2048 | 29GB | 143.31 | 112.49 | 02-21 |
        (["parallelism.tp=8", "parallelism.pp=12", "parallelism.micro_batch_size=1"], "143.31", 112.49),
    ],
)
def test_main_reproduces_bloom_rows_as_text(
    capsys: pytest.CaptureFixture[str], layout: list[str], sec_per_iter: str, logged: float
) -> None:
    args = [
        a
        for a in BLOOM_ROW
        if not a.startswith(("parallelism.tp", "parallelism.pp", "parallelism.micro", "sec"))
    ]
    status, out, err = run_main(capsys, *args, *layout, f"sec_per_iter={sec_per_iter}")
    assert status == 0, err
    line = next(line for line in out.splitlines() if line.startswith("TFLOPs / device"))
    assert float(line.split()[3]) == pytest.approx(logged, rel=5e-4)
    assert "MFU" in out and "HFU" in out


def test_gemm_convention_matches_train_flops(capsys: pytest.CaptureFixture[str]) -> None:
    data = json_main(
        capsys,
        "model=gpt_1.3b",
        "hardware=a100_80gb",
        "parallelism.tp=2",
        "parallelism.global_batch_size=512",
        "parallelism.recompute=selective",
        "parallelism.precision=bf16",
        "sec_per_iter=20",
        "devices=64",
    )
    model = ModelConfig(
        name="gpt_1.3b",
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        seq_length=2048,
        vocab_size=50257,
    )
    flops = model_flops_per_iteration(model, global_batch_size=512, tp=2)
    hardware = hardware_flops_per_iteration(model, global_batch_size=512, recompute=Recompute.selective, tp=2)
    assert data["convention"] == "gemm"
    assert data["flops_per_iteration"] == flops
    assert data["tflops_per_device"] == pytest.approx(flops / (20 * 64 * 1e12), rel=1e-12)
    assert data["aggregate_pflops"] == pytest.approx(data["tflops_per_device"] * 64 / 1024, rel=1e-12)
    assert data["mfu"] == pytest.approx(data["tflops_per_device"] / 312, rel=1e-12)
    assert data["hfu"] == pytest.approx(hardware / (20 * 64 * 1e12) / 312, rel=1e-12)
    assert data["mfu"] < data["hfu"] < 1


@pytest.mark.parametrize(("recompute", "ratio"), [("none", 1.0), ("selective", 4 / 3), ("full", 4 / 3)])
def test_mpt_convention_hfu_factor(capsys: pytest.CaptureFixture[str], recompute: str, ratio: float) -> None:
    data = json_main(
        capsys,
        "model=gpt_6.7b",
        "hardware=h100_sxm",
        "parallelism.precision=bf16",
        f"parallelism.recompute={recompute}",
        "parallelism.global_batch_size=64",
        "sec_per_iter=10",
        "devices=8",
        "convention=mpt",
    )
    assert data["hfu"] == pytest.approx(ratio * data["mfu"], rel=1e-12)


def test_unknown_peak_gives_null(capsys: pytest.CaptureFixture[str]) -> None:
    data = json_main(capsys, "hardware=cpu", "sec_per_iter=1.5", "devices=1")
    assert data["mfu"] is None and data["hfu"] is None and data["peak_tflops"] is None
    assert data["tflops_per_device"] > 0
    data = json_main(
        capsys, "hardware=v100_32gb", "parallelism.precision=bf16", "sec_per_iter=1.5", "devices=1"
    )
    assert data["mfu"] is None  # V100 has no bf16


@pytest.mark.parametrize(
    ("hardware", "label"),
    [
        # The A100's fp32 figure (156) is its TF32 tensor cores', 8x its 19.5 TFLOP/s of CUDA-core fp32:
        # it was labelled "dense fp32".
        ("a100_80gb", "156 TFLOP/s dense TF32 tensor cores (fp32 matmuls run as TF32) (a100_80gb)"),
        ("h100_sxm", "494.7 TFLOP/s dense TF32 tensor cores (fp32 matmuls run as TF32) (h100_sxm)"),
        # No TF32 on a V100 or a CPU: their fp32 peak is plain fp32.
        ("v100_32gb", "15.7 TFLOP/s dense fp32 (v100_32gb)"),
        ("a64fx", "6.76 TFLOP/s dense fp32 (a64fx)"),
    ],
)
def test_an_fp32_peak_says_whether_it_is_tf32(capsys: pytest.CaptureFixture[str], hardware: str, label: str) -> None:
    args = ("model=gpt_1.3b", f"hardware={hardware}", "parallelism.precision=fp32", "sec_per_iter=1000", "devices=8")
    data = json_main(capsys, *args)
    assert data["peak_note"] == label
    status, out, err = run_main(capsys, *args)
    assert status == 0, err
    assert f"peak                 {label}" in out.splitlines()
    # fp16 is fp16, TF32 or not.
    assert "TF32" not in json_main(capsys, *args[:2], "parallelism.precision=fp16", *args[3:])["peak_note"]


@pytest.mark.parametrize(
    ("args", "key", "hint"),
    [
        (["devices=8"], "sec_per_iter", "or predict=true for the time model's seconds"),
        (["sec_per_iter=1"], "devices", "missing"),
        # With predict=true it said analysis.calc "needs both sec_per_iter=... and devices=...".
        (["predict=true"], "devices is missing: predict=true needs devices=", "sec_per_iter may be left out"),
        (["sec_per_iter=-3", "devices=8"], "sec_per_iter=-3", "positive"),
        (["sec_per_iter=abc", "devices=8"], "sec_per_iter=abc", "positive"),
        (["sec_per_iter=1", "devices=0"], "devices=0", "positive"),
        (["sec_per_iter=1", "devices=2.5"], "devices=2.5", "whole"),
        (["sec_per_iter=1", "devices=8", "convention=flops6n"], "convention=flops6n", "megatron_eq3"),
        (["sec_per_iter=1", "devices=8", "output=xml"], "output=xml", "json"),
        # Said as `python -m train` says them (conf.overrides): the closest options, the type in words.
        (["model=gpt_99b", "sec_per_iter=1", "devices=8"], "model=gpt_99b is not a model config", "did you mean gpt_30b"),
        (["parallelism.tp=two", "sec_per_iter=1", "devices=8"], "parallelism.tp=two", "not a whole number"),
        (["training.lr=[", "sec_per_iter=1", "devices=8"], "cannot parse override 'training.lr=['", "override_grammar"),
        # An unknown key gets "did you mean" (not Hydra's "use +key"), a misspelt own key first of all:
        # `devics=8` was reported as devices missing.
        (["sec_per_iter=1", "devics=8"], "devics", "did you mean devices?"),
        (["sec_per_iter=1", "devices=8", "parallelism.tpp=2"], "parallelism.tpp", "did you mean parallelism.tp"),
        (["sec_per_iter=1", "devices=8", "+parallelism.tpp=2"], "parallelism.tpp", "did you mean parallelism.tp"),
        # `+devices=8` was "devices is not a key of analysis.calc; did you mean devices?"
        (["sec_per_iter=1", "+devices=8"], "+devices takes no prefix", "devices=<value>"),
        # A sweep value passed Hydra's advice to add --multirun, which the calculator refuses.
        (["sec_per_iter=1", "devices=8", "parallelism.tp=1,2"], "'parallelism.tp=1,2' gives several values", "one value per key"),
        # A vocabulary padding of 0 divided by zero (a traceback); negative sizes counted wrong FLOPs.
        (["sec_per_iter=1", "devices=8", "model.make_vocab_size_divisible_by=0"], "[vocab_padding]", "positive integer"),
        (["sec_per_iter=1", "devices=8", "model.vocab_size=-3"], "[vocab_padding]", "model.vocab_size=-3"),
        (["parallelism.tp=3", "sec_per_iter=1", "devices=3"], "num_attention_heads", "divisors"),
        (["parallelism.tp=2", "sec_per_iter=1", "devices=3"], "devices=3", "multiple"),
        (["parallelism.dp=2", "sec_per_iter=1", "devices=4"], "parallelism.dp=2", "devices=2"),
        # A peak of 0 was refused by the FLOPs arithmetic, naming no field (and with a hint on Hydra's syntax).
        (["model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16", "sec_per_iter=1", "devices=8",
          "hardware.peak_tflops_bf16=0"], "[hardware_figures] hardware.peak_tflops_bf16=0.0", "peaks"),
        (
            [
                "model=gpt_1.3b",
                "hardware=a100_80gb",
                "parallelism.precision=bf16",
                "sec_per_iter=0.001",
                "devices=8",
            ],
            "MFU",
            "sec_per_iter=0.001",
        ),
    ],
)
def test_bad_input_is_one_clear_paragraph(
    capsys: pytest.CaptureFixture[str], args: list[str], key: str, hint: str
) -> None:
    status, out, err = run_main(capsys, *args)
    assert status == 2
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1  # one paragraph, one line
    assert key in err and hint in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "world_size"),
    [
        (["parallelism.tp=3", "devices=3"], 3),
        (["parallelism.tp=2", "devices=3"], 3),
        (["parallelism.dp=2", "devices=4"], 4),
    ],
)
def test_layout_errors_are_the_rules_own(capsys: pytest.CaptureFixture[str], args: list[str], world_size: int) -> None:
    # The calculator judges a layout with train.planner.rules, so it names the same rules, in the same
    # words, as the dry run and the trainer do for that world size.
    status, _, err = run_main(capsys, *args, "sec_per_iter=1")
    run = compose_run(args[:1])
    expected = [v for v in validate(run, world_size=world_size) if v.rule in LAYOUT_RULES]
    assert status == 2 and expected
    assert all(str(v) in err for v in expected)


def test_cli_bad_input_exits_2_without_traceback() -> None:
    result = run_cli("model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16", "devices=8")
    assert result.returncode == 2
    assert "sec_per_iter" in result.stderr and "Traceback" not in result.stderr
    result = run_cli(*BLOOM_ROW[:-1], "convention=bogus")
    assert result.returncode == 2
    assert "convention=bogus" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys, "--help")
    assert status == 0 and "sec_per_iter" in out and "convention" in out
    # The usage line showed sec_per_iter as always required.
    assert "sec_per_iter may be left out with predict=true" in out
    # It read "[stack=...]": the values and that the key needs predict=true were in the docstring only.
    assert "[stack=megasweep|deepspeed|megatron_deepspeed]" in out and "stack, with predict=true only" in out
    # `help`, a bare word, was Hydra's "missing EQUAL" and a link.
    assert run_main(capsys, "help")[:2] == (0, out)


def test_calc_does_not_import_torch() -> None:
    code = "import sys, analysis.calc; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_predict_adds_the_time_model_and_its_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    from train.planner.perf import PARTS

    args = ["model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16", "parallelism.global_batch_size=64",
            "devices=8", "predict=true", "output=json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["predicted_breakdown"]) == set(PARTS)
    assert out["predicted_sec_per_iter"] == pytest.approx(sum(out["predicted_breakdown"].values()))
    # Without a measured time, the figures are those of the predicted one.
    assert out["sec_per_iter"] == out["predicted_sec_per_iter"]
    assert 0 < out["mfu"] < 1
    assert out["prediction_error"] is None  # nothing measured to judge it by
    assert main([*args[:-1], "sec_per_iter=9.5"]) == 0
    text = capsys.readouterr().out
    assert "predicted s/it" in text and "tp_comm" not in text  # tp=1: no TP all-reduce
    # With a measured time, the prediction's error as results.md's Err gives it (predicted / measured - 1).
    error = out["predicted_sec_per_iter"] / 9.5 - 1
    assert f"prediction error     {100 * error:+.1f}% (predicted / measured - 1" in text
    assert main([*args, "sec_per_iter=9.5"]) == 0
    assert json.loads(capsys.readouterr().out)["prediction_error"] == pytest.approx(error)
    assert main([*args[:-2], "predict=maybe", "sec_per_iter=1"]) == 2
    assert "predict is true or false" in capsys.readouterr().err
    assert main(["model=tiny", "devices=1", "predict=true"]) == 2
    assert "measures its peak at run time" in capsys.readouterr().err


def test_predict_says_the_planners_notes_on_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    # The dry run's table says them beside the same layout; calc priced it without a word.
    args = ["model=gpt_1.3b", "hardware=a100_80gb", "parallelism.global_batch_size=64", "devices=16", "predict=true"]
    assert main([*args, "parallelism.tp=16"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note ")]
    assert len(notes) == 1 and notes[0].split(None, 1)[1].startswith("[tp_across_nodes] parallelism.tp=16 exceeds")
    assert main([*args, "parallelism.tp=8", "output=json"]) == 0
    assert json.loads(capsys.readouterr().out)["advisories"] == []
    assert main([*args, "parallelism.tp=16", "output=json"]) == 0
    (note,) = json.loads(capsys.readouterr().out)["advisories"]
    assert note.startswith("[tp_across_nodes] ")


PREDICT_GPT = ("model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16", "parallelism.global_batch_size=512",
               "devices=8", "predict=true")  # fmt: skip


def test_predict_plans_the_layout_as_the_dry_run_does(capsys: pytest.CaptureFixture[str]) -> None:
    # A micro-batch of 512 on 8 replicas of a 512 batch was predicted (38.8 s/it); 48 failed its MFU check.
    assert main([*PREDICT_GPT, "parallelism.micro_batch_size=512"]) == 2
    err = capsys.readouterr().err
    assert "[global_batch_divisible]" in err and "[memory]" in err and "predicts only a layout the planner accepts" in err
    assert main([*PREDICT_GPT, "parallelism.micro_batch_size=48"]) == 2
    assert "sec_per_iter" not in capsys.readouterr().err
    # auto is resolved as the planner resolves it, and the layout predicted is stated.
    assert main([*PREDICT_GPT, "parallelism.micro_batch_size=auto", "output=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_layout"] == {"dp": 8, "tp": 1, "pp": 1, "micro_batch_size": 8, "virtual_stages": 1,
                                       "sequence_parallel": False, "zero_stage": 0, "recompute": "none",
                                       "offload": "none", "stack": "megasweep"}  # fmt: skip
    assert main([*PREDICT_GPT, "parallelism.micro_batch_size=4"]) == 0
    assert ("predicted layout     dp=8 tp=1 pp=1 micro_batch_size=4 virtual_stages=1 sequence_parallel=False "
            "zero_stage=0 recompute=none offload=none stack=megasweep") in capsys.readouterr().out  # fmt: skip


def test_a_layout_too_large_for_its_devices_is_told_fixes_on_those_devices(capsys: pytest.CaptureFixture[str]) -> None:
    # The memory rule's advice kept dp (the dry run's choice: tp=4 there is 32 devices), which calc then
    # refused for its devices; here a larger tp or pp takes its devices from dp, and each fix runs.
    args = ("model=gpt_2.7b", "hardware=a100_40gb", "parallelism.precision=bf16", "parallelism.global_batch_size=64",
            "devices=8", "predict=true")  # fmt: skip
    assert main([*args, "parallelism.dp=8"]) == 2
    err = capsys.readouterr().err
    assert ("Each of these changes alone would fit (the world of 8 devices kept, overrides as Hydra takes them): "
            "parallelism.tp=4 parallelism.dp=2, parallelism.pp=4 parallelism.dp=2.") in err, err  # fmt: skip
    for fix in (["parallelism.tp=4", "parallelism.dp=2"], ["parallelism.pp=4", "parallelism.dp=2"]):
        assert main([*args, *fix]) == 0, capsys.readouterr().err
    # dp left to the devices: the fix is the degree alone.
    assert main(list(args)) == 2
    assert "(the world of 8 devices kept, overrides as Hydra takes them): parallelism.tp=4, parallelism.pp=4." in (
        capsys.readouterr().err
    )
    assert main([*args, "parallelism.tp=4"]) == 0
    capsys.readouterr()


def test_two_predictions_that_differ_say_how_their_layouts_differ(capsys: pytest.CaptureFixture[str]) -> None:
    # Sequence parallelism and the stack priced change the prediction; the printed layout was the same line.
    lines = {}
    for extra in ([], ["parallelism.sequence_parallel=true"], ["stack=megatron_deepspeed"]):
        assert main([*PREDICT_GPT, "parallelism.tp=2", *extra]) == 0
        out = capsys.readouterr().out
        layout = next(line for line in out.splitlines() if line.startswith("predicted layout"))
        seconds = next(line for line in out.splitlines() if line.startswith("predicted s/it"))
        lines[layout] = seconds
    assert len(lines) == 3 and len(set(lines.values())) == 3, lines


def test_the_stack_priced_is_checked_as_the_trainer_would_run_it(capsys: pytest.CaptureFixture[str]) -> None:
    # stack=deepspeed is the trainer's DeepSpeed engine, which runs no pipeline: predicting pp=2 on it
    # priced a layout the trainer refuses. Without predict=true the stack changed nothing and said nothing.
    assert main([*PREDICT_GPT, "parallelism.tp=2", "parallelism.pp=2", "stack=deepspeed"]) == 2
    err = capsys.readouterr().err
    assert "[deepspeed_no_pipeline]" in err and "stack=deepspeed is what python -m train runs with parallelism.engine=deepspeed" in err
    assert main([*PREDICT_GPT, "parallelism.tp=2", "parallelism.pp=2", "stack=megatron_deepspeed"]) == 0  # it pipelines
    capsys.readouterr()
    assert main([*BLOOM_ROW, "stack=deepspeed"]) == 2
    assert "stack=deepspeed applies to predict=true only" in capsys.readouterr().err


def test_a_cpu_runs_tflops_keep_their_digits(capsys: pytest.CaptureFixture[str]) -> None:
    # A tiny CPU run printed "TFLOPs / device 0.00" and "aggregate PFLOPs 0.00" beside a JSON of 1.77e-04.
    assert main(["sec_per_iter=200", "devices=2"]) == 0
    text = capsys.readouterr().out
    assert main(["sec_per_iter=200", "devices=2", "output=json"]) == 0
    tflops = json.loads(capsys.readouterr().out)["tflops_per_device"]
    shown = re.search(r"TFLOPs / device +([0-9.]+)", text)
    assert shown and float(shown.group(1)) == pytest.approx(tflops, rel=0.01) and tflops < 0.01


def test_a_predicted_mfu_above_100_percent_is_reported_not_blamed_on_sec_per_iter() -> None:
    from analysis.calc import CalcError, calculate, format_text

    run = compose_run(["model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16",
                       "parallelism.global_batch_size=512"])  # fmt: skip
    with pytest.raises(CalcError, match="Check sec_per_iter"):
        calculate(run, sec_per_iter=3.0, devices=8)
    result = calculate(run, sec_per_iter=3.0, devices=8, predicted=True)
    assert result.mfu is not None and result.mfu > 1
    assert "(above 100%: the time model's figures for a100_80gb are wrong)" in format_text(result)


def test_figures_of_a_predicted_time_are_labelled_predicted(capsys: pytest.CaptureFixture[str]) -> None:
    # "TFLOPs / device 228.72 ... MFU 73.31%" read as measured, though no sec_per_iter was given.
    assert main(list(PREDICT_GPT)) == 0
    lines = {line[:21].strip(): line[21:] for line in capsys.readouterr().out.splitlines()}
    assert lines["sec / iteration"].startswith("5.495 predicted (no sec_per_iter given")
    assert lines["TFLOPs / device"].startswith("216.46 predicted (model")
    assert lines["aggregate PFLOPs"].startswith("1.69 predicted")
    assert lines["MFU"] == "69.38% predicted" and lines["HFU"] == "69.38% predicted"
    assert main([*PREDICT_GPT, "output=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sec_per_iter_source"] == "predicted" and "not a measurement" in out["note"]
    # A measured time: no 'predicted' on its figures, and no note.
    assert main([*PREDICT_GPT, "sec_per_iter=7"]) == 0
    lines = {line[:21].strip(): line[21:] for line in capsys.readouterr().out.splitlines()}
    assert lines["sec / iteration"] == "7 measured (sec_per_iter)"
    assert "predicted" not in lines["TFLOPs / device"] + lines["MFU"] + lines["HFU"]
    assert main([*PREDICT_GPT, "sec_per_iter=7", "output=json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sec_per_iter_source"] == "measured" and "note" not in out
