"""``ls_label_smoothed_cross_entropy``: fairseq's label-smoothed CE computed from the logits.

Same options, formula, sample size and logged fields as fairseq's
``label_smoothed_cross_entropy`` (it subclasses it); the loss runs through the fused op, which on
the GPU never builds the fp32 [tokens x vocab] log-probability tensor fairseq's path allocates.
On the GPU the gradient is written over the logits buffer (nothing else needs it) and the
``--report-accuracy`` argmax comes out of the same pass over the logits.

``--ls-fused-output-ce`` (opt-in) goes further: the decoder returns its features
(``features_only=True``) and the output projection + loss run chunk by chunk over the tokens
(``ls_fairseq.ops.fused_output_cross_entropy``), so the [tokens x vocab] logits never exist.
It needs a decoder whose output layer is ``decoder.output_projection`` (no adaptive softmax).

CUDA graphs (on by default where they apply; ``--ls-no-cuda-graphs`` off, ``--ls-cuda-graphs``
required: ``ls_fairseq.switches``) replay the training forward and backward of each batch shape
(``ls_fairseq.graphs.CudaGraphedLoss``): the same kernels, issued without Python's per-kernel cost.
They step aside, with one log line, for a model other than ``ls_transformer`` and on the CPU;
``--ls-cuda-graphs`` on the CPU is refused before training (``check_run``, which fairseq-train
runs through ``fairseq_patches``, patch 9, for every flag of this criterion). On several GPUs
they work under fairseq's DDP backends (torch DDP, the default, and legacy_ddp/no_c10d) and
all-reduce the gradients while the backward runs.
``--ls-cuda-graphs-capture`` says when a new shape is captured: at its first sighting (``auto``
when batches are padded to bucketed shapes, which recur) or at its second (``auto`` otherwise:
one-off shapes then never pay for a capture). ``--ls-cuda-graphs-memory compact`` (the default)
keeps the graphs' memory pool one arena and gives the eager steps' idle cache back to the driver
(``graphs.memory``).

``--ls-shape-buckets N`` (with the graphs; 16 unless set, 0: off) pads each training
batch up to one of a few hundred shapes (``graphs.shape_buckets``), so the graphs of a WMT14-sized
corpus are replayed from the first epoch on instead of thrashing over its thousands of batch shapes.
Losses, gradients and logged values are those of the unpadded batch.

Async stats (several GPUs; on by default, ``--ls-no-async-stats`` off, ``--ls-async-stats``
required) take fairseq's per-update exchanges between workers (the logged values, the grad-norm
agreement check) off the GPU's critical path (``ls_fairseq.distributed.async_stats``).

Training logging outputs carry ``ls_flops``, the batch's model FLOPs (``ls_fairseq.flops``), and
``reduce_metrics`` logs ``tflops`` and ``mfu`` from them beside fairseq's ``wps``.
"""
import functools
import logging
import types
from dataclasses import dataclass, field

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.dataclass import ChoiceEnum
from fairseq.logging import metrics

from .. import ops, switches, training_config
from ..workers import several_workers
from ..distributed import peer_all_reduce
from ..flops import TransformerFlops, device_peak_tflops
from ..graphs import (
    CAPTURE_CHOICES, MEMORY_CHOICES, CudaGraphedLoss, captures_first_sighting, shape_buckets,
)
from ..ops.fused_output_cross_entropy import fused_output_cross_entropy
from .host_scalars import for_logging, to_host

logger = logging.getLogger(__name__)


