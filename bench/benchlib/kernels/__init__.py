"""The per-kernel micro-benchmarks behind ``bench/kernels.py NAME``: each module has a
``main(argv)`` and says at its top what it measures. They import torch and ls_fairseq at module
level (the dispatcher imports only the one asked for)."""

#: sub-command -> what it measures (``bench/kernels.py --help`` lists these without torch)
SUBCOMMANDS = {
    "elementwise": "LayerNorm, bias+dropout+residual, bias+act+dropout, embedding: forward and "
                   "backward against PyTorch eager, GB/s at minimal traffic, % of a device copy",
    "layer_norm_bwd": "the fused pre-LN boundary backward and layer_norm_bwd at C = 1024: ms and "
                      "TB/s (run from two trees to compare)",
    "attention": "attention core or block forward + backward: the short, efficient and softmax "
                 "backends against fairseq's paths",
    "cross_entropy": "label-smoothed cross-entropy forward + backward against fairseq's path; "
                     "output projection + CE fused and chunked",
    "adam": "one Adam step over a transformer-big-sized model against the 28 B/parameter floor, "
            "and fairseq's whole optimizer phase with adam and ls_adam",
    "fp8_linear": "--ls-fp8's linear layer against the 16-bit one per linear shape of the model, "
                  "summed over a step, the FP8 time split into its parts (--json: results)",
}
