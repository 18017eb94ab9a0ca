"""Greedy decoding with a static KV cache (streamdag.decoder / streamdag.generate): the tokens are
Hugging Face's own greedy ``generate``'s, the prefill and every step reuse one cache, and on a GPU
every step after the first few replays one captured graph."""

from __future__ import annotations

import asyncio
import functools
import re
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamdag as sd
from stand_in_device import StandInDevice

tf = pytest.importorskip("transformers")

EVERY = {"eos_token_id": None}  # every token asked for: no end of sequence (the counts below need them all)


def _llama(hidden: int = 64, layers: int = 2, vocab: int = 128, seed: int = 0,
           dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024)
    return tf.LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)


def _hf_greedy(model: torch.nn.Module, ids: torch.Tensor, new: int, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              **kwargs)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_tokens_equal_hugging_face_generate(batch):
    model = _llama()
    ids = torch.randint(0, 128, (batch, 9), generator=torch.Generator().manual_seed(batch))
    dec = sd.decoder(model, max_length=48)
    assert torch.equal(dec.generate(ids, 16), _hf_greedy(model, ids, 16))


_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              vocab_size=128, max_position_embeddings=256)
_FAMILIES = {  # rotary and learned positions, grouped and full attention, parallel and serial blocks
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, sliding_window=None,
                                                              **_SMALL)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **_SMALL)),
    "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(**_SMALL)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                     n_positions=256)),
}


@pytest.mark.parametrize("family, compile", [*[(f, False) for f in sorted(_FAMILIES)],
                                             *[pytest.param(f, True, marks=pytest.mark.slow)
                                               for f in ("gpt2", "qwen2")]])
def test_greedy_tokens_of_other_decoder_families_equal_hugging_face_generate(family, compile):
    torch.manual_seed(0)
    model = _FAMILIES[family]().eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = _hf_greedy(model, ids, 10, eos_token_id=None, pad_token_id=0)
    dec = sd.decoder(model, max_length=40, compile=compile)
    assert torch.equal(dec.generate(ids, 10, **EVERY), expected)


@pytest.mark.parametrize("options, error, match", [
    (dict(regoins="always"), TypeError, "unknown option.*'regoins'.* regions"),
    (dict(regions="sometimes"), ValueError, "regions must be 'auto', 'always' or 'never'"),
    (dict(inductor={"combo_kernel": True}), ValueError, "no Inductor setting named 'combo_kernel'"),
])
def test_a_decoders_bad_compile_option_raises_when_it_is_made_not_at_its_first_use(options, error, match):
    with pytest.raises(error, match=match):
        sd.decoder(_llama(), max_length=40, **options)


def test_a_decoder_takes_the_compile_options_as_streamdag_compile_takes_them():
    model = _llama()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    dec = sd.decoder(model, max_length=24, candidates="inductor", streams=2,
                     inductor={"combo-kernels": False})
    assert torch.equal(dec.generate(ids, 4), _hf_greedy(model, ids, 4))


@pytest.mark.cuda
@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_cuda_other_decoder_families_compiled_and_captured_give_eager_generates_tokens(family, no_tf32):
    torch.manual_seed(0)
    model = _FAMILIES[family]().eval().cuda()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    expected = _hf_greedy(model, ids, 24, eos_token_id=None, pad_token_id=0)
    dec = sd.decoder(model, max_length=40)
    assert torch.equal(dec.generate(ids, 24, **EVERY), expected)
    assert dec.statistics()[2].whole_replays == 24 - 1 - 2, dec.explain()


def test_a_decoder_decodes_prompt_after_prompt_with_one_cache():
    model = _llama()
    dec = sd.decoder(model, max_length=40)
    gen = torch.Generator().manual_seed(1)
    for length in (5, 11, 3):  # prompts of other lengths reuse the cache from position 0
        ids = torch.randint(0, 128, (2, length), generator=gen)
        assert torch.equal(dec.generate(ids, 10), _hf_greedy(model, ids, 10))
    assert len(dec._slots) == 1


