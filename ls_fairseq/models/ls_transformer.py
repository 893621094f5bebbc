"""The ``ls_transformer`` model and its ``ls_`` architectures.

A drop-in for fairseq's ``transformer``: same command-line options, same architecture defaults,
same state_dict keys and shapes (checkpoints move between the two with
``ls-fairseq-convert``), same initial weights for the same ``--seed``. The encoder and decoder are
built from :mod:`ls_fairseq.modules`, whose layers run the fused ops; the decoder projects the
encoder output to the cross-attention keys/values of all its layers in one GEMM.
"""
import argparse
import functools
import importlib.util
import logging
import math
from typing import Dict, FrozenSet, List, Optional

import torch
import torch.nn as nn
from fairseq.models import (
    BaseFairseqModel,
    FairseqEncoder,
    FairseqIncrementalDecoder,
    register_model,
    register_model_architecture,
)
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer import transformer_legacy as fairseq_archs
from fairseq.modules import PositionalEmbedding
from torch import Tensor

from ..modules import (
    LayerBatchedEncoderKV,
    LayerNorm,
    SelfAttentionKVCache,
    TransformerDecoderLayer,
    TransformerEmbedding,
    TransformerEncoderLayer,
)
from ..modules.sublayers import next_norms
from ..switches import Refused

logger = logging.getLogger(__name__)

#: fairseq's set_num_updates implementations that only pass the call on to submodules
_FORWARDING_HOOKS = (BaseFairseqModel.set_num_updates, FairseqEncoder.set_num_updates)

#: fairseq transformer options this model does not implement, with the value that disables them.
_UNSUPPORTED = {
    "encoder.layerdrop": 0,
    "decoder.layerdrop": 0,
    "encoder.layers_to_keep": None,
    "decoder.layers_to_keep": None,
    "encoder.xformers_att_config": None,
    "quant_noise.pq": 0,
    "quant_noise.scalar": 0,
    "adaptive_input": False,
    "adaptive_softmax_cutoff": None,
    "cross_self_attention": False,
    "no_cross_attention": False,
    "checkpoint_activations": False,
    "offload_activations": False,
    "char_inputs": False,
    "base_layers": 0,
}


def _as_config(cfg) -> TransformerConfig:
    return cfg if isinstance(cfg, TransformerConfig) else TransformerConfig.from_namespace(cfg)


def check_supported(cfg: TransformerConfig):
    """Reject options ls_transformer does not implement, naming the flag (never a wrong result)."""
    for path, off in _UNSUPPORTED.items():
        value = cfg
        for part in path.split("."):
            value = getattr(value, part, off)
        if value != off and not (off == 0 and not value):
            flag = "--" + path.replace(".", "-").replace("_", "-")
            raise Refused(
                f"ls_transformer does not support {flag}={value!r}; train with fairseq's "
                "transformer for this option"
            )


def _activation_dropout(cfg: TransformerConfig) -> float:
    # fairseq: --activation-dropout, falling back to the older --relu-dropout when it is 0
    return float(cfg.activation_dropout or getattr(cfg, "relu_dropout", 0) or 0)


def _embed_scale(cfg: TransformerConfig, embed_dim: int) -> float:
    return 1.0 if cfg.no_scale_embedding else math.sqrt(embed_dim)


#: what ``--ls-fp8-layers`` may name: the attention projections (self and cross) and the FFN
FP8_LAYERS = ("attention", "ffn")


