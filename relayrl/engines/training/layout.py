"""How the training engine lays a batch out for its passes (``engine.packing``): the packing mode the model
allows, the micro-batches of packed units or padded rows, and the attention mask in the form the model's
attention takes.

:class:`PassLayout` is a mixin of :class:`~relayrl.engines.training.torch_engine.TorchTrainingEngine` (whose
module docstring describes the layouts); it reads the engine's ``model``, ``cfg``, ``device``,
``compute_dtype``, ``routing`` and ``_balance``.
"""

from __future__ import annotations

import warnings

import torch

from relayrl.engines.training import flex
from relayrl.engines.training.base import SequenceBatch
from relayrl.engines.training.config import TrainEngineConfig
from relayrl.errors import SettingError
from relayrl.models import packing_check
from relayrl.models.load import attention_windows
from relayrl.models.packing import (PackUnit, additive_mask, fed_tokens, pack_units, plan_microbatches, plan_units,
                                    shared_prompt_mask)

__all__ = ["PassLayout"]


class PassLayout:
    """The engine's layout of its passes (module docstring)."""

    model: torch.nn.Module
    cfg: TrainEngineConfig
    device: torch.device
    compute_dtype: torch.dtype

    def _resolve_packing(self, trainable: bool) -> None:
        """Pick the effective packing mode and the mask form this model's attention accepts (a model loaded
        with flex_attention is switched to :func:`relayrl.engines.training.flex.flex_attention_forward`)."""
        conf = self.model.config
        self.attn_impl = getattr(conf, "_attn_implementation", None)
        self.flex = flex.is_flex(self.attn_impl)
        if self.flex:
            if trainable and not flex.backward_supported(self.device):
                raise ValueError(f"attn_implementation={self.attn_impl!r}: torch {torch.__version__} has no "
                                 f"FlexAttention backward pass on {self.device.type}; train there with "
                                 "model.attn_implementation=sdpa (flex_attention is for CUDA)")
            flex.install(self.model)
            self.attn_impl = flex.ATTN
        # (a window for every layer when the config sets one but lists no layer types: Mistral, Phi-3)
        layer_types, self.sliding_window, self._mask_per_type = attention_windows(conf)
        self.packing = self.cfg.packing
        reason = None if self.packing == "none" else packing_check.unpacked_reason(
            self.model, self.attn_impl in ("sdpa", "eager", flex.ATTN), layer_types, self.sliding_window)
        if reason is not None:
            if self.cfg.sequence_parallel > 1:  # (Ulysses splits packed rows only)
                raise SettingError(f"engine.sequence_parallel={self.cfg.sequence_parallel} splits packed rows, and "
                                   f"this model cannot be packed: {reason}; set engine.sequence_parallel=1")
            warnings.warn(f"packing={self.packing!r} disabled, using 'none': {reason}", stacklevel=3)
            self.packing = "none"

    @property
    def _feed_last(self) -> bool:
        """Whether passes feed each response's last token (:attr:`PackUnit.feed_last`; padded rows too): only
        routing replay (routes laid out over whole sequences) and the load-balancing loss (over every fed token)
        need it."""
        return self.routing is not None or self._balance is not None

    def _fed_len(self, batch: SequenceBatch, row: int) -> int:
        """Tokens of batch row ``row`` a padded pass feeds: its prompt and response, without the response's last
        token unless :attr:`_feed_last`."""
        return int(batch.prompt_ids[row].numel()) + fed_tokens(int(batch.response_ids[row].numel()), self._feed_last)

    def _plan(self, batch: SequenceBatch) -> list[list[int] | list[list[PackUnit]]]:
        """Micro-batches: row lists (``packing="none"``) or packed rows, each a list of units."""
        lengths = [self._fed_len(batch, i) for i in range(len(batch.prompt_ids))]
        if self.packing == "none" or not lengths:
            return plan_microbatches(lengths, self.cfg.token_budget)
        units = plan_units(batch.prompt_ids, batch.response_ids, batch.groups, mode=self.packing,
                           max_len=min(self.cfg.pack_length or self.cfg.token_budget, self.cfg.token_budget),
                           feed_last=self._feed_last)
        capacity = self.cfg.pack_length or max(u.length for u in units)
        rows = [[units[k] for k in pack] for pack in pack_units([u.length for u in units], capacity)]
        row_len = [sum(u.length for u in r) for r in rows]
        return [[rows[k] for k in mb] for mb in plan_microbatches(row_len, self.cfg.token_budget)]

    def _attention_mask(self, doc_ids: torch.Tensor, seg_ids: torch.Tensor, pos_ids: torch.Tensor):
        """The packed mask in the form the model's attention takes (bool for SDPA, additive for eager, a
        ``BlockMask`` for flex), built once for every layer; a dict by layer type with sliding layers."""

        def mask(window: int | None):
            if self.flex:
                return flex.block_mask(doc_ids, seg_ids, pos_ids, sliding_window=window)
            dense = shared_prompt_mask(doc_ids, seg_ids, pos_ids, sliding_window=window)
            return dense if self.attn_impl == "sdpa" else additive_mask(dense, self.compute_dtype)

        if self.sliding_window is None or not self._mask_per_type:
            return mask(self.sliding_window)
        return {"full_attention": mask(None), "sliding_attention": mask(self.sliding_window)}
