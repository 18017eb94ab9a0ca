"""Greedy token generation with one captured graph for every decode step.

A decoder-only transformer generates a token per forward pass, each over one
new token per sequence: at batch 1 a step is a few hundred small kernels whose
launches take longer than their work. :class:`Decoder` makes each step a replay
of one CUDA graph:

* **A static KV cache.** A Hugging Face ``StaticCache`` preallocates every
  layer's keys and values for ``max_length`` tokens and writes each step's at a
  position it keeps as a device tensor (its ``cumulative_length``, advanced in
  place); the model takes its positions and attention mask from that counter.
  So a decode step has the same shapes at every position: the position and the
  sequence length are data, not shapes, and nothing is compiled or captured
  again as the sequence grows.
* **The step compiled once.** The step (the model over one token per sequence
  and the greedy choice, ``argmax`` over the last logits) goes through
  ``streamdag.compile``: Dynamo, Inductor, the region planner, and on a GPU the
  whole call captured into one CUDA graph (:mod:`.whole_call`) that every later
  step replays. A call copies the previous step's tokens into the graph's input
  and replays it; the cache is read and written in place.
* **Sibling projections packed, attention over shared heads.** Before it
  compiles the step, the decoder lays each block's q/k/v and gate/up weights
  side by side in one storage, in place on the user's model (same values;
  :func:`.adjacent_linears.pack_sibling_linears`), so that each group runs as
  one product; and while it runs the model, a decode step's grouped-query
  attention reads the shared key/value heads in place (:mod:`.decode_attention`).
* **Tokens stream out without stalls.** :class:`TokenStream` keeps
  ``lookahead`` steps queued ahead of the token being read: each step's tokens
  are copied into a pinned host buffer and an event is recorded after the copy,
  so reading a token waits for that event only, while the next steps are already
  queued on the GPU. Nothing else waits for the device between tokens.

The prompt (the *prefill*) runs eagerly, as under Hugging Face's own
``generate(cache_implementation="static")``: its length changes from prompt to
prompt, and compiling it would compile once per length. On the CPU the steps
run eagerly by default (``compile=True`` compiles them with Inductor's CPU code
generator); the tokens are the same.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from .._diagnostics import warn
from .decode_attention import attention_for_decode, describe

__all__ = ["Decoder", "TokenStream", "generate"]

#: how many decode steps a stream keeps queued ahead of the token being read (on CUDA)
LOOKAHEAD = 2

#: Inductor settings for a decode step (a decoder's ``inductor=`` replaces them): combo kernels put
#: independent small kernels into one launch, e.g. a layer's value write to the cache beside its query's
#: rotation; on an H200 a Llama-3.2-1B-sized step (bf16, batch 1) runs 202 kernels in 1.144 ms
#: with them, 248 in 1.218 ms without
DECODE_INDUCTOR: dict[str, Any] = {"combo_kernels": True}

#: the default of ``eos_token_id`` and ``pad_token_id``: the model's ``generation_config``, as
#: ``model.generate`` takes them (an explicit ``eos_token_id=None`` generates every token asked for)
FROM_MODEL: Any = "from the model's generation_config"


#: ``generation_config`` settings under which ``model.generate(do_sample=False)`` changes the logits
#: before its argmax (logits processors), each with the value that leaves them as they are
_PROCESSED: dict[str, Any] = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0, "min_new_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "sequence_bias": None, "exponential_decay_length_penalty": None}


def _check_unprocessed(model: torch.nn.Module) -> None:
    """Refuse a model whose ``generation_config`` makes ``model.generate`` process the logits: the
    decoder takes their argmax as they are, and would give other tokens without a word."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    set_ = {}
    for k, plain in _PROCESSED.items():
        v = getattr(config, k, plain)
        if v is not None and v != plain and not (isinstance(v, (list, tuple, dict)) and not v):
            set_[k] = v
    if set_:
        resets = "; ".join(f"model.generation_config.{k} = {_PROCESSED[k]!r}" for k in set_)
        raise ValueError(
            f"the model's generation_config sets {', '.join(f'{k}={v!r}' for k, v in set_.items())}, "
            "which model.generate applies to the logits before its argmax; streamdag's decoder takes the "
            "argmax of the logits as they are, so its tokens would differ: reset them to decode greedily "
            f"({resets}), or use model.generate")