def _fp8_layer_names(value: str) -> List[str]:
    """``--ls-fp8-layers``' names, checked: ValueError on an unknown name or an empty list."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in FP8_LAYERS]
    if unknown or not names:
        raise ValueError(f"{value!r}: a comma-separated list of {', '.join(FP8_LAYERS)} "
                         f"(unknown: {', '.join(unknown) or 'none given'})")
    return names


def _fp8_layers_arg(value: str) -> str:
    """argparse type of ``--ls-fp8-layers``: a bad list is a usage error at parse time."""
    try:
        _fp8_layer_names(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def fp8_layers(cfg) -> FrozenSet[str]:
    """The parts of each layer whose linear layers run in FP8: ``--ls-fp8`` with
    ``--ls-fp8-layers`` (all of :data:`FP8_LAYERS` when not given; checkpoints written before
    these options existed have neither: none). A bad list is an error naming the flag."""
    given = getattr(cfg, "ls_fp8_layers", None)
    if not getattr(cfg, "ls_fp8", False):
        if given is not None:
            raise Refused(f"--ls-fp8-layers {given!r} needs --ls-fp8")
        return frozenset()
    if given is None:
        return frozenset(FP8_LAYERS)
    try:
        return frozenset(_fp8_layer_names(given))
    except ValueError as e:
        raise Refused(f"--ls-fp8-layers {e}") from None


class LSTransformerEncoder(FairseqEncoder):
    """fairseq's ``TransformerEncoderBase`` interface and parameters, with fused layers."""

    def __init__(self, cfg: TransformerConfig, dictionary, embed_tokens: nn.Embedding):
        self.cfg = cfg
        super().__init__(dictionary)
        self.register_buffer("version", torch.Tensor([3]))
        embed_dim = embed_tokens.embedding_dim
        self.padding_idx = embed_tokens.padding_idx
        self.max_source_positions = cfg.max_source_positions
        self.embed_tokens = embed_tokens
        self.embed_positions = (
            PositionalEmbedding(cfg.max_source_positions, embed_dim, self.padding_idx,
                                learned=cfg.encoder.learned_pos)
            if not cfg.no_token_positional_embeddings else None
        )
        self.layernorm_embedding = LayerNorm(embed_dim) if cfg.layernorm_embedding else None
        self.embedding = TransformerEmbedding(
            embed_dim, self.padding_idx, _embed_scale(cfg, embed_dim), cfg.dropout, zero_pad=True,
            max_positions=cfg.max_source_positions, side="source",
        )
        fp8 = fp8_layers(cfg)
        self.layers = nn.ModuleList([
            TransformerEncoderLayer(
                embed_dim=cfg.encoder.embed_dim, ffn_embed_dim=cfg.encoder.ffn_embed_dim,
                num_heads=cfg.encoder.attention_heads, dropout=cfg.dropout,
                attention_dropout=cfg.attention_dropout,
                activation_dropout=_activation_dropout(cfg),
                activation_fn=cfg.activation_fn, normalize_before=cfg.encoder.normalize_before,
                fp8="ffn" in fp8, fp8_attention="attention" in fp8,
            )
            for _ in range(cfg.encoder.layers)
        ])
        self.num_layers = len(self.layers)
        self.layer_norm = LayerNorm(embed_dim) if cfg.encoder.normalize_before else None

    def forward(self, src_tokens, src_lengths: Optional[Tensor] = None,
                return_all_hiddens: bool = False, token_embeddings: Optional[Tensor] = None):
        if token_embeddings is not None:
            raise NotImplementedError("ls_transformer's encoder does not take token_embeddings")
        padding_mask = src_tokens.eq(self.padding_idx)
        x = self.embedding(src_tokens, self.embed_tokens, self.embed_positions,
                           self.layernorm_embedding)
        states = [x.transpose(0, 1)] if return_all_hiddens else []
        normed = None  # pre-LN: the LayerNorm of x that the previous layer's last kernel computed
        for layer, next_norm in zip(self.layers, next_norms(self.layers, self.layer_norm)):
            out = layer(x, padding_mask, normed=normed, next_norm=next_norm)
            x, normed = out if next_norm is not None else (out, None)
            if return_all_hiddens:
                states.append(x.transpose(0, 1))
        if self.layer_norm is not None:
            x = normed if normed is not None else self.layer_norm(x)
        src_lengths = src_tokens.ne(self.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1)
        return {
            "encoder_out": [x.transpose(0, 1)],  # T x B x C, as fairseq (a view of B x T x C)
            "encoder_padding_mask": [padding_mask],  # B x T
            "encoder_embedding": [],  # not kept: nothing in translation reads it
            "encoder_states": states,  # List[T x B x C]
            "fc_results": [],
            "src_tokens": [],
            "src_lengths": [src_lengths],
        }

    reorder_encoder_out = TransformerEncoderBase.reorder_encoder_out
    _reorder_encoder_out = TransformerEncoderBase._reorder_encoder_out
    upgrade_state_dict_named = TransformerEncoderBase.upgrade_state_dict_named

    def max_positions(self):
        if self.embed_positions is None:
            return self.max_source_positions
        return min(self.max_source_positions, self.embed_positions.max_positions)