@dataclass
class LSLabelSmoothedCrossEntropyCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    ls_fused_output_ce: bool = field(
        default=False,
        metadata={"help": "compute the output projection and the loss chunk by chunk over the "
                  "tokens without materialising the [tokens x vocab] logits"},
    )
    ls_fused_output_ce_chunk: int = field(
        default=0, metadata={"help": "tokens per chunk for --ls-fused-output-ce (0: about "
                             "256 MiB of logits per chunk)"},
    )
    ls_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "require CUDA graphs (on by default where they apply: an ls_transformer "
                  "on a GPU): the training forward+backward of "
                  "each batch shape is replayed as CUDA graphs, captured as "
                  "--ls-cuda-graphs-capture says; with this flag a run where they cannot apply "
                  "is refused"},
    )
    ls_no_cuda_graphs: bool = field(
        default=False, metadata={"help": "turn CUDA graphs off (every training step runs "
                                 "eagerly; no batch padding to bucketed shapes)"},
    )
    ls_cuda_graphs_capture: ChoiceEnum(list(CAPTURE_CHOICES)) = field(
        default="auto",
        metadata={"help": "with --ls-cuda-graphs: capture a batch shape at its first sighting "
                  "(unless it is larger in some dimension than every step so far: then at its "
                  "second) or at its second sighting (the first runs eagerly); auto: first "
                  "when batches are padded to bucketed shapes (--ls-shape-buckets), else second"},
    )
    ls_cuda_graphs_memory: ChoiceEnum(list(MEMORY_CHOICES)) = field(
        default="compact",
        metadata={"help": "with --ls-cuda-graphs: compact: the graphs' memory pool is one arena "
                  "sized from the warm-up step, and the allocator's cache of eager steps is "
                  "given back to the driver after them; grow: PyTorch's default (the pool grows "
                  "segment by segment, eager steps keep their cache)"},
    )
    ls_cuda_graphs_max: int = field(
        default=256, metadata={"help": "most batch shapes kept captured by --ls-cuda-graphs "
                               "(least recently used dropped)"},
    )
    ls_shape_buckets: int = field(
        default=16, metadata={"help": "with --ls-cuda-graphs: pad each training batch up to a "
                              "shape on a grid with this many steps per doubling of its batch "
                              "size, source and target length, or to an earlier batch's padded "
                              "shape within --ls-shape-bucket-slack, so few shapes are captured "
                              "(a power of two; 0: no padding, one graph per batch shape)"},
    )
    ls_shape_bucket_slack: float = field(
        default=0.2, metadata={"help": "with --ls-shape-buckets: a batch reuses an earlier "
                               "padded shape if that costs at most this fraction more token "
                               "slots (source + target positions) than the batch's own shape"},
    )
    ls_all_reduce_bucket_mb: float = field(
        default=25.0, metadata={"help": "with --ls-cuda-graphs on several GPUs: all-reduce the "
                                "gradients in buckets of about this many MB while the backward "
                                "runs (0: all at once after the backward)"},
    )
    ls_async_stats: bool = field(
        default=False,
        metadata={"help": "require async stats (on by default on several GPUs of plain data "
                  "parallelism): gather the logged values over a CPU (gloo) group and compare "
                  "the workers' grad norms one update late, so fairseq's train_step does not "
                  "wait for the GPU (wraps two fairseq Trainer methods; "
                  "ls_fairseq/distributed/async_stats.py); with this flag a run where they cannot "
                  "apply is refused"},
    )
    ls_no_async_stats: bool = field(
        default=False,
        metadata={"help": "turn async stats off: fairseq's own exchanges, which wait for the "
                  "GPU every update (the deferred overflow check is then off on several GPUs "
                  "too)"},
    )
    ls_fix_batches_to_gpus: bool = field(
        default=False,
        metadata={"help": "require batches fixed to GPUs (on by default on several GPUs of "
                  "plain data parallelism): GPU r keeps batches r, r + N, ... of fairseq's "
                  "length-ordered batches and shuffles them itself each epoch, fairseq's "
                  "--fix-batches-to-gpus order, so an update still pairs batches at random as "
                  "in fairseq's order while each GPU keeps meeting the batch shapes its CUDA "
                  "graphs hold (ls_fairseq/fairseq_patches, patch 7); with this flag a run "
                  "where they cannot apply is refused"},
    )
    ls_no_fix_batches_to_gpus: bool = field(
        default=False,
        metadata={"help": "turn batches fixed to GPUs off: fairseq's order (each epoch's "
                  "shuffled batches dealt to the GPUs in turn)"},
    )
    ls_cost_matching_window: int = field(
        default=0,
        metadata={"help": "with batches fixed to GPUs: in each run of this many updates, order "
                  "every GPU's batches so that an update's batches have alike token slots "
                  "(the first GPU's order kept; the k-th costliest batch of each GPU meet), so "
                  "the GPUs wait less for the slowest; an update's batches then also tend to "
                  "be alike in length (ls_fairseq/fairseq_patches, patch 7). 0 or 1: off, "
                  "an update pairs batches at random"},
    )
    ls_copy_engine_all_reduce: bool = field(
        default=False,
        metadata={"help": "require the copy-engine all-reduce (on by default with "
                  "--ls-cuda-graphs on several GPUs of one host): the GPUs write the gradient "
                  "buckets into each other's memory with their copy engines and each sums one "
                  "shard, instead of NCCL's kernels, which take SMs from the backward "
                  "(ls_fairseq/distributed/peer_all_reduce.py); with this flag a run where it "
                  "cannot apply is refused"},
    )
    ls_no_copy_engine_all_reduce: bool = field(
        default=False,
        metadata={"help": "turn the copy-engine all-reduce off: NCCL's all-reduce of each "
                  "gradient bucket"},
    )