def test_stream_yields_each_steps_tokens_as_batch_vectors_sync_and_async():
    model = _llama()
    ids = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(2))
    ref = _hf_greedy(model, ids, 8)[:, 6:]
    dec = sd.decoder(model, max_length=32)
    toks = list(dec.stream(ids, 8))
    assert len(toks) == 8 and all(t.shape == (3,) and t.dtype == torch.long and t.device.type == "cpu"
                                  for t in toks)
    assert torch.equal(torch.stack(toks, 1), ref)

    async def read() -> list[torch.Tensor]:
        return [t async for t in dec.stream(ids, 8)]
    assert torch.equal(torch.stack(asyncio.run(read()), 1), ref)


def _eos_at_step_3(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """A token that sequence 0 makes at its fourth step and not before (it finishes there)."""
    free = _hf_greedy(model, ids, 12, eos_token_id=None)[0, ids.shape[1]:]
    assert int(free[3]) not in free[:3].tolist(), "pick another seed: the token comes earlier too"
    return int(free[3])


def test_end_of_sequence_pads_finished_sequences_and_stops_as_generate_does():
    model = _llama()
    ids = torch.randint(0, 128, (4, 5), generator=torch.Generator().manual_seed(3))
    eos = _eos_at_step_3(model, ids)
    ref = _hf_greedy(model, ids, 12, eos_token_id=[eos, 127], pad_token_id=7)
    out = sd.decoder(model, max_length=32).generate(ids, 12, eos_token_id=[eos, 127], pad_token_id=7)
    assert torch.equal(out, ref)
    assert (out[0, 5 + 4:] == 7).all()


def test_the_models_generation_config_gives_the_default_end_of_sequence_and_none_turns_it_off():
    model = _llama()
    ids = torch.randint(0, 128, (4, 5), generator=torch.Generator().manual_seed(3))
    eos = _eos_at_step_3(model, ids)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, None
    dec = sd.decoder(model, max_length=32)
    out = dec.generate(ids, 12)
    assert torch.equal(out, _hf_greedy(model, ids, 12))
    assert (out[0, 5 + 3:] == eos).all()  # no padding id: the end-of-sequence id pads
    full = dec.generate(ids, 12, eos_token_id=None)
    assert full.shape == (4, 5 + 12) and torch.equal(full, _hf_greedy(model, ids, 12, eos_token_id=None))


def test_generate_in_one_call_equals_hugging_face():
    model = _llama(seed=4)
    ids = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(4))
    assert torch.equal(sd.generate(model, ids, 6), _hf_greedy(model, ids, 6))


def test_a_new_stream_ends_the_unread_one_with_a_clear_error():
    model = _llama()
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(5))
    dec = sd.decoder(model, max_length=32)
    first = dec.stream(ids, 8)
    next(first)
    dec.stream(ids, 8)
    with pytest.raises(RuntimeError, match="later stream of the same decoder took its cache"):
        next(first)