class LSTransformerDecoder(FairseqIncrementalDecoder):
    """fairseq's ``TransformerDecoderBase`` interface and parameters, with fused layers and
    layer-batched cross-attention keys/values (cached once per sentence when decoding). When
    decoding, the self-attention keys/values of all layers live in one preallocated, growable
    buffer (:class:`~ls_fairseq.modules.kv_cache.SelfAttentionKVCache`) in ``incremental_state``."""

    def __init__(self, cfg: TransformerConfig, dictionary, embed_tokens: nn.Embedding):
        self.cfg = cfg
        super().__init__(dictionary)
        self.register_buffer("version", torch.Tensor([3]))
        self.share_input_output_embed = cfg.share_decoder_input_output_embed
        input_embed_dim = embed_tokens.embedding_dim
        embed_dim = cfg.decoder.embed_dim
        self.embed_dim = embed_dim
        self.output_embed_dim = cfg.decoder.output_dim
        self.padding_idx = embed_tokens.padding_idx
        self.max_target_positions = cfg.max_target_positions
        self.embed_tokens = embed_tokens
        self.project_in_dim = (
            _xavier_linear(input_embed_dim, embed_dim) if embed_dim != input_embed_dim else None
        )
        self.embed_positions = (
            PositionalEmbedding(cfg.max_target_positions, embed_dim, self.padding_idx,
                                learned=cfg.decoder.learned_pos)
            if not cfg.no_token_positional_embeddings else None
        )
        self.layernorm_embedding = LayerNorm(embed_dim) if cfg.layernorm_embedding else None
        self.embedding = TransformerEmbedding(
            embed_dim, self.padding_idx, _embed_scale(cfg, embed_dim), cfg.dropout,
            zero_pad=False, max_positions=cfg.max_target_positions, side="target",
        )
        fp8 = fp8_layers(cfg)
        self.layers = nn.ModuleList([
            TransformerDecoderLayer(
                embed_dim=embed_dim, ffn_embed_dim=cfg.decoder.ffn_embed_dim,
                num_heads=cfg.decoder.attention_heads, encoder_embed_dim=cfg.encoder.embed_dim,
                dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
                activation_dropout=_activation_dropout(cfg), activation_fn=cfg.activation_fn,
                normalize_before=cfg.decoder.normalize_before, fp8="ffn" in fp8,
                fp8_attention="attention" in fp8,
            )
            for _ in range(cfg.decoder.layers)
        ])
        self.num_layers = len(self.layers)
        self.encoder_kv = LayerBatchedEncoderKV()
        self.layer_norm = (
            LayerNorm(embed_dim)
            if cfg.decoder.normalize_before and not cfg.no_decoder_final_norm else None
        )
        self.project_out_dim = (
            _xavier_linear(embed_dim, self.output_embed_dim)
            if embed_dim != self.output_embed_dim else None
        )
        self.adaptive_softmax = None
        if self.share_input_output_embed:
            self.output_projection = nn.Linear(embed_tokens.weight.shape[1],
                                               embed_tokens.weight.shape[0], bias=False)
            self.output_projection.weight = embed_tokens.weight
        else:
            self.output_projection = nn.Linear(self.output_embed_dim, len(dictionary), bias=False)
            nn.init.normal_(self.output_projection.weight, mean=0,
                            std=self.output_embed_dim**-0.5)

    def forward(self, prev_output_tokens, encoder_out: Optional[Dict[str, List[Tensor]]] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                features_only: bool = False, full_context_alignment: bool = False,
                alignment_layer: Optional[int] = None, alignment_heads: Optional[int] = None,
                src_lengths: Optional[Tensor] = None, return_all_hiddens: bool = False,
                need_attn: bool = True):
        x, extra = self.extract_features(
            prev_output_tokens, encoder_out, incremental_state, full_context_alignment,
            alignment_layer, alignment_heads, need_attn=need_attn,
        )
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def _cross_kv(self, encoder_out: Tensor, incremental_state):
        """Per-layer cross-attention (k, v), and the row -> sentence index when they are stored
        once per sentence (else None); computed once per sentence when decoding."""
        attns = [layer.encoder_attn for layer in self.layers]
        if incremental_state is not None:
            cached = self.get_incremental_state(incremental_state, "encoder_kv")
            if cached is not None:
                return self.encoder_kv.split(cached["kv"]), cached.get("rows")
        kv = self.encoder_kv.project(encoder_out.transpose(0, 1), attns)
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "encoder_kv", {"kv": kv})
        return self.encoder_kv.split(kv), None

    def _self_kv_cache(self, incremental_state) -> SelfAttentionKVCache:
        """The self-attention keys/values of all layers, one buffer for the decoding run."""
        state = self.get_incremental_state(incremental_state, "self_kv")
        if state is None:
            state = {"cache": SelfAttentionKVCache(max(self.num_layers, 1))}
            self.set_incremental_state(incremental_state, "self_kv", state)
        return state["cache"]

    def extract_features(self, prev_output_tokens,
                         encoder_out: Optional[Dict[str, List[Tensor]]],
                         incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                         full_context_alignment: bool = False,
                         alignment_layer: Optional[int] = None,
                         alignment_heads: Optional[int] = None, need_attn: bool = True):
        """fairseq's ``extract_features``. ``need_attn=False`` skips the alignment layer's
        attention weights outside training (``ls_fairseq.generation`` does not use them).

        When decoding, ``incremental_state`` holds the self-attention cache: the decoder's own
        growable :class:`SelfAttentionKVCache`, or a :class:`StaticKVCache` that a fixed-shape
        generator put there (``prev_output_tokens`` is then the last tokens, [rows, 1]; the
        positions and padding mask come from the cache)."""
        if encoder_out is None or len(encoder_out["encoder_out"]) == 0:
            raise ValueError("ls_transformer's decoder needs the encoder output")
        # attention weights cost a full probability tensor: computed for generation (alignments,
        # --print-alignment) and when a caller asks for a layer explicitly, not in plain training
        need_attn_layer = alignment_layer
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1
            need_attn_layer = None if self.training or not need_attn else alignment_layer
        enc = encoder_out["encoder_out"][0]
        padding_mask = (encoder_out["encoder_padding_mask"][0]
                        if len(encoder_out["encoder_padding_mask"]) > 0 else None)
        incremental = incremental_state is not None
        cross_kv, cross_rows = self._cross_kv(enc, incremental_state)
        self_kv = [None] * self.num_layers

        positions, max_len = None, None
        if incremental:
            cache = self._self_kv_cache(incremental_state)
            self_kv = cache.layers
            tokens = prev_output_tokens[:, -1:]
            self_attn_padding_mask = cache.begin_step(tokens, self.padding_idx)
            positions = cache.positions(self.padding_idx)
            if positions is not None:
                max_len = cache.capacity
        x = self.embedding(prev_output_tokens, self.embed_tokens, self.embed_positions,
                           self.layernorm_embedding, self.project_in_dim, incremental=incremental,
                           positions=positions, max_len=max_len)
        if not incremental:  # always passed in training: no host sync, same math as fairseq's optional mask
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)

        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x.transpose(0, 1)]
        normed = None  # pre-LN: the LayerNorm of x that the previous layer's last kernel computed
        for idx, (layer, next_norm) in enumerate(zip(self.layers,
                                                     next_norms(self.layers, self.layer_norm))):
            out, layer_attn = layer(
                x, cross_kv[idx], padding_mask, self_attn_padding_mask, incremental_state,
                need_attn=(idx == need_attn_layer), causal=not full_context_alignment,
                normed=normed, next_norm=next_norm, self_attn_cache=self_kv[idx],
                encoder_rows=cross_rows,
            )
            x, normed = out if next_norm is not None else (out, None)
            inner_states.append(x.transpose(0, 1))
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.to(x)  # [B, H, T, S]
        if attn is not None:
            if alignment_heads is not None:
                attn = attn[:, :alignment_heads]
            attn = attn.mean(dim=1)
        if self.layer_norm is not None:
            x = normed if normed is not None else self.layer_norm(x)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [attn], "inner_states": inner_states}

    def output_layer(self, features):
        return self.output_projection(features)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        # self-attention keys/values of every layer: one gather (the layers keep no state)
        self_kv = self.get_incremental_state(incremental_state, "self_kv")
        if self_kv is not None:
            self_kv["cache"].reorder(new_order)
        cached = self.get_incremental_state(incremental_state, "encoder_kv")
        # Beams of one sentence share identical encoder keys/values, so a reorder that keeps the
        # batch size only permutes identical rows: skip the copy, as fairseq's MultiheadAttention
        # does for static keys. A shrinking batch (finished sentences) is gathered. Keys/values
        # stored once per sentence ("rows": each row's sentence) stay; the index is reordered.
        if cached is not None and cached.get("rows") is not None:
            cached["rows"] = cached["rows"].index_select(0, new_order)
            self.set_incremental_state(incremental_state, "encoder_kv", cached)
        elif cached is not None and cached["kv"].size(0) != new_order.size(0):
            cached["kv"] = cached["kv"].index_select(0, new_order)
            self.set_incremental_state(incremental_state, "encoder_kv", cached)

    def max_positions(self):
        if self.embed_positions is None:
            return self.max_target_positions
        return min(self.max_target_positions, self.embed_positions.max_positions)

    upgrade_state_dict_named = TransformerDecoderBase.upgrade_state_dict_named