def log_model_flops(flops: float) -> None:
    """Log ``tflops`` (model TFLOP/s: the interval's model FLOPs over fairseq's wps clock) and,
    on a GPU of known peak, ``mfu`` (percent of the dense 16-bit peak of all the run's GPUs)
    beside fairseq's ``wps``; the FLOPs are summed in a hidden meter."""
    metrics.log_scalar_sum("_ls_flops", flops, round=0)
    peak = device_peak_tflops(torch.cuda.current_device()) if torch.cuda.is_available() else None
    gpus = torch.distributed.get_world_size() if several_workers() else 1
    metrics.log_derived("tflops", functools.partial(_tflops, scale=1.0), priority=91)
    if peak:
        metrics.log_derived("mfu", functools.partial(_tflops, scale=100.0 / (peak * gpus)),
                            priority=92)


def _tflops(meters, scale):
    """``scale`` × model TFLOP/s over the time of the aggregation's ``wps`` meter.

    ``wps.elapsed_time`` is a running clock, and ``tflops`` and ``mfu`` are derived one after the
    other: the clock is read once per log event (kept on the FLOPs meter, keyed by what changes
    between events), so both divide by the same seconds."""
    wps, flops = meters.get("wps"), meters.get("_ls_flops")
    if wps is None or flops is None:
        return 0.0
    key = (getattr(wps, "n", None), getattr(wps, "start", None), flops.sum)
    read = getattr(flops, "_ls_clock", None)
    if read is None or read[0] != key:
        read = (key, getattr(wps, "elapsed_time", 0))
        flops._ls_clock = read
    seconds = read[1]
    if not seconds or seconds <= 0:
        return 0.0
    return round(scale * flops.sum / seconds / 1e12, 1)


