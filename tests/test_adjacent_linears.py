"""Linear layers over one input whose weights lie side by side run as one product, only while they do,
and the decoder's grouped-query attention computes what Hugging Face's sdpa does."""

from __future__ import annotations

import warnings

import pytest
import torch

import streamdag as sd
from streamdag.frontend.adjacent_linears import pack_sibling_linears


class Block(torch.nn.Module):
    def __init__(self, bias: bool = False, d: int = 16) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(d, d, bias=bias)
        self.k_proj = torch.nn.Linear(d, d // 2, bias=bias)
        self.v_proj = torch.nn.Linear(d, d // 2, bias=bias)
        self.o_proj = torch.nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(*x.shape[:-1], 4, -1)  # a view of the result, as attention code makes
        k, v = self.k_proj(x), self.v_proj(x)
        return self.o_proj(q.flatten(-2)) + torch.cat([k, v], -1).relu()


def _fused_groups(compiled) -> int:
    text = compiled.explain()
    return sum(int(line.split()[0]) for line in text.splitlines() if "groups of linear layers" in line)


def _block(bias: bool, seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block(bias).eval()


@pytest.mark.parametrize("bias", [False, True])
def test_packing_keeps_each_parameter_and_its_values_and_lays_them_side_by_side(bias):
    block = _block(bias)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    params = {n: p for n, p in block.named_parameters()}
    assert pack_sibling_linears(block) == 1
    assert pack_sibling_linears(block) == 0  # already packed
    assert {n: p for n, p in block.named_parameters()} == params  # the same objects
    for k, v in block.state_dict().items():
        assert torch.equal(v, before[k]), k
    q, k, v = block.q_proj.weight, block.k_proj.weight, block.v_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    assert block.o_proj.weight.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    if bias:
        assert block.k_proj.bias.data_ptr() == block.q_proj.bias.data_ptr() + 16 * 4


@pytest.mark.parametrize("bias", [False, True])
def test_packed_projections_run_as_one_product_and_equal_eager(bias, fresh_dynamo):
    block = _block(bias)
    pack_sibling_linears(block)
    compiled = sd.compile(block)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        expected = block(x)
        got = compiled(x)
    torch.testing.assert_close(got, expected)
    assert _fused_groups(compiled) == 1, compiled.explain()


def test_weights_apart_in_memory_or_gradients_on_are_left_as_separate_products(fresh_dynamo):
    x = torch.randn(3, 16)
    apart = sd.compile(_block(False))
    with torch.no_grad():
        apart(x)
    assert _fused_groups(apart) == 0  # negative control: the weights are not side by side
    block = _block(False)
    pack_sibling_linears(block)
    with_grad = sd.compile(block)
    out = with_grad(x)
    out.sum().backward()
    assert _fused_groups(with_grad) == 0
    assert block.k_proj.weight.grad is not None and block.k_proj.weight.grad.abs().sum() > 0


def _packed_and_compiled(bias: bool) -> tuple[Block, object, torch.Tensor]:
    block = _block(bias)
    pack_sibling_linears(block)
    compiled = sd.compile(block)
    x = torch.randn(4, 16)
    with torch.no_grad():
        compiled(x)
    return block, compiled, x


def test_a_weight_moved_after_the_compile_is_read_where_it_now_is(fresh_dynamo):
    block, compiled, x = _packed_and_compiled(True)
    with torch.no_grad():
        block.k_proj.weight.data = torch.randn(8, 16)  # a new tensor, elsewhere; same shape
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(x)
            again = compiled(x)
        expected = block(x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(again, expected)
    assert sum("at this call they do not" in str(w.message) for w in caught) == 1
    assert "2 calls ran as traced" in compiled.explain()


def test_a_weight_updated_in_place_is_read_by_the_fused_product(fresh_dynamo):
    block, compiled, x = _packed_and_compiled(False)
    with torch.no_grad():
        block.v_proj.weight.mul_(-2.0)
        torch.testing.assert_close(compiled(x), block(x))


class _WritesBetween(torch.nn.Module):
    """q, then an in-place write (to a weight or to the shared input), then k and v."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.block = _block(False)
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        h = x.clone()
        q = b.q_proj(h)
        if self.target == "weight":
            b.k_proj.weight.mul_(0.5)
        else:
            h.add_(1.0)
        return torch.cat([q, b.k_proj(h), b.v_proj(h)], -1)


def _compiled_against_eager(cls, target: str):
    """``cls(target)`` packed and compiled, called twice against an unpacked copy run eagerly (its
    writes repeat at each call, in both): the compiled model."""
    model = cls(target).eval()
    pack_sibling_linears(model.block)
    reference = cls(target).eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 16)
    with torch.no_grad():
        compiled = sd.compile(model)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), reference(x))
    torch.testing.assert_close(model.state_dict(), reference.state_dict())
    return compiled


@pytest.mark.parametrize("target", ["weight", "input"])
def test_linear_layers_with_a_write_between_them_stay_apart(target, fresh_dynamo):
    compiled = _compiled_against_eager(_WritesBetween, target)
    assert _fused_groups(compiled) == 0


class _WritesBefore(torch.nn.Module):
    """A write into a weight (or a view of it) of the group, or into an unrelated buffer, before it."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.block = _block(False)
        self.register_buffer("steps", torch.zeros(()))
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        if self.target == "first weight":
            b.q_proj.weight.add_(0.125)
        elif self.target == "a view of a later weight":
            b.v_proj.weight[0].mul_(-1.0)
        else:
            self.steps.add_(1)  # (a decode step's cache and counters are written so: no weight)
        return torch.cat([b.q_proj(x), b.k_proj(x), b.v_proj(x)], -1) + self.steps


@pytest.mark.parametrize("target, fused", [("first weight", 0), ("a view of a later weight", 0),
                                           ("a buffer", 1)])
def test_a_write_before_the_layers_into_their_weights_keeps_them_apart(target, fused, fresh_dynamo):
    # (the graph as traced reads what the write made: one product over the block would not)
    compiled = _compiled_against_eager(_WritesBefore, target)
    assert _fused_groups(compiled) == fused, compiled.explain()


class _Between(torch.nn.Module):
    """q over h, then ``between(h)``, then k and v over h."""

    def __init__(self, between) -> None:
        super().__init__()
        self.block = _block(False)
        self.between = between

    def forward(self, x: torch.Tensor):
        b = self.block
        h = x.clone()
        q = b.q_proj(h)
        self.between(h)
        return q, b.k_proj(h), b.v_proj(h)


class _AutocastBetween(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _block(False)

    def forward(self, x: torch.Tensor):
        b = self.block
        q = b.q_proj(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            k = b.k_proj(x)
        return q, k, b.v_proj(x)


_WRITERS = {
    "positional inplace (LeakyReLU)": lambda: torch.nn.LeakyReLU(0.2, inplace=True),
    "positional inplace (ReLU6)": lambda: torch.nn.ReLU6(inplace=True),
    "F.relu(h, True)": lambda: (lambda h: torch.nn.functional.relu(h, True)),
    "__iadd__": lambda: (lambda h: h.__iadd__(1.0)),
    "a checkpointed body": lambda: (lambda h: torch.utils.checkpoint.checkpoint(
        lambda t: t.add_(1.0), h, use_reentrant=False)),
}


@pytest.mark.parametrize("writer", [*_WRITERS, "autocast"])
def test_every_way_of_writing_or_switching_modes_between_layers_keeps_them_apart(writer, fresh_dynamo):
    if writer == "autocast":
        model, reference = _AutocastBetween().eval(), _AutocastBetween().eval()
    else:
        model, reference = _Between(_WRITERS[writer]()).eval(), _Between(_WRITERS[writer]()).eval()
    reference.load_state_dict(model.state_dict())
    pack_sibling_linears(model.block)
    x = torch.randn(3, 16)
    with torch.no_grad():
        compiled = sd.compile(model)
        for got, expected in zip(compiled(x), reference(x)):
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected)
    assert _fused_groups(compiled) == 0


def test_a_graph_reused_for_other_buffers_reads_its_fused_weights_in_place(fresh_dynamo):
    from streamdag.frontend import inductor_backend as ib

    class Buffers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = torch.randn(32, 16)
            self.register_buffer("wq", w[:16])
            self.register_buffer("wk", w[16:])

        def forward(self, x):
            f = torch.nn.functional.linear
            return f(x, self.wq) + 2 * f(x, self.wk)

    backend = ib.StreamdagBackend()
    fn = torch.compile(lambda blk, x: blk(x), backend=backend)
    first, second, x = Buffers(), Buffers(), torch.randn(3, 16)
    seen = []
    call = ib.GraphRunner.__call__

    def spy(self, *args):
        seen.append(args)
        return call(self, *args)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(ib.GraphRunner, "__call__", spy)
        fn(first, x)
        torch.testing.assert_close(fn(second, x), second(x))
    runner, args = backend.runners[0], seen[-1]
    assert runner.layout is not None and runner.layout.holds(args)
    # a captured graph copies the inputs it does not read in place: never the fused weights
    assert {i for indices, _ in runner.layout.groups for i in indices} <= set(runner._static(args))


def test_models_whose_code_tests_for_sdpa_keep_their_attention():
    import transformers.models.falcon.modeling_falcon
    import transformers.models.llama.modeling_llama  # noqa: F401

    from streamdag.frontend.decode_attention import _names_sdpa

    assert _names_sdpa("transformers.models.falcon.modeling_falcon")
    assert not _names_sdpa("transformers.models.llama.modeling_llama")


class _GradInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _block(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        with torch.enable_grad():
            return b.q_proj(x).sum() + b.k_proj(x).sum() + b.v_proj(x).sum()


def test_linear_layers_that_run_with_gradients_turned_on_inside_stay_apart_and_get_their_gradients(
        fresh_dynamo):
    model = _GradInside()
    pack_sibling_linears(model.block)
    compiled = sd.compile(model)
    x = torch.randn(3, 16)
    with torch.no_grad():
        out = compiled(x)
    out.backward()
    assert _fused_groups(compiled) == 0
    grads = [getattr(model.block, n).weight.grad for n in ("q_proj", "k_proj", "v_proj")]
    assert all(g is not None and torch.allclose(g, x.sum(0).expand_as(g)) for g in grads)


def test_weights_passed_as_arguments_are_never_fused_even_side_by_side(fresh_dynamo):
    from streamdag.frontend.inductor_backend import StreamdagBackend

    def two(x, wa, wb):
        return torch.nn.functional.linear(x, wa), torch.nn.functional.linear(x, wb)

    backend = StreamdagBackend()
    fn = torch.compile(two, backend=backend)
    x = torch.randn(3, 16)
    with torch.no_grad():
        for rows in ((4, 4), (6, 6), (6, 3)):  # the last two under symbolic shapes
            w = torch.randn(sum(rows), 16)
            a, b = w[:rows[0]], w[rows[0]:]
            for got, expected in zip(fn(x, a, b), two(x, a, b)):
                torch.testing.assert_close(got, expected)
    assert "groups of linear layers" not in backend.explain()


def test_linear_layers_called_with_keyword_inputs_are_grouped_by_their_real_input(fresh_dynamo):
    class Keywords(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(16, 32, bias=False)
            self.up_proj = torch.nn.Linear(16, 32, bias=False)

        def forward(self, x, y):
            f = torch.nn.functional.linear
            apart = f(input=x, weight=self.gate_proj.weight) * f(input=y, weight=self.up_proj.weight)
            together = f(input=x, weight=self.gate_proj.weight) * f(input=x, weight=self.up_proj.weight)
            return apart + together

    model = Keywords().eval()
    pack_sibling_linears(model)
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        compiled = sd.compile(model)
        torch.testing.assert_close(compiled(x, y), model(x, y))
    assert not [w for w in caught if "make_fx" in str(w.message)]
    assert _fused_groups(compiled) == 1, compiled.explain()


def test_a_graph_whose_weights_moved_takes_no_part_in_a_whole_call_graph(fresh_dynamo):
    from streamdag.frontend.whole_call import NotWholeCapturable, _active

    block, compiled, x = _packed_and_compiled(False)
    block.k_proj.weight.data = torch.randn(8, 16)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        with _active("warm") as active:  # as in a whole call's warm-up: the graph says it cannot join
            torch.testing.assert_close(compiled(x), block(x))
            assert "fused linear layers have moved" in active.refusal
        with _active("capture"), pytest.raises(NotWholeCapturable):
            compiled(x)


class _Counting(torch.nn.Module):
    """A packed gate/up pair and a buffer each call adds one to."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(16, 16, bias=False)
        self.up_proj = torch.nn.Linear(16, 16, bias=False)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.gate_proj(x) * self.up_proj(x)


@pytest.mark.slow
def test_through_a_whole_call_a_moved_weight_is_read_where_it_is_and_the_state_updated_once_per_call(
        fake_device, cpu_code_as_gpus):
    torch.manual_seed(0)
    model = _Counting().eval()
    pack_sibling_linears(model)
    with torch.inference_mode():  # an inference buffer: no version counter shows its writes
        model.calls = torch.zeros(())
    fake_device(model)
    compiled = sd.compile(model)
    x = torch.randn(2, 16)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            compiled(x)
        assert compiled.statistics().whole_replays >= 1 and _fused_groups(compiled) == 1
        model.up_proj.weight.data = torch.randn(16, 16)
        for _ in range(4):
            torch.testing.assert_close(compiled(x), model.gate_proj(x) * model.up_proj(x))
        model.some_flag = True  # a state check fails: the call takes Dynamo's path
        compiled(x)
    assert model.calls.item() == 9


tf = pytest.importorskip("transformers")


def test_grouped_attention_equals_sdpa_at_every_decode_step():
    from transformers.cache_utils import StaticCache

    from streamdag.frontend.decode import cache_keyword
    from streamdag.frontend.decode_attention import NAME, attention_for_decode

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    logits = {}
    for grouped in (False, True):
        cache = {cache_keyword(model): StaticCache(config=model.config, max_cache_len=24)}
        steps = []
        with torch.inference_mode():
            out = model(input_ids=ids, **cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(5):
                if grouped:
                    with attention_for_decode(model):
                        assert model.config._attn_implementation == NAME
                        out = model(input_ids=token, **cache, use_cache=True)
                else:
                    out = model(input_ids=token, **cache, use_cache=True)
                steps.append(out.logits)
                token = out.logits[:, -1:].argmax(-1)
        logits[grouped] = torch.stack(steps)
    assert model.config._attn_implementation == "sdpa"  # put back
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


def test_a_model_with_another_attention_is_left_as_it_is():
    from streamdag.frontend.decode_attention import attention_for_decode

    cfg = tf.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "eager"
    model = tf.LlamaForCausalLM(cfg).eval()
    with attention_for_decode(model):
        assert model.config._attn_implementation == "eager"


@pytest.mark.cuda
def test_on_cuda_the_fused_product_replays_in_the_whole_call_and_a_moved_weight_is_read_where_it_is(
        no_tf32, fresh_dynamo):
    block = _block(True).cuda()
    pack_sibling_linears(block)
    compiled = sd.compile(block)
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(compiled(x), block(x))
        assert compiled.statistics().whole_replays >= 1 and _fused_groups(compiled) == 1
        block.k_proj.weight.data = torch.randn(8, 16, device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                torch.testing.assert_close(compiled(x), block(x))


def test_a_packed_hugging_face_model_saves_and_loads_as_it_was(tmp_path):
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # biased q/k/v
    model = tf.Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits
    assert pack_sibling_linears(model) == 4
    model.save_pretrained(tmp_path)
    loaded = tf.Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected)
        torch.testing.assert_close(model(ids).logits, expected)


def test_projections_made_under_inference_mode_are_packed_and_fused(fresh_dynamo):
    with torch.inference_mode():
        block = _block(True)
        x = torch.randn(3, 16)
        expected = block(x)
    assert block.q_proj.weight.is_inference()
    assert pack_sibling_linears(block) == 1
    assert block.k_proj.weight.data_ptr() == block.q_proj.weight.data_ptr() + 16 * 16 * 4
    compiled = sd.compile(block)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), expected)
        torch.testing.assert_close(block(x), expected)
    assert _fused_groups(compiled) == 1, compiled.explain()


@pytest.mark.cuda
def test_on_cuda_a_stateful_call_whose_weights_moved_updates_its_state_once_per_call(fresh_dynamo):
    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(64, 64, bias=False)
            self.up_proj = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x):
            self.n.add_(1)
            return self.gate_proj(x) * self.up_proj(x)

    torch.manual_seed(0)
    model = Counting().cuda().eval()
    pack_sibling_linears(model)
    x = torch.randn(4, 64, device="cuda")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.register_buffer("n", torch.zeros(1, device="cuda"))
        compiled = sd.compile(model)
        for _ in range(4):
            compiled(x)
        model.up_proj.weight.data = model.up_proj.weight.data.clone()
        for _ in range(5):
            compiled(x)
        before = model.n.item()
        model.other = 1  # a change of state the whole call's checks see
        torch.testing.assert_close(compiled(x), model.gate_proj(x) * model.up_proj(x))
        assert model.n.item() - before == 1


def test_the_attention_switch_changes_only_the_configs_on_sdpa_and_puts_each_back():
    from streamdag.frontend.decode_attention import NAME, attention_for_decode

    cfg = tf.LlavaConfig(text_config=tf.LlamaConfig(num_hidden_layers=1),
                         vision_config=tf.CLIPVisionConfig(num_hidden_layers=1))
    cfg._attn_implementation = {"": "sdpa", "text_config": "sdpa", "vision_config": "eager"}
    model = torch.nn.Module()
    model.config = cfg
    model._supports_attention_backend = True
    with attention_for_decode(model):
        assert (cfg._attn_implementation, cfg.text_config._attn_implementation,
                cfg.vision_config._attn_implementation) == (NAME, NAME, "eager")
    assert (cfg._attn_implementation, cfg.text_config._attn_implementation,
            cfg.vision_config._attn_implementation) == ("sdpa", "sdpa", "eager")


def test_a_model_that_tests_for_sdpa_in_its_own_code_decodes_as_hugging_face_does():
    torch.manual_seed(0)  # Falcon reads config._attn_implementation == "sdpa" itself
    cfg = tf.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_kv_heads=2, new_decoder_architecture=True, alibi=False, initializer_range=0.5)
    cfg._attn_implementation = "sdpa"
    model = tf.FalconForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    got = sd.decoder(model, max_length=40, compile=False).generate(ids, 10, eos_token_id=None)
    assert torch.equal(got, expected)


def test_overlapping_decodes_of_one_model_switch_its_attention_back_when_the_last_one_ends():
    from contextlib import ExitStack

    from streamdag.frontend.decode_attention import NAME, attention_for_decode

    cfg = tf.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = tf.LlamaForCausalLM(cfg).eval()
    first, second = ExitStack(), ExitStack()  # two threads' streams, as their blocks interleave
    first.enter_context(attention_for_decode(model))
    second.enter_context(attention_for_decode(model))
    first.close()
    assert model.config._attn_implementation == NAME  # the second still decodes
    second.close()
    assert model.config._attn_implementation == "sdpa"


def test_subclassed_layers_and_parameters_are_left_as_they_are():
    class Quantized(torch.nn.Linear):  # stands for a layer that keeps state beside its weight
        pass

    class Flagged(torch.nn.Parameter):
        pass

    block = _block(False)
    block.k_proj = Quantized(16, 8, bias=False)
    assert pack_sibling_linears(block) == 0
    block = _block(False)
    block.v_proj.weight = Flagged(block.v_proj.weight.detach())
    assert pack_sibling_linears(block) == 0
    assert pack_sibling_linears(_block(False)) == 1  # control


def test_explain_names_the_grouped_attention_only_for_models_with_grouped_heads():
    from streamdag.frontend.decode_attention import describe

    def llama(kv_heads: int):
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=4,
                                                  num_key_value_heads=kv_heads))

    assert "enable_gqa" in describe(llama(2))
    assert "enable_gqa" not in describe(llama(4))
