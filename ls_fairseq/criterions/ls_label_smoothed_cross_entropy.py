"""``ls_label_smoothed_cross_entropy``: fairseq's label-smoothed CE computed from the logits.

Same options, formula, sample size and logged fields as fairseq's
``label_smoothed_cross_entropy`` (it subclasses it); the loss runs through the fused op, which on
the GPU never builds the fp32 [tokens x vocab] log-probability tensor fairseq's path allocates.
"""
from dataclasses import dataclass

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from .. import ops


@dataclass
class LSLabelSmoothedCrossEntropyCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    pass


@register_criterion(
    "ls_label_smoothed_cross_entropy", dataclass=LSLabelSmoothedCrossEntropyCriterionConfig
)
class LSLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size,
                         report_accuracy)

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