@register_criterion(
    "ls_label_smoothed_cross_entropy", dataclass=LSLabelSmoothedCrossEntropyCriterionConfig
)
class LSLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, ls_fused_output_ce=False, ls_fused_output_ce_chunk=0,
                 ls_cuda_graphs=False, ls_no_cuda_graphs=False, ls_cuda_graphs_capture="auto",
                 ls_cuda_graphs_memory="compact", ls_cuda_graphs_max=256,
                 ls_shape_buckets=16, ls_shape_bucket_slack=0.2, ls_all_reduce_bucket_mb=25.0,
                 ls_async_stats=False, ls_no_async_stats=False,
                 ls_fix_batches_to_gpus=False, ls_no_fix_batches_to_gpus=False,
                 ls_cost_matching_window=0, ls_copy_engine_all_reduce=False,
                 ls_no_copy_engine_all_reduce=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size,
                         report_accuracy)
        flags = types.SimpleNamespace(**{k: v for k, v in locals().items()
                                         if k.startswith("ls_")})  # the arguments above
        self.shape_buckets = None

        def check_shape_buckets():  # graphs on: their padding, checked in the config's order
            self.shape_buckets = self._shape_buckets(task, ls_shape_buckets,
                                                     ls_shape_bucket_slack)

        # every flag resolved and refused once, as the run's TrainingConfig reads it
        modes = training_config.criterion_switches(flags, check_shape_buckets)
        self.ls_fused_output_ce = ls_fused_output_ce
        self.ls_fused_output_ce_chunk = ls_fused_output_ce_chunk or None
        graphs, copy_engine = modes["ls_cuda_graphs"], modes["ls_copy_engine_all_reduce"]
        first_sighting = captures_first_sighting(str(ls_cuda_graphs_capture),
                                                 padded=self.shape_buckets is not None)
        self.graphs = CudaGraphedLoss(
            max_graphs=ls_cuda_graphs_max, bucket_mb=ls_all_reduce_bucket_mb,
            capture_first_sighting=first_sighting, memory=str(ls_cuda_graphs_memory),
            required=graphs == switches.ON,
            copy_engine=copy_engine) if graphs != switches.OFF else None
        self._flops_of = (None, None)  # (model, its TransformerFlops), see _model_flops
        # the modes its check_run reads; the trainer's patches read the run's TrainingConfig
        self.ls_async_stats = modes["ls_async_stats"]
        self.ls_fix_batches_to_gpus = modes["ls_fix_batches_to_gpus"]
        self.ls_cost_matching_window = modes["ls_cost_matching_window"]

    def check_run(self, cfg, run: switches.RunFacts, model=None) -> None:
        """Before training (``fairseq_patches``, patch 9, with the trainer's whole ``cfg`` and its
        ``model``): refuses each mechanism of this criterion that the user asked for
        (``--ls-X``) and that cannot apply to ``run``. On the CPU the CUDA graphs step aside for
        the run, with their one line. The rest is decided where each mechanism starts (several
        GPUs: with every rank)."""
        if self.ls_fused_output_ce and model is not None:
            self._output_projection(model)
        if self.graphs is not None and not run.cuda:
            self.graphs.off_for_run("the model trains on the CPU (--cpu, or no CUDA GPU visible "
                                    "to torch), and CUDA graphs need a GPU")
        if self.graphs is not None and self.graphs.copy_engine == switches.ON:
            reason = peer_all_reduce.run_conflict(run)
            if reason:
                raise switches.refusal(peer_all_reduce.FLAG, reason)
        data_parallel = switches.data_parallel_conflict(run.workers, run.processes)
        if data_parallel == "":
            data_parallel = switches.ONE_PROCESS
        if self.ls_async_stats == switches.ON and data_parallel:
            raise switches.refusal("--ls-async-stats", data_parallel)
        grouped = getattr(getattr(cfg, "dataset", None), "grouped_shuffling", False)
        fixed = data_parallel or (
            "fairseq's --grouped-shuffling, given too, orders the batches instead" if grouped else
            "" if self.ls_fix_batches_to_gpus != switches.OFF else
            "--ls-no-fix-batches-to-gpus turns it off")
        if self.ls_fix_batches_to_gpus == switches.ON and fixed:
            raise switches.refusal("--ls-fix-batches-to-gpus", fixed)
        if self.ls_cost_matching_window > 1 and fixed:
            raise switches.refusal("--ls-cost-matching-window",
                                   f"it orders the batches fixed to GPUs, which cannot apply: "
                                   f"{fixed}")

    @staticmethod
    def _shape_buckets(task, steps, slack):
        """The ``ShapeBuckets`` of --ls-shape-buckets, or None (0, or a task it cannot pad)."""
        buckets = shape_buckets.ShapeBuckets(steps, slack)  # checks the flags, whatever the task
        if steps == 0:
            return None
        cfg = getattr(task, "cfg", None)
        left_pad_source = getattr(cfg, "left_pad_source", None)
        src_dict = getattr(task, "source_dictionary", None)
        tgt_dict = getattr(task, "target_dictionary", None)
        if not isinstance(left_pad_source, bool) or getattr(cfg, "left_pad_target", False) or \
                src_dict is None or tgt_dict is None:
            logger.warning(
                "--ls-shape-buckets: batches are not padded (not a translation task that "
                "right-pads its targets); --ls-cuda-graphs captures one graph per batch shape. "
                "Pass --ls-shape-buckets 0 to silence this.")
            return None
        buckets.tokens = shape_buckets.Tokens(src_dict.pad(), src_dict.eos(), tgt_dict.pad(),
                                              tgt_dict.eos(), left_pad_source)
        return buckets

    def _padded(self, model, sample):
        """The training batch padded up to its bucketed shape (``shape_buckets``), or as is."""
        if self.shape_buckets is None or not (model.training and torch.is_grad_enabled()):
            return sample
        return self.shape_buckets.pad(sample)

    def _logging_output(self, loss, nll_loss, sample, n_correct=None, total=None):
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        # the logged scalars start their way to the host now (see reduce_metrics)
        logging_output = {
            "loss": for_logging(loss.data),
            "nll_loss": for_logging(nll_loss.data),
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if self.report_accuracy:  # fairseq reads these back in forward; here in reduce_metrics
            logging_output["n_correct"] = for_logging(n_correct.data)
            logging_output["total"] = for_logging(total.data)
        return sample_size, logging_output

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        """False: with several GPUs fairseq then gathers the logged values as Python numbers
        (``all_gather_list``) instead of summing them into CUDA tensors, whose reads in
        ``reduce_metrics`` would wait for the optimizer step (``host_scalars``)."""
        return False

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        """fairseq's, on the host copies of the logged scalars (``host_scalars``): the trainer
        calls this after queuing the optimizer step, and reading the CUDA scalars here would
        wait for that step. Same formulas and rounding; sums in double precision."""
        logging_outputs = [{k: to_host(v) for k, v in log.items()} for log in logging_outputs]
        super().reduce_metrics(logging_outputs)
        flops = sum(float(log.get("ls_flops", 0)) for log in logging_outputs)
        if flops > 0:
            log_model_flops(flops)

    def forward(self, model, sample, reduce=True):
        if not reduce:  # per-token losses: fairseq's own path
            return super().forward(model, sample, reduce=False)
        if self.graphs is not None and model.training and torch.is_grad_enabled() and \
                self.graphs.applies(model, sample):
            # logged values below come from the unpadded batch
            loss, nll_loss, n_correct, total = self.graphs(model, self._padded(model, sample),
                                                           self._losses)
        else:
            loss, nll_loss, n_correct, total = self._losses(model, sample)
        sample_size, logging_output = self._logging_output(loss, nll_loss, sample, n_correct,
                                                           total)
        if model.training:
            flops = self._model_flops(model, sample)
            if flops is not None:
                logging_output["ls_flops"] = for_logging(flops)
        return loss, sample_size, logging_output

    def _model_flops(self, model, sample):
        """The batch's model training FLOPs (``ls_fairseq.flops``: real tokens, from the
        architecture's dimensions) as a device tensor, or None for a model or task without
        them."""
        if self._flops_of[0] is not model:  # the formula depends on the model's dimensions only
            self._flops_of = (model, TransformerFlops.of_model(model))
        flops, src_lengths = self._flops_of[1], sample["net_input"].get("src_lengths")
        if flops is None or not torch.is_tensor(src_lengths):
            return None
        return flops.of_lengths(src_lengths, sample["target"].ne(self.padding_idx).sum(1))

    def _losses(self, model, sample):
        """(loss, nll_loss, n_correct, total) summed over the batch; the last two are None
        without --report-accuracy. Tensor work only: no host synchronisation (graph-capturable)."""
        if self.ls_fused_output_ce:
            return self._losses_fused_output(model, sample)
        net_output = model(**sample["net_input"])
        logits, target = self.get_logits_and_target(model, net_output, sample)
        # one pass for loss, nll and argmax; on the GPU the backward overwrites the logits buffer
        loss_rows, nll_rows, argmax = ops.label_smoothed_cross_entropy_rows(
            logits, target, self.eps, self.padding_idx, compute_argmax=self.report_accuracy,
            inplace_backward=True)
        del net_output, logits
        n_correct = total = None
        if self.report_accuracy:
            mask = target.ne(self.padding_idx)
            n_correct, total = (argmax.eq(target) & mask).sum(), mask.sum()
        return loss_rows.sum(), nll_rows.sum(), n_correct, total

    @staticmethod
    def _output_projection(model):
        """The decoder's output projection that --ls-fused-output-ce multiplies by; refused for
        a model without a bias-free one."""
        decoder = getattr(model, "decoder", None)
        projection = getattr(decoder, "output_projection", None)
        if projection is None or getattr(decoder, "adaptive_softmax", None) is not None or \
                getattr(projection, "bias", None) is not None:
            raise switches.Refused("--ls-fused-output-ce needs a decoder with a bias-free "
                                   "decoder.output_projection (no adaptive softmax); drop "
                                   "--ls-fused-output-ce to train without it")
        return projection

    def _losses_fused_output(self, model, sample):
        projection = self._output_projection(model)
        features, extra = model(**sample["net_input"], features_only=True)
        target = model.get_targets(sample, (features, extra))
        if self.ignore_prefix_size > 0:
            features = features[:, self.ignore_prefix_size:, :]
            target = target[:, self.ignore_prefix_size:]
        loss, nll_loss, n_correct = fused_output_cross_entropy(
            features, projection.weight, target, self.eps, self.padding_idx,
            chunk_size=self.ls_fused_output_ce_chunk, compute_accuracy=self.report_accuracy)
        total = target.ne(self.padding_idx).sum() if self.report_accuracy else None
        return loss, nll_loss, n_correct, total

    def get_logits_and_target(self, model, net_output, sample):
        logits = net_output[0]
        target = model.get_targets(sample, net_output)
        if self.ignore_prefix_size > 0:
            logits = logits[:, self.ignore_prefix_size:, :]
            target = target[:, self.ignore_prefix_size:]
        return logits.reshape(-1, logits.size(-1)), target.reshape(-1)

    def compute_loss(self, model, net_output, sample, reduce=True):
        if not reduce:  # per-token losses: fairseq's own path
            return super().compute_loss(model, net_output, sample, reduce=False)
        logits, target = self.get_logits_and_target(model, net_output, sample)
        return ops.label_smoothed_cross_entropy(logits, target, self.eps, self.padding_idx)

    def compute_accuracy(self, model, net_output, sample):
        # argmax of the logits is the argmax of the log-probabilities
        logits, target = self.get_logits_and_target(model, net_output, sample)
        mask = target.ne(self.padding_idx)
        n_correct = torch.sum(logits.argmax(1).masked_select(mask).eq(target.masked_select(mask)))
        return n_correct, torch.sum(mask)
