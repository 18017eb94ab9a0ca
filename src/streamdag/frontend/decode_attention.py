"""Attention of a decode step over the key/value heads it shares, without copying them per query head.

Under grouped-query attention (Llama, Mistral, Qwen: 32 query heads, 8 key/value
heads) Hugging Face's ``sdpa`` attention in a traced step copies each layer's keys
and values once per query head of a group (``repeat_kv``) whenever there is a
mask, and a static cache always has one: at a decode step that copies the layer's whole cache,
every position up to ``max_length``, to read it once. PyTorch's
``scaled_dot_product_attention(..., enable_gqa=True)`` reads the shared heads
where they are. On an H200 a Llama-1B layer's attention over a 768-position cache
takes 13.7 µs the first way and 6.8 µs the second (4,096 positions: 26.6 and 9.7);
the results are equal.

:func:`grouped_attention` is that attention for one new token per sequence (a
decode step), and Hugging Face's own ``sdpa`` for everything else (the prefill);
it is registered with ``transformers`` under :data:`NAME` with ``sdpa``'s masks.
:func:`attention_for_decode` switches a model that uses ``sdpa`` to it while the
decoder runs the model, and back.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["NAME", "attention_for_decode", "describe", "grouped_attention"]

#: the name the attention is registered under in ``transformers``' attention interfaces
NAME = "streamdag_grouped_sdpa"


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``sdpa`` attention, reading grouped key/value heads in place for a single query position."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] != 1 or groups == 1 or key.shape[-1] != value.shape[-1]
            or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "sinks", "s_aux"))
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, :key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, grouped_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)


def _configs(config: Any) -> Iterator[Any]:
    """``config`` and its sub-configs (a multimodal model's text and vision configs), depth first."""
    yield config
    for key in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


@functools.cache
def _names_sdpa(module_name: str) -> bool:
    """Whether a ``transformers`` module's code names ``"sdpa"`` itself (Falcon takes another path
    ``if config._attn_implementation == "sdpa"``; DeepSeek-V3.2 masks its sparse attention only for
    ``"eager"`` and ``"sdpa"``): its models keep their own attention. Llama's, Mistral's, Qwen's,
    Gemma's and Phi's code takes attention from the interface alone."""
    module = sys.modules.get(module_name)
    if module is None or not module_name.startswith("transformers."):
        return False
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return True  # unknown: keep the model's own
    return '"sdpa"' in source or "'sdpa'" in source


def _switchable(model: torch.nn.Module) -> bool:
    """Whether the decoder may switch ``model``'s ``sdpa`` attention to :func:`grouped_attention`
    (asked at every batch of queued steps: the walk over the model's modules, ~0.1 ms for a
    16-layer Llama, is made once per model)."""
    known = _SWITCHABLE.get(model)
    if known is None:
        interface = getattr(model, "config", None) is not None and bool(
            getattr(model, "_supports_attention_backend", False))
        known = _SWITCHABLE[model] = interface and not any(
            map(_names_sdpa, {type(m).__module__ for m in model.modules()}))
    return known


_SWITCHABLE: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def describe(model: torch.nn.Module) -> str:
    """Which attention the decoder's steps run for ``model`` (for ``explain()``)."""
    config = getattr(model, "config", None)
    own = getattr(config, "_attn_implementation", None)
    grouped = any(getattr(c, "num_key_value_heads", None) is not None
                  and c.num_key_value_heads < getattr(c, "num_attention_heads", 0) for c in _configs(config))
    if _switchable(model) and grouped and any(
            getattr(c, "_attn_implementation_internal", None) in ("sdpa", NAME) for c in _configs(config)):
        return ("decode steps' attention: scaled_dot_product_attention with enable_gqa (the shared "
                "key/value heads read in place); the prefill's: sdpa")
    return f"attention: the model's own ({own})"


@contextmanager
def attention_for_decode(model: torch.nn.Module) -> Iterator[None]:
    """While in the block, the parts of a model whose attention is ``sdpa`` run
    :func:`grouped_attention`; each config's own setting is put back after it.

    Only models that take their attention from the interface (``_supports_attention_backend``) and
    whose code does not test for ``"sdpa"`` itself (it would take another path under another name).
    """
    if not _switchable(model):
        yield
        return
    config = model.config
    with _LOCK:
        entry = _SWITCHED.get(id(config))
        if entry is None:
            # set on each config itself: the property's setter would overwrite every sub-config's own
            switched = [c for c in _configs(config)
                        if getattr(c, "_attn_implementation_internal", None) == "sdpa"]
            if switched:
                _register()
                for c in switched:
                    c._attn_implementation_internal = NAME
            entry = _SWITCHED[id(config)] = [0, switched]
        entry[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:  # the last block over this model: each config as it was
                del _SWITCHED[id(config)]
                for c in entry[1]:
                    c._attn_implementation_internal = "sdpa"


#: per model config inside an :func:`attention_for_decode` block: [blocks open (several threads may
#: decode with one model), the configs switched by the first]; the last block to close switches back
_SWITCHED: dict[int, list[Any]] = {}
_LOCK = threading.Lock()
