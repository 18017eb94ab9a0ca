"""The models of ``bench/zoo.py`` (and ``bench/train.py``): torchvision classification and
segmentation models and Hugging Face models built from their configs, with random weights and no
downloads, and the comparison of their outputs."""

from __future__ import annotations

from typing import Any

QUICK = ("resnet50", "googlenet", "inception_v3", "mobilenet_v3_large", "efficientnet_b0", "vit_b_16",
         "bert", "llama")

# name: image size
TORCHVISION = {
    "resnet18": 224, "resnet50": 224, "resnext50_32x4d": 224, "wide_resnet50_2": 224,
    "regnet_y_400mf": 224, "regnet_x_1_6gf": 224, "efficientnet_b0": 224, "efficientnet_v2_s": 384,
    "mobilenet_v2": 224, "mobilenet_v3_large": 224, "mobilenet_v3_small": 224,
    "shufflenet_v2_x1_0": 224, "squeezenet1_1": 224, "convnext_tiny": 224, "vit_b_16": 224,
    "swin_t": 224, "maxvit_t": 224, "densenet121": 224, "mnasnet1_0": 224, "vgg16": 224,
    "alexnet": 224, "googlenet": 224, "inception_v3": 299,
}
SEGMENTATION = {"deeplabv3_mobilenet_v3_large": 520, "fcn_resnet50": 520}
HF = ("bert", "distilbert", "gpt2", "t5_encoder", "llama", "hf_vit")
MODELS = (*TORCHVISION, *SEGMENTATION, *HF)
SEQ = 128


# -- models ----------------------------------------------------------------------------------------------

def build(name: str) -> Any:
    """The model (random weights, eval mode, on the CPU) and a function (batch, dtype) -> its inputs."""
    import torch

    if name in TORCHVISION or name in SEGMENTATION:
        import torchvision

        if name in TORCHVISION:
            kwargs: dict[str, Any] = {"weights": None}
            if name in ("googlenet", "inception_v3"):
                kwargs.update(aux_logits=False, init_weights=False)
            model = getattr(torchvision.models, name)(**kwargs)
            size = TORCHVISION[name]
        else:
            model = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None,
                                                                   aux_loss=False)
            size = SEGMENTATION[name]

        def inputs(batch: int, dtype: torch.dtype) -> tuple[tuple, dict]:
            return (torch.randn(batch, 3, size, size, device="cuda", dtype=dtype),), {}
        return _no_zero_weights(model).eval(), inputs
    return _build_hf(name)


def _no_zero_weights(model: Any) -> Any:
    """``model`` with its all-zero weights drawn at random: a head initialised to zeros (ViT's,
    Swin's) makes every output zero, and a comparison with eager's output then checks nothing."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.02)
    return model


def _build_hf(name: str) -> Any:
    import torch
    import transformers as tf

    if name == "bert":
        model = tf.BertModel(tf.BertConfig())
    elif name == "distilbert":
        model = tf.DistilBertModel(tf.DistilBertConfig())
    elif name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config())
    elif name == "t5_encoder":
        model = tf.T5EncoderModel(tf.T5Config())
    elif name == "llama":  # a small Llama-style decoder: grouped-query attention, RoPE, SwiGLU
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048))
    elif name == "hf_vit":
        model = tf.ViTModel(tf.ViTConfig())

        def pixels(batch: int, dtype: torch.dtype) -> tuple[tuple, dict]:
            return (), {"pixel_values": torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)}
        return model.eval(), pixels
    else:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    vocab = model.config.vocab_size

    def ids(batch: int, dtype: torch.dtype) -> tuple[tuple, dict]:
        g = torch.Generator(device="cuda").manual_seed(0)
        return (), {"input_ids": torch.randint(0, vocab, (batch, SEQ), device="cuda", generator=g)}
    return model.eval(), ids


def first_tensor(out: Any) -> Any:
    """The tensor to compare: logits, the last hidden state, ``out`` of a segmentation dict, or the first."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state", "out"):
        v = out.get(key) if isinstance(out, dict) else getattr(out, key, None)
        if isinstance(v, torch.Tensor):
            return v
    if isinstance(out, dict):
        return first_tensor(next(iter(out.values())))
    if isinstance(out, (list, tuple)):
        return first_tensor(out[0])
    raise TypeError(f"no tensor in the output ({type(out).__name__})")


def rel_err(a: Any, b: Any) -> float:
    a, b = first_tensor(a).float(), first_tensor(b).float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