def _xavier_linear(in_features, out_features):
    m = nn.Linear(in_features, out_features, bias=False)
    nn.init.xavier_uniform_(m.weight)
    return m


@register_model("ls_transformer")
class LSTransformerModel(TransformerModel):
    """fairseq's ``transformer`` with ls_fairseq's fused encoder and decoder.

    Same options as ``transformer`` (``fairseq-train --arch ls_transformer... --help``), plus
    ``--ls-fp8``."""

    #: its training step has no host synchronisation: the criterion's CUDA graphs may capture it
    supports_cuda_graphs = True

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument(
            # fairseq's model group suppresses absent options: the default is explicit
            "--ls-fp8", action="store_true", default=False,
            help="ls_ only: in training, the encoder and decoder layers' linear layers (attention "
                 "projections, FFN) multiply in FP8 (e4m3 operands, e5m2 output gradients, "
                 "per-tensor current scaling; torch._scaled_mm on GPUs of compute capability "
                 ">= 8.9). Weights, optimizer and checkpoints are unchanged, and evaluation and "
                 "generation use the normal matmuls (docs/FLAGS.md)")
        parser.add_argument(
            "--ls-fp8-layers", default=None, metavar="PARTS", type=_fp8_layers_arg,
            help="ls_ only, with --ls-fp8: which linear layers of each encoder and decoder layer "
                 f"run in FP8, a comma-separated list of {', '.join(FP8_LAYERS)} (default: all; "
                 "'attention' is the self- and cross-attention projections, 'ffn' fc1 and fc2)")

    @classmethod
    def build_model(cls, args, task):
        check_supported(_as_config(args))
        fp8_layers(args)  # a bad --ls-fp8-layers fails before the model is built
        importlib.import_module("..ops._extension", __package__).announce_device(args)
        return super().build_model(args, task)

    def set_num_updates(self, num_updates):
        """fairseq's hook, calling each submodule's own ``set_num_updates`` once. fairseq's
        default walks every module, and the encoder then walks its own again: host time every
        update in fairseq-train, spent while the GPU waits for the next forward. The
        hooks that only pass the call on to children (fairseq's defaults) are skipped, since
        the walk reaches those children anyway."""
        for m in self.modules():
            hook = getattr(type(m), "set_num_updates", None)
            if m is not self and hook is not None and hook not in _FORWARDING_HOOKS:
                m.set_num_updates(num_updates)

    def prepare_for_inference_(self, cfg):
        """fairseq-generate and fairseq-interactive call this once the model is on its device
        (and in fp16 under ``--fp16``). fairseq 0.12 has no bf16 decoding: its ``--bf16`` means
        a TPU, and generate then decodes in fp32. For an ls_ model ``--bf16`` decodes in
        bfloat16 on the usual device (log-probabilities stay fp32: fairseq's log_softmax)."""
        super().prepare_for_inference_(cfg)
        common = getattr(cfg, "common", None)
        if getattr(common, "bf16", False) and not getattr(common, "fp16", False) and \
                not _has_torch_xla():
            self.to(torch.bfloat16)
            logger.info(f"--bf16: decoding in {next(self.parameters()).dtype} on "
                        f"{next(self.parameters()).device} (fairseq 0.12 alone would decode a "
                        f"model on a GPU in fp32)")

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return LSTransformerEncoder(_as_config(cfg), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return LSTransformerDecoder(_as_config(cfg), tgt_dict, embed_tokens)


#: ls_ architecture name -> fairseq's architecture function with the same defaults
ARCHITECTURES = {
    "ls_transformer": fairseq_archs.base_architecture,
    "ls_transformer_iwslt_de_en": fairseq_archs.transformer_iwslt_de_en,
    "ls_transformer_wmt_en_de": fairseq_archs.transformer_wmt_en_de,
    "ls_transformer_vaswani_wmt_en_de_big": fairseq_archs.transformer_vaswani_wmt_en_de_big,
    "ls_transformer_vaswani_wmt_en_fr_big": fairseq_archs.transformer_vaswani_wmt_en_fr_big,
    "ls_transformer_wmt_en_de_big": fairseq_archs.transformer_wmt_en_de_big,
    "ls_transformer_wmt_en_de_big_t2t": fairseq_archs.transformer_wmt_en_de_big_t2t,
}

def _has_torch_xla() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def bf16_without_tpu(args) -> None:
    """fairseq 0.12 reads ``--bf16`` as "bf16 on a TPU" (its option parsing sets ``--tpu``). On a
    machine without torch_xla that run could only fail, so for ls_ architectures ``--bf16`` means
    bf16 on the device fairseq otherwise picks (the GPU, or the CPU with ``--cpu``): the model and
    batches in bf16, fp32 master weights and Adam moments, no loss scaling. fairseq's option
    parsing calls the architecture function after setting ``--tpu``, so this is the place."""
    if not (getattr(args, "bf16", False) and getattr(args, "tpu", False)):
        return
    if _has_torch_xla():
        return  # a TPU machine: fairseq's meaning
    args.tpu = False
    logger.info("--bf16: training in bfloat16 on %s (fairseq reads --bf16 as TPU; torch_xla is "
                "not installed, so ls_fairseq uses the usual device)",
                "the CPU" if getattr(args, "cpu", False) or not torch.cuda.is_available()
                else "the GPU")


def _architecture(fairseq_arch):
    @functools.wraps(fairseq_arch)
    def architecture(args):
        fairseq_arch(args)
        bf16_without_tpu(args)
    return architecture


for _name, _fairseq_arch in ARCHITECTURES.items():
    register_model_architecture("ls_transformer", _name)(_architecture(_fairseq_arch))