def _special_tokens(model: torch.nn.Module, eos: Any, pad: Any) -> tuple[list[int] | None, int | None]:
    """The end-of-sequence ids (or None: no end) and the padding id, as ``model.generate`` takes them."""
    _check_unprocessed(model)
    config = getattr(model, "generation_config", None)
    if eos is FROM_MODEL:
        eos = getattr(config, "eos_token_id", None)
    if pad is FROM_MODEL:
        pad = getattr(config, "pad_token_id", None)
    if pad is not None:
        pad = _token_ids(pad, "pad_token_id", one=True)[0]
    if eos is None:
        return None, pad
    ids = _token_ids(eos, "eos_token_id")
    return ids, ids[0] if pad is None else pad


def _token_ids(value: Any, name: str, one: bool = False) -> list[int]:
    """``value`` (an int, a NumPy integer, a tensor of them, or a list) as a list of ints, as
    ``model.generate`` takes it; ``one``: a single id."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    many = isinstance(value, (list, tuple)) and not one
    try:
        ids = [operator.index(i) for i in value] if many else [operator.index(value)]
    except TypeError:
        ids = []
    if not ids:
        raise ValueError(f"{name} must be {'an int' if one else 'an int, a list of ints'} or None, "
                         f"got {value!r}")
    return ids


def _check_padding(input_ids: torch.Tensor, mask: Any, eos: list[int] | None, pad: int | None) -> None:
    """The decoder masks nothing: it refuses an attention mask with a zero, and, without a mask,
    warns of a prompt holding the padding id (not an end-of-sequence id), which ``model.generate``
    without a mask would mask (its tokens would then differ)."""
    fix = ("streamdag.decoder decodes prompts without padding (one length per batch); decode prompts "
           "of other lengths in batches of their own")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape or not bool(mask.all()):
            raise ValueError(f"attention_mask must be all ones, of the prompt's shape: {fix}")
    elif pad is not None and (eos is None or pad not in eos) and bool((input_ids == pad).any()):
        warn(f"streamdag.decoder: the prompt holds the padding id {pad}, which model.generate without an "
             f"attention mask would mask; the decoder attends to every token: {fix} (pass "
             "attention_mask=torch.ones_like(input_ids) where the id is a token, to say so)")


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its cache by: ``cache`` in newer Hugging Face
    releases, which deprecate ``past_key_values`` (the older name, and the name of a forward that
    takes neither by name)."""
    import inspect

    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # (a forward without a signature Python can read)
        return "past_key_values"
    return "cache" if "cache" in names else "past_key_values"


class _Step(torch.nn.Module):
    """One decode step: the model over the newest tokens, then the greedy choice of the next ones."""

    def __init__(self, model: torch.nn.Module, cache: Any, keyword: str) -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self.keyword = keyword  # (:func:`cache_keyword`)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens, **{self.keyword: self.cache}, use_cache=True,
                            logits_to_keep=1).logits
        return logits[:, -1].argmax(-1, keepdim=True)


class _Slot:
    """What one batch size needs: its static cache and its (compiled) step."""

    def __init__(self, model: torch.nn.Module, max_length: int, compile_step: bool,
                 options: dict[str, Any]) -> None:
        from transformers.cache_utils import StaticCache, StaticLayer

        #: the model's weights when the slot was made: its cache takes their dtype and device at first use
        self.weights = _weights_kind(model)

        self.cache: Any = StaticCache(config=model.config, max_cache_len=max_length)
        other = sorted({type(x).__name__ for x in self.cache.layers if type(x) is not StaticLayer})
        if other:  # a sliding window keeps its length as a Python int: each step would compile again
            raise ValueError(f"the model's static cache has {', '.join(other)} layers: streamdag.decoder "
                             "decodes models whose every layer is full attention (StaticLayer, positions on "
                             "the device); use model.generate for this one")
        self.keyword = cache_keyword(model)
        self.step_module: torch.nn.Module = _Step(model, self.cache, self.keyword)
        self.step: Any = self.step_module
        if compile_step:
            from .adjacent_linears import pack_sibling_linears
            from .compiled_model import compile_v2

            pack_sibling_linears(model)  # so that the compile fuses each block's projections

            # the stream copies each step's tokens out before the next replay overwrites them
            self.step = compile_v2(self.step_module,
                                   **{"clone_outputs": False, "inductor": DECODE_INDUCTOR, **options})


