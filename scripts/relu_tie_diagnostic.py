"""GPU diagnostic: are fp16 whole-model gradient mismatches ReLU ties?

For tests/gpu/test_model_cuda.py's pre_ln_t2t config with ReLU, run the ls_ model in fp16 and
fairseq in fp32 (the truth), record each feed-forward block's input in both, and print per layer:
how many (position, unit) pre-activations have opposite signs, the largest |pre-activation| among
them, and fc1.weight's gradient error over all units and over the units that did not flip.

    source .gpu/setup.sh && PYTHONPATH=tests:tests/gpu:$PYTHONPATH LS_FAIRSEQ_KERNELS=require \
        python scripts/relu_tie_diagnostic.py

(tests/ and tests/gpu/ on PYTHONPATH: it drives tests/gpu/test_model_cuda.py's own cases.)

Records the inputs by wrapping ls_fairseq.modules.sublayers.feed_forward (this script only).
"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from ls_fairseq.testing.fairseq_helpers import make_dictionary
try:
    import test_model_cuda as T
except ModuleNotFoundError as e:
    sys.exit(f"{e}: run from the repository root with PYTHONPATH=tests:tests/gpu (see the docstring)")
from ls_fairseq.modules import encoder_layer as EL, decoder_layer as DL

d = make_dictionary(203)
rec = {}
orig = EL.feed_forward
def ff(layer, x, residual):
    rec[id(layer)] = x.detach().float()
    return orig(layer, x, residual)
EL.feed_forward = ff; DL.feed_forward = ff

def check(name, shape, backend, seed):
    os.environ["LS_FAIRSEQ_ATTENTION"] = backend
    # the config's own activation (ReLU), and the batches of tests/gpu/test_model_cuda.py (generator seed sum(shape))
    truth, _, ls, batch, up = T.build_case(d, name, torch.float16, shape, seed, batch_seed=sum(shape))
    src, _, prev = batch
    tin = {}
    for n, m in truth.named_modules():
        if n.endswith("fc1"):
            m.register_forward_hook(lambda mod, i, o, n=n: tin.__setitem__(n, i[0].detach().float().transpose(0, 1)))
    T._run(truth, batch, up); rec.clear(); T._run(ls, batch, up)
    lsmods = dict(ls.named_modules()); tp = dict(truth.named_parameters()); lp = dict(ls.named_parameters())
    for n, xt in tin.items():
        layer = n[: -len(".fc1")]
        xl = rec[id(lsmods[layer])]
        nonpad = (src if layer.startswith("encoder") else prev).ne(d.pad())
        W, b = tp[n + ".weight"].float(), tp[n + ".bias"].float()
        ht, hl = xt @ W.t() + b, xl @ W.t() + b
        flip = ((ht > 0) != (hl > 0)) & nonpad[..., None]
        gt, gl = tp[n + ".weight"].grad.double(), lp[n + ".weight"].grad.double()
        err = (gl - gt).abs().max(dim=1).values / gt.abs().max()
        units = flip.any(dim=0).any(dim=0)
        rest = float(err[~units].max()) if (~units).any() else 0.0
        print(f"  {backend:9s} {n}: flips {int(flip.sum())} (units {units.nonzero().flatten().tolist()}),"
              f" max |h_truth| at flips {float(ht[flip].abs().max()) if flip.any() else 0:.1e};"
              f" fc1.weight err all units {float(err.max()):.2e}, without flipped units {rest:.2e}")

for seed, shape in [(11, (8, 37, 29)), (13, (8, 37, 29))]:
    print("pre_ln_t2t", shape, "seed", seed)
    for be in ("short", "efficient", "softmax"):
        check("pre_ln_t2t", shape, be, seed)
