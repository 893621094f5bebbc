"""``bench/kernels.py fp8_linear`` (bench/benchlib/kernels/fp8_linear.py): the linears it times are the ones the ls_ model runs through
fp8_linear in training (counted per side and shape against the architecture), and its rows and
per-step totals add up as its docstring says. On the CPU only the reference path runs: this checks
the script, not speed."""
import os

import pytest

import kernels  # bench/kernels.py (pytest.ini's pythonpath)
from benchlib import results
from benchlib.kernels import fp8_linear
from ls_fairseq.modules import sublayers

D, FFN, LAYERS = 32, 48, 2
TINY = (f"--encoder-layers {LAYERS} --decoder-layers {LAYERS} --encoder-embed-dim {D} "
        f"--decoder-embed-dim {D} --encoder-ffn-embed-dim {FFN} --decoder-ffn-embed-dim {FFN} "
        "--encoder-attention-heads 2 --decoder-attention-heads 2")


@pytest.mark.parametrize("kernels", [None, "require"])
def test_calls_are_the_models_linears(monkeypatch, kernels):
    """Per layer: the encoder's fused QKV (bias), attention output, fc1, fc2; the decoder's the
    same plus the cross-attention query (bias) and output (the keys and values of the encoder
    output stay F.linear: cross_attention_kv.py). Biases of the others are fused downstream.
    The recording forward runs on the CPU under LS_FAIRSEQ_KERNELS=require too (the GPU runs set
    it), and leaves the variable as it was."""
    if kernels is None:
        monkeypatch.delenv("LS_FAIRSEQ_KERNELS", raising=False)
    else:
        monkeypatch.setenv("LS_FAIRSEQ_KERNELS", kernels)
    original = sublayers.fp8_linear
    calls = fp8_linear.linear_calls("ls_transformer", TINY.split())
    assert sublayers.fp8_linear is original
    assert os.environ.get("LS_FAIRSEQ_KERNELS") == kernels
    expect = {
        ("source", D, 3 * D, True): LAYERS, ("source", D, D, False): LAYERS,
        ("source", D, FFN, False): LAYERS, ("source", FFN, D, False): LAYERS,
        ("target", D, 3 * D, True): LAYERS, ("target", D, D, False): 2 * LAYERS,
        ("target", D, D, True): LAYERS,
        ("target", D, FFN, False): LAYERS, ("target", FFN, D, False): LAYERS,
    }
    assert dict(calls) == expect


def test_rows_and_step_totals(tmp_path):
    out = tmp_path / "fp8.json"
    rows, steps, calls = fp8_linear.main(
        ["--arch", "ls_transformer", "--model-args", TINY, "--tokens", "24", "40",
         "--iters", "1", "--device", "cpu", "--dtype", "bf16", "--json", str(out)])
    shapes = {(k, n, b) for (_, k, n, b) in calls}
    assert len(rows) == 2 * len(shapes) and len(steps) == 2
    for row in rows:
        assert row["path"] == "reference"
        parts = sum(row[p] for p in fp8_linear.PARTS)
        assert row["rest"] == pytest.approx(row["linear_fp8"] - parts)
        assert (row["bias_grad"] > 0) == row["bias"]
    for step in steps:
        mine = [r for r in rows if r["tokens"] == step["tokens"]]
        assert sum(r["calls"] for r in mine) == sum(calls.values())
        for key in ("linear_16bit", "linear_fp8", "gemms_16bit", *fp8_linear.PARTS, "rest"):
            assert step[key] == pytest.approx(sum(r["calls"] * r[key] for r in mine)), key
    data = results.load(str(out))
    assert data["rows"] == rows and data["device"] == "cpu" and data["steps"] == steps
    assert data["script"] == "bench/kernels.py"
    assert data["command"].startswith("python bench/kernels.py fp8_linear --arch ls_transformer")
    assert sum(c["calls"] for c in data["calls"]) == sum(calls.values())


def test_cuda_without_a_gpu_is_an_error(capsys):
    if fp8_linear.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        kernels.main(["fp8_linear", "--arch", "ls_transformer", "--model-args", TINY])
    assert "--device cuda: no GPU here" in capsys.readouterr().err


def test_the_sub_commands(capsys):
    """bench/kernels.py lists its sub-commands without importing them; a wrong name is a
    one-line error; each sub-command's module has a main(argv)."""
    import importlib

    assert kernels.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"``{name}``" in out for name in kernels.SUBCOMMANDS)
    with pytest.raises(SystemExit, match="unknown sub-command 'nope'"):
        kernels.main(["nope"])
    for name in kernels.SUBCOMMANDS:
        assert callable(importlib.import_module(f"benchlib.kernels.{name}").main)