def _weights_kind(model: torch.nn.Module) -> tuple[Any, Any]:
    """The dtype and device of the model's first floating-point parameter (None, None if none)."""
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return (None, None) if p is None else (p.dtype, p.device)


def _check_transformers() -> None:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("streamdag's decoder runs Hugging Face models: "
                          "pip install 'transformers>=5'") from exc
    if int(transformers.__version__.split(".")[0]) < 5:  # the static cache and model interface used here
        raise ImportError(f"streamdag's decoder needs transformers 5 or newer (its static cache keeps the "
                          f"positions on the device), found {transformers.__version__}: "
                          "pip install 'transformers>=5'")


def _check_compile_options(options: dict[str, Any]) -> None:
    """Unknown or ill-typed options of the step's compile raise now, not at the first generate."""
    import inspect

    from .compiled_model import compile_v2
    from .inner_compile import compile_options

    known = [name for name in inspect.signature(compile_v2).parameters if name != "fn"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"streamdag.decoder got unknown option(s) {', '.join(map(repr, unknown))}; it takes "
                        f"max_length, compile, lookahead and streamdag.compile's {', '.join(known)}")
    taken = inspect.signature(compile_options).parameters
    compile_options(**{k: v for k, v in options.items() if k in taken})


def _check_model(model: Any) -> None:
    _check_transformers()
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError("streamdag.decoder needs a Hugging Face causal language model (a torch.nn.Module "
                        f"with a config, such as LlamaForCausalLM), got {type(model).__name__}")
    if model.training:
        raise ValueError("the model is in training mode: call model.eval() before decoding "
                         "(dropout would make the tokens random)")
    config = model.config
    if getattr(config, "_attn_implementation", None) == "flex_attention":
        raise ValueError("the model attends with flex_attention, which over a static cache gives rows "
                         "after the first other tokens: load it with attn_implementation='sdpa' (or "
                         "'eager') for streamdag's decoder, or use model.generate")
    if getattr(config, "alibi", False):
        raise ValueError("the model adds ALiBi position biases (alibi=True), which Hugging Face's static "
                         "cache does not serve: use model.generate for this one")


class Decoder:
    """Greedy decoding of a Hugging Face causal LM with a static KV cache (see the module docstring).

    One decoder keeps a cache and a compiled step per batch size, so later prompts of a batch
    size reuse its graph. One stream decodes at a time: starting another ends the one before.
    """

    def __init__(self, model: torch.nn.Module, *, max_length: int, compile: bool | None = None,
                 lookahead: int = LOOKAHEAD, **compile_options: Any) -> None:
        _check_model(model)
        if not _whole(max_length) or max_length < 2:
            raise ValueError("max_length must be an int of at least 2 (the prompt plus the new tokens), "
                             f"got {max_length!r}")
        if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
            raise ValueError(f"lookahead must be a whole number of steps, 0 or more, got {lookahead!r}")
        _check_compile_options(compile_options)
        self.model = model
        self.max_length = max_length
        self.compile = compile
        self.lookahead = lookahead
        self.compile_options = compile_options
        self._slots: dict[int, _Slot] = {}
        self._current: TokenStream | None = None

    def _slot(self, batch: int, device: torch.device) -> _Slot:
        slot = self._slots.get(batch)
        if slot is not None and slot.weights != _weights_kind(self.model):  # model.to(...) since: every
            self._slots.clear()  # slot's cache and graphs are of the old weights, and go
            slot = None
        if slot is None:
            compile_step = device.type == "cuda" if self.compile is None else self.compile
            slot = self._slots[batch] = _Slot(self.model, self.max_length, compile_step, self.compile_options)
        return slot

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int, *,
               eos_token_id: int | list[int] | None = FROM_MODEL,
               pad_token_id: int | None = FROM_MODEL,
               attention_mask: torch.Tensor | None = None) -> TokenStream:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (batch, prompt length), greedily.

        The prefill runs at once; the stream yields each step's tokens, a CPU ``int64`` tensor of
        shape (batch,), as it is read. A sequence that produced an ``eos_token_id`` gets
        ``pad_token_id`` from then on, and the stream ends once every sequence has, as
        ``model.generate`` does; both default to the model's ``generation_config`` (the padding
        to the first end-of-sequence id), and ``eos_token_id=None`` generates every token.
        ``attention_mask``, where given, must be all ones (the prompt has no padding); without it, a
        prompt that holds the padding id warns, as ``model.generate`` would mask it.
        """
        batch, _ = _check_prompt(input_ids, self.model, max_new_tokens, self.max_length)
        eos, pad = _special_tokens(self.model, eos_token_id, pad_token_id)
        _check_padding(input_ids, attention_mask, eos, pad)
        if self._current is not None:
            self._current._end("a later stream of the same decoder took its cache")
        slot = self._slot(batch, input_ids.device)
        self._current = TokenStream(self, slot, input_ids, max_new_tokens, eos, pad)
        return self._current

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                 eos_token_id: int | list[int] | None = FROM_MODEL,
                 pad_token_id: int | None = FROM_MODEL,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt followed by the new tokens, (batch, length), on the prompt's device: what
        ``model.generate(input_ids, do_sample=False, max_new_tokens=...)`` returns."""
        return self.stream(input_ids, max_new_tokens, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id, attention_mask=attention_mask).result()

    def statistics(self) -> dict[int, Any]:
        """Per batch size: the compiled step's counts (``streamdag.compile``'s statistics), where compiled."""
        return {b: s.step.statistics() for b, s in self._slots.items() if s.step is not s.step_module}

    def explain(self) -> str:
        """Per batch size: how the step runs (its graphs, region plan and whole-call graph), and which
        attention the steps run."""
        parts = []
        for b, s in sorted(self._slots.items()):
            how = (s.step.explain() if s.step is not s.step_module
                   else "the step runs eagerly (not compiled; compile=True compiles it)")
            parts.append(f"batch {b}:\n{how}")
        if parts:
            parts.append(describe(self.model))
        return "\n\n".join(parts) or "nothing decoded yet"