def test_bad_arguments_are_refused_with_the_fix_named():
    model = _llama()
    dec = sd.decoder(model, max_length=16)
    ids = torch.zeros((1, 10), dtype=torch.long)
    with pytest.raises(ValueError, match="larger max_length"):
        dec.generate(ids, 8)
    with pytest.raises(ValueError, match="2-d int64"):
        dec.generate(ids.float(), 2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        dec.generate(ids, 0)
    with pytest.raises(TypeError, match="Hugging Face causal language model"):
        sd.decoder(torch.nn.Linear(2, 2), max_length=8)
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        sd.decoder(_llama().train(), max_length=8)


@pytest.mark.parametrize("setting, value", [("repetition_penalty", 1.5), ("no_repeat_ngram_size", 2),
                                            ("forced_eos_token_id", 0), ("suppress_tokens", [3])])
def test_a_generation_config_that_processes_the_logits_is_refused_naming_the_reset(setting, value):
    """model.generate applies these before its argmax; the decoder would silently give other tokens."""
    model = _llama()
    ids = torch.randint(1, 128, (2, 5))
    setattr(model.generation_config, setting, value)
    said = re.escape(f"{setting}={value!r}") + f".*generation_config.{setting} = "
    with pytest.raises(ValueError, match=said):
        sd.generate(model, ids, 4, **EVERY)
    setattr(model.generation_config, setting, {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0}.get(
        setting))  # reset as the message says: greedy tokens, equal to generate's
    torch.testing.assert_close(sd.generate(model, ids, 4, **EVERY), _hf_greedy(model, ids, 4, **EVERY))


def test_models_the_static_cache_serves_wrongly_are_refused_and_other_misuses_named():
    model = _llama()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        sd.decoder(model, max_length=16)
    model.config._attn_implementation = "sdpa"
    model.config.alibi = True
    with pytest.raises(ValueError, match="ALiBi"):
        sd.decoder(model, max_length=16)
    del model.config.alibi
    ids = torch.randint(1, 128, (1, 4))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got True"):
        sd.generate(model, ids, True)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got None"):
        sd.generate(model, ids, None)
    with pytest.raises(TypeError, match="sizes its decoder"):
        sd.generate(model, ids, 3, max_length=50)
    np = pytest.importorskip("numpy")
    assert sd.generate(model, ids, np.int64(2), **EVERY).shape == (1, 6)
    base = tf.LlamaModel(model.config).eval()
    with pytest.raises(TypeError, match="returns no logits"):
        sd.generate(base, ids, 2, **EVERY)


def test_a_model_with_sliding_window_layers_is_refused_by_name():
    torch.manual_seed(0)
    cfg = tf.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    model = tf.MistralForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer"):
        sd.decoder(model, max_length=32).generate(torch.zeros((1, 4), dtype=torch.long), 2)


@pytest.mark.slow
def test_compiled_step_on_the_cpu_gives_the_same_tokens():
    model = _llama()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(6))
    dec = sd.decoder(model, max_length=32, compile=True)
    assert torch.equal(dec.generate(ids, 10), _hf_greedy(model, ids, 10))
    assert torch.equal(dec.generate(ids[:, :4], 10), _hf_greedy(model, ids[:, :4], 10))
    stats = dec.statistics()[2]
    assert stats.graphs == 1  # positions are data: no recompile as the sequence grows
    # each layer's q/k/v and gate/up projections, packed by the decoder, run as one product each
    assert "4 groups of linear layers over one input run as one product" in dec.explain(), dec.explain()
    assert "attention: scaled_dot_product_attention with enable_gqa" in dec.explain()


class _CacheKeepingDevice(StandInDevice):
    """A capture runs the step but leaves the cache as it was, and a replay runs the step eagerly
    into the captured outputs."""

    def __init__(self, slot_of):
        super().__init__()
        self.slot_of = slot_of

    def capture(self, fn, args, kwargs, private=False):
        slot = self.slot_of()
        state = [t for x in slot.cache.layers for t in (x.keys, x.values, x.cumulative_length)]
        saved = [t.clone() for t in state]
        out = fn(*args, **kwargs)
        for t, s in zip(state, saved):
            t.copy_(s)

        def replay():
            self.replays += 1
            out.copy_(slot.step_module(*args, **kwargs))
        return types.SimpleNamespace(replay=replay), out


@pytest.mark.slow
def test_through_the_whole_call_path_every_step_after_the_second_replays_and_tokens_hold(monkeypatch):
    from streamdag.frontend import inductor_backend
    from streamdag.frontend import whole_call as wc

    pick = inductor_backend.GraphRunner._uncaptured_pick

    def as_if_on_a_gpu(self, *args):  # Inductor's CPU code stands for the GPU's in a whole call
        run = pick(self, *args)
        self.not_whole = ""
        return run

    monkeypatch.setattr(inductor_backend.GraphRunner, "_uncaptured_pick", as_if_on_a_gpu)
    monkeypatch.setattr(wc, "_one_cuda_device", lambda args, kwargs: (torch.device("cpu"), ""))
    model = _llama(seed=9)
    dec = sd.decoder(model, max_length=48, compile=True)
    dev = _CacheKeepingDevice(lambda: dec._slots[2])
    monkeypatch.setattr(wc, "_device_for", lambda device, pool: dev)
    gen = torch.Generator().manual_seed(9)
    for length in (7, 12):
        ids = torch.randint(0, 128, (2, length), generator=gen)
        assert torch.equal(dec.generate(ids, 14, **EVERY), _hf_greedy(model, ids, 14, **EVERY))
    stats = dec.statistics()[2]
    assert stats.graphs == 1 and stats.whole_captures == 1
    assert stats.whole_replays == dev.replays == 2 * 13 - 2, dec.explain()


