"""streamdag.compile on Hugging Face models of every family, built small from their configs: an
encoder, decoders with a language-model head, an encoder-decoder, vision transformers with global
and windowed attention (one returning a view of its hidden states beside them), a convolutional
net, a dense-prediction net and a speech model. Each runs as eager does (the same outputs, in the
model's own output class), compiled, with nothing run eagerly and no warning; on a GPU, later
calls replay one captured whole-call graph. Training steps through them (graph breaks included)
leave the parameters as eager's steps do."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import streamdag as sd

tf = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 2, 16, 100
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _text(generator: torch.Generator, decoder_seq: int = 0) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
              "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
    if decoder_seq:
        inputs["decoder_input_ids"] = torch.randint(0, VOCAB, (BATCH, decoder_seq), generator=generator)
    return inputs


def _pixels(generator: torch.Generator, size: int = 32) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=generator)}


FAMILIES = {
    "bert": (lambda: tf.BertModel(tf.BertConfig(vocab_size=VOCAB, **SMALL)), _text),
    "gpt2": (lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                      bos_token_id=0, eos_token_id=0)), _text),
    "llama": (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, **SMALL)),
              _text),
    "t5": (lambda: tf.T5Model(tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                          num_heads=4)),
           lambda g: _text(g, decoder_seq=8)),
    "vit": (lambda: tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, **SMALL)), _pixels),
    # its pooled output is a view of its hidden states (their first token): outputs that share memory
    "dinov2": (lambda: tf.Dinov2Model(tf.Dinov2Config(image_size=32, patch_size=8, **SMALL)), _pixels),
    "swin": (lambda: tf.SwinModel(tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                num_heads=[2, 2], window_size=4)), _pixels),
    "convnext": (lambda: tf.ConvNextModel(tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1],
                                                            num_stages=2)), _pixels),
    "segformer": (lambda: tf.SegformerForSemanticSegmentation(tf.SegformerConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_encoder_blocks=2, num_attention_heads=[1, 2],
        sr_ratios=[2, 1], decoder_hidden_size=16, strides=[4, 2], patch_sizes=[7, 3], mlp_ratios=[2, 2])),
        _pixels),
    "wav2vec2": (lambda: tf.Wav2Vec2Model(tf.Wav2Vec2Config(
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=0.0, **SMALL)),  # (no random masks)
        lambda g: {"input_values": torch.randn(BATCH, 400, generator=g)}),
}


def _tensors(out) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)
            if isinstance(x, torch.Tensor)]


def _calls_equal_eager(name: str, device: str, calls: int):
    make_model, make_inputs = FAMILIES[name]
    torch.manual_seed(0)
    model = make_model().eval().to(device)
    g = torch.Generator().manual_seed(1)
    batches = [{k: v.to(device) for k, v in make_inputs(g).items()} for _ in range(calls)]
    fast = sd.compile(model)
    graphs_at_first_call = None
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)  # no fallback, however quiet
        for inputs in batches:
            expected, got = model(**inputs), fast(**inputs)
            if graphs_at_first_call is None:
                graphs_at_first_call = fast.statistics().graphs
            assert type(got) is type(expected)
            want, have = _tensors(expected), _tensors(got)
            assert len(have) == len(want)
            for a, b in zip(have, want):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    stats = fast.statistics()
    assert stats.eager_calls == 0 and stats.fallbacks == 0
    assert stats.graphs == graphs_at_first_call >= 1  # inputs of the same shapes compile nothing more
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_model_of_each_family_compiles_once_and_runs_as_eager(name):
    _calls_equal_eager(name, "cpu", calls=2)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_on_cuda_a_model_of_each_family_replays_one_whole_call_graph(name):
    stats = _calls_equal_eager(name, "cuda", calls=5)
    assert stats.whole_captures == 1 and stats.whole_replays >= 2, stats


def _without_randomness(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout and stochastic depth off (``nn.Dropout``, and the rates modules keep as floats named
    for dropping): a compiled graph draws its random numbers in another order than eager, so only
    a model without them can be compared step by step."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name, value in vars(m).items():
            if isinstance(value, float) and "drop" in name:
                setattr(m, name, 0.0)
    return model


def _loss(out) -> torch.Tensor:
    return sum(t.float().square().mean() for t in _tensors(out) if t.is_floating_point())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2", "t5", "vit", "wav2vec2"])
def test_training_steps_through_a_model_of_each_family_update_parameters_as_eager(name):
    make_model, make_inputs = FAMILIES[name]
    torch.manual_seed(0)
    model = _without_randomness(make_model().train())
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [make_inputs(g) for _ in range(3)]
    fast = sd.compile(model)
    steps = [(fast, torch.optim.SGD(model.parameters(), lr=0.1)),
             (ref, torch.optim.SGD(ref.parameters(), lr=0.1))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        for inputs in batches:
            for fn, opt in steps:
                opt.zero_grad()
                _loss(fn(**inputs)).backward()
                opt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)
    assert fast.statistics().eager_calls == 0