def _whole(n: Any) -> bool:
    """Whether ``n`` is a whole number (an int or a NumPy integer, not a bool), as ``model.generate``
    takes its lengths."""
    if isinstance(n, bool):
        return False
    try:
        operator.index(n)
    except TypeError:
        return False
    return True


def _check_prompt(input_ids: Any, model: torch.nn.Module, max_new_tokens: int,
                  max_length: int) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = (f"a {input_ids.dim()}-d {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"input_ids must be a 2-d int64 tensor (batch, prompt length), got {got}")
    batch, length = input_ids.shape
    if batch < 1 or length < 1:
        raise ValueError("input_ids must hold at least one token per sequence, "
                         f"got shape {tuple(input_ids.shape)}")
    if not _whole(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if length + max_new_tokens > max_length:
        raise ValueError(f"a prompt of {length} tokens and {max_new_tokens} new ones need a cache of "
                         f"{length + max_new_tokens} positions; the decoder has max_length={max_length}: "
                         "make a decoder with a larger max_length")
    weights = next(model.parameters(), None)
    if weights is not None and weights.device != input_ids.device:
        raise ValueError(f"input_ids are on {input_ids.device}, the model on {weights.device}: "
                         "move them to the model's device")
    return batch, length


class TokenStream:
    """The tokens of one prompt, step by step: iterate (``for``/``async for``) or take ``result()``.

    Each item is the step's tokens, a CPU ``int64`` tensor of shape (batch,). On CUDA, the steps
    run ``lookahead`` ahead of the reader (see the module docstring); on the CPU each runs when
    its token is asked for.
    """

    def __init__(self, decoder: Decoder, slot: _Slot, input_ids: torch.Tensor, max_new_tokens: int,
                 eos: list[int] | None, pad: int | None) -> None:
        self.decoder = decoder
        self.slot = slot
        self.prompt = input_ids
        self.max_new_tokens = max_new_tokens
        self.pad = pad
        self.eos: torch.Tensor | None = None if eos is None else torch.tensor(eos, device=input_ids.device)
        self._host_eos = None if eos is None else torch.tensor(eos)
        self.cuda: bool = input_ids.device.type == "cuda"
        batch = input_ids.shape[0]
        self.host: torch.Tensor = torch.empty((max_new_tokens, batch), dtype=torch.long, pin_memory=self.cuda)
        self.events: list[Any] = []
        self.enqueued: int = 0  # steps whose tokens are queued for the host buffer
        self.read: int = 0  # tokens handed to the reader
        self.ended: str = ""  # why the stream ended early ('' while it runs)
        self.done: bool = False
        self._host_finished = torch.zeros(batch, dtype=torch.bool)
        with torch.inference_mode():
            self._prefill()

    # -- the device side ------------------------------------------------------------------------------

    def _prefill(self) -> None:
        self.slot.cache.reset()  # in place: the captured step reads the cache where it is
        model = self.decoder.model
        with attention_for_decode(model):
            out = model(input_ids=self.prompt, **{self.slot.keyword: self.slot.cache}, use_cache=True,
                        logits_to_keep=1)
        logits = getattr(out, "logits", None)
        if logits is None:
            raise TypeError(f"{type(model).__name__} returns no logits ({type(out).__name__}): "
                            "streamdag's decoder needs a causal language model with its head "
                            "(LlamaForCausalLM, not LlamaModel)")
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        self._finished = torch.zeros_like(tokens, dtype=torch.bool) if self.eos is not None else None
        self._emit(tokens)

    def _emit(self, tokens: torch.Tensor) -> None:
        """Record this step's tokens (after the end-of-sequence rule) and queue their copy to the host."""
        if self._finished is not None:
            tokens = torch.where(self._finished, torch.full_like(tokens, self.pad), tokens)
            self._finished |= torch.isin(tokens, self.eos)
        self.tokens = tokens
        i = self.enqueued
        self.host[i].copy_(tokens.view(-1), non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self.events.append(event)
        self.enqueued += 1

    def _enqueue_to(self, target: int) -> None:
        target = min(target, self.max_new_tokens)
        if self.enqueued >= target:
            return
        with torch.inference_mode(), attention_for_decode(self.decoder.model):
            while self.enqueued < target:
                self._emit(self.slot.step(self.tokens))

    # -- the reader's side ----------------------------------------------------------------------------

    def _end(self, why: str) -> None:
        self.ended = why

    def _token(self) -> torch.Tensor:
        if self.ended:
            raise RuntimeError(f"this token stream ended early: {_why(self.ended)}")
        i = self.read
        self._enqueue_to(i + 1 + (self.decoder.lookahead if self.cuda else 0))
        if self.cuda:
            self.events[i].synchronize()
        return self._take(i)

    def _take(self, i: int) -> torch.Tensor:
        tok = self.host[i]
        self.read = i + 1
        if self._host_eos is not None:
            self._host_finished |= torch.isin(tok, self._host_eos)
            if bool(self._host_finished.all()):
                self.done = True
        if self.read == self.max_new_tokens:
            self.done = True
        return tok

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self.done:
            raise StopIteration
        return self._token()

    def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        return self

    async def __anext__(self) -> torch.Tensor:
        """The next token without blocking the event loop: the steps are queued from the loop's
        thread (CUDA's current stream is per thread), and the wait polls the token's event."""
        if self.done:
            raise StopAsyncIteration
        if self.ended:
            raise RuntimeError(f"this token stream ended early: {_why(self.ended)}")
        i = self.read
        self._enqueue_to(i + 1 + (self.decoder.lookahead if self.cuda else 0))
        if self.cuda:
            while not self.events[i].query():
                await asyncio.sleep(0)
        return self._take(i)

    def result(self) -> torch.Tensor:
        """Read the remaining tokens; the prompt followed by every token, on the prompt's device."""
        for _ in self:
            pass
        new = self.host[:self.read].T
        return torch.cat([self.prompt, new.to(self.prompt.device)], dim=1)


def _why(reason: str) -> str:
    return f"{reason} (read a stream to its end, or keep one decoder per concurrent stream)"


def generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *,
             eos_token_id: int | list[int] | None = FROM_MODEL, pad_token_id: int | None = FROM_MODEL,
             attention_mask: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
    """Greedy generation in one call: a :class:`Decoder` sized for this prompt (see :meth:`Decoder.generate`).

    Each call compiles the step anew: to decode several prompts, keep a decoder
    (``streamdag.decoder(model, max_length=...)``), which reuses its graphs.
    """
    length = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else 0
    _check_model(model)
    if "max_length" in options:
        raise TypeError("streamdag.generate sizes its decoder for the prompt and max_new_tokens: drop "
                        "max_length, or keep a decoder of that length (streamdag.decoder(model, "
                        "max_length=...))")
    if not _whole(max_new_tokens):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    _check_prompt(input_ids, model, max_new_tokens, length + max(max_new_tokens, 1))
    decoder = Decoder(model, max_length=max(length + max_new_tokens, 2), **options)
    return decoder.generate(input_ids, max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                            attention_mask=attention_mask)