# -- on a GPU ----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 8])
def test_cuda_every_step_replays_one_whole_call_graph_and_tokens_equal_generate(batch):
    model = _llama(hidden=256, layers=4, vocab=2048, device="cuda")
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, 2048, (batch, 64), generator=gen).cuda()
    new = 48
    dec = sd.decoder(model, max_length=160)
    assert torch.equal(dec.generate(ids, new, **EVERY), _hf_greedy(model, ids, new, **EVERY))
    stats = dec.statistics()[batch]
    assert stats.graphs == 1  # one compile: the position is data
    assert stats.whole_captures == 1 and stats.recaptures == 0
    # the first step compiles, the second is captured after its warm-up, every later one replays
    assert stats.whole_replays == new - 1 - 2
    ids2 = torch.randint(0, 2048, (batch, 30), generator=gen).cuda()
    assert torch.equal(dec.generate(ids2, new, **EVERY), _hf_greedy(model, ids2, new, **EVERY))
    stats = dec.statistics()[batch]
    assert stats.whole_captures == 1 and stats.graphs == 1
    assert stats.whole_replays == 2 * (new - 1) - 2


@pytest.mark.cuda
def test_cuda_a_full_size_1b_decoder_generates_eager_generates_tokens(no_tf32):
    """Llama 3.2 1B's shapes with random weights, in fp32 (TF32 off): the compiled, packed and captured
    steps pick the tokens of Hugging Face's eager greedy generate (in bf16, near-tied logits may pick
    another token wherever two kernels round differently)."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=1024)
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(3)).cuda()
    new = 40
    expected = _hf_greedy(model, ids, new, **EVERY)
    dec = sd.decoder(model, max_length=ids.shape[1] + new)
    assert torch.equal(dec.generate(ids, new, **EVERY), expected)
    text = dec.explain()
    assert "32 groups of linear layers over one input run as one product" in text, text
    assert dec.statistics()[2].whole_replays == new - 1 - 2


@pytest.mark.cuda
def test_cuda_steps_are_queued_ahead_of_the_token_being_read():
    model = _llama(hidden=256, layers=4, vocab=2048, device="cuda")
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(7)).cuda()
    dec = sd.decoder(model, max_length=64, lookahead=3)
    dec.generate(ids, 8)  # compile and capture first
    stream = dec.stream(ids, 20, eos_token_id=None)  # every token, whatever it is
    first = next(stream)
    assert stream.enqueued == 1 + 3 and stream.read == 1
    assert stream.host.is_pinned() and first.shape == (1,)
    rest = list(stream)
    assert len(rest) == 19 and stream.enqueued == 20


@pytest.mark.cuda
def test_cuda_regions_of_a_decode_step_run_on_streams_inside_the_whole_call_graph():
    model = _llama(hidden=256, layers=2, vocab=2048, device="cuda")
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(8)).cuda()
    dec = sd.decoder(model, max_length=64, regions="always")
    assert torch.equal(dec.generate(ids, 24, **EVERY), _hf_greedy(model, ids, 24, **EVERY))
    text = dec.explain()
    assert "its regions on" in text, text
    assert dec.statistics()[2].whole_captures == 1


def test_the_decode_bench_profile_says_where_a_step_spends_its_time():
    from bench_scripts import bench_script

    with bench_script("llm_decode") as bench:
        model = bench.build("tiny", "cpu", torch.float32, 48)
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        prof = bench.profile_variant(bench.Variant("hf_eager", model, 16, 8), ids, 8, "cpu", top=5)
        shown = bench.profile_table({"profile": {"hf_eager": prof}})
    times = [k["us_per_token"] for k in prof["top"]]
    assert len(times) == 5 and times == sorted(times, reverse=True) and times[-1] > 0
    assert prof["busy_ms_per_token"] * 1e3 >= sum(times) and prof["kernels_per_token"] >= 5
    assert prof["top"][0]["name"] in shown and "us/token" in shown


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 4), length=st.integers(1, 9), new=st.integers(1, 14), eos_picks=st.integers(0, 3),
       pad=st.sampled_from([None, 0, 5]), lookahead=st.integers(0, 3),
       read=st.sampled_from(["generate", "stream"]), seed=st.integers(0, 2**16))
def test_random_requests_with_ends_of_sequence_give_hugging_face_generates_tokens(
        batch, length, new, eos_picks, pad, lookahead, read, seed):
    """End-of-sequence ids drawn from the tokens the model makes (so that sequences end at various
    steps), paddings, lookaheads and prompts of one decoder, one after another, against generate."""
    model = _random_model()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, length), generator=gen)
    free = _hf_greedy(model, ids, new, eos_token_id=None, pad_token_id=0)[:, length:].flatten().tolist()
    eos = sorted({free[int(i)] for i in torch.randint(0, len(free), (eos_picks,), generator=gen)}) or None
    expected = _hf_greedy(model, ids, new, eos_token_id=eos, pad_token_id=pad)
    dec = _RANDOM_DECODERS.setdefault(lookahead, sd.decoder(model, max_length=32, lookahead=lookahead))
    if read == "generate":
        got = dec.generate(ids, new, eos_token_id=eos, pad_token_id=pad)
    else:
        tokens = list(dec.stream(ids, new, eos_token_id=eos, pad_token_id=pad))
        got = torch.cat([ids, torch.stack(tokens, 1)], 1) if tokens else ids
    assert torch.equal(got, expected), (eos, pad, got, expected)


_RANDOM_DECODERS: dict[int, object] = {}  # one decoder per lookahead, reused from request to request


@functools.cache
def _random_model() -> torch.nn.Module:
    return _llama(seed=11)


def test_a_model_cast_to_another_dtype_after_decoding_decodes_in_it():
    model = _llama()
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    dec = sd.decoder(model, max_length=32)
    assert torch.equal(dec.generate(ids, 5, **EVERY), _hf_greedy(model, ids, 5, **EVERY))
    model.to(torch.bfloat16)
    assert torch.equal(dec.generate(ids, 5, **EVERY), _hf_greedy(model, ids, 5, **EVERY))


def test_end_of_sequence_ids_are_taken_as_model_generate_takes_them():
    import numpy as np

    model = _llama()
    ids = torch.randint(1, 128, (1, 4), generator=torch.Generator().manual_seed(4))
    dec = sd.decoder(model, max_length=16)
    expected = dec.generate(ids, 6, eos_token_id=[7, 9])
    for eos in (torch.tensor([7, 9]), [np.int64(7), 9]):
        assert torch.equal(dec.generate(ids, 6, eos_token_id=eos), expected)
    assert torch.equal(dec.generate(ids, 6, eos_token_id=torch.tensor(7)),
                       dec.generate(ids, 6, eos_token_id=7))
    with pytest.raises(ValueError, match="eos_token_id must be an int, a list of ints or None"):
        dec.generate(ids, 2, eos_token_id="7")
    with pytest.raises(ValueError, match="lookahead must be a whole number of steps"):
        sd.decoder(model, max_length=16, lookahead=1.5)


def test_a_prompt_model_generate_would_mask_warns_a_mask_with_zeros_is_refused_and_ones_are_taken():
    model = _llama()
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]])  # the first row left-padded
    dec = sd.decoder(model, max_length=16)
    with pytest.warns(sd.StreamdagWarning, match=r"the prompt holds the padding id 0, which model\.generate"):
        dec.generate(ids, 4)
    with pytest.raises(ValueError, match="attention_mask must be all ones"):
        dec.generate(ids, 4, attention_mask=(ids != 0).long())
    ones = torch.ones_like(ids)  # the zeros are tokens: as model.generate with that mask
    assert torch.equal(dec.generate(ids, 4, attention_mask=ones, **EVERY), _hf_greedy(model, ids, 4, **EVERY))


def test_the_cache_goes_by_the_keyword_the_models_forward_takes_it_by():
    """Newer Hugging Face releases take the cache as ``cache`` and deprecate ``past_key_values``;
    older ones take ``past_key_values`` alone."""
    import inspect

    from streamdag.frontend.decode import cache_keyword

    model = _llama(hidden=32, layers=1)
    assert cache_keyword(model) in inspect.signature(model.forward).parameters

    class Newer(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None, use_cache=True, logits_to_keep=0):
            return input_ids

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
            return input_ids

    class Anything(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args

    assert [cache_keyword(m()) for m in (Newer, Older, Anything)] == ["cache", "past_key_values",
                                                                        "past_key_values"]
