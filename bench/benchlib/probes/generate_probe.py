"""fairseq-generate in this interpreter, recording the dtype(s) of the loaded models' weights after
decoding (``BENCH_MODEL_DTYPE``) and the peak allocated GPU memory (``BENCH_PEAK_BYTES``):
whatever a side's --fp16/--bf16 did to the model shows in bench/generate.py's row.

    python bench/benchlib/probes/generate_probe.py DATA --path CKPT ...   # fairseq-generate's args
"""
import atexit
import sys

from fairseq import checkpoint_utils

_load, _models = checkpoint_utils.load_model_ensemble, []


def _capture(*a, **k):
    models, cfg = _load(*a, **k)
    _models.extend(models)
    return models, cfg


def _report():
    import torch

    dtypes = sorted({str(p.dtype).replace("torch.", "") for m in _models for p in m.parameters()})
    print("BENCH_MODEL_DTYPE", ",".join(dtypes) or "unknown", flush=True)
    if torch.cuda.is_initialized():
        print("BENCH_PEAK_BYTES", torch.cuda.max_memory_allocated(), flush=True)


if __name__ == "__main__":
    checkpoint_utils.load_model_ensemble = _capture
    atexit.register(_report)
    from fairseq_cli.generate import cli_main

    sys.argv[0] = "fairseq-generate"
    cli_main()
