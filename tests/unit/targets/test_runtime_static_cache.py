"""The runtime's one static K/V cache (targets/runtime/static_cache.py) and the attention switch, and the layouts that
build on them: the slot generator's rows, the verifier's committed slots and the drafter's static pass. (Their
end-to-end equalities with Hugging Face generate and the reference decoder are in the generator and eval tests.)"""

import pytest
import torch
import transformers as tf

from dflashkit.eval.draft_step import StaticDraftCache
from dflashkit.eval.kv_cache import KVCache
from dflashkit.extract.generation.slot_cache import SlotCache
from dflashkit.targets.runtime.static_cache import AttentionSwitch, StaticKV


def _kv(rows, heads, n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, n, dim, generator=g), torch.randn(rows, heads, n, dim, generator=g)


def test_buffers_are_allocated_at_the_first_write_shaped_after_the_layer():
    cache = StaticKV(max_len=10)
    key, value = _kv(2, 3, 4, 5, 0)
    keys, values = cache.write(0, key, value, torch.tensor([6, 7, 8, 9]))
    assert keys.shape == values.shape == (2, 3, 10, 5)
    assert torch.equal(keys[:, :, 6:], key) and torch.equal(values[:, :, 6:], value)
    assert not keys[:, :, :6].any()  # unwritten slots stay zero
    other, _ = cache.write(1, *_kv(2, 1, 1, 8, 1), torch.tensor([0]))  # another layer, another head layout
    assert other.shape == (2, 1, 10, 8)
    again, _ = cache.write(0, *_kv(2, 3, 1, 5, 2), torch.tensor([0]))
    assert again.data_ptr() == keys.data_ptr()  # written in place: the addresses a CUDA graph holds
    cache.clear()
    assert not cache.keys and not cache.values


def test_write_columns_puts_one_token_per_row_at_its_own_column():
    cache = StaticKV(max_len=6, rows=3)
    key, value = _kv(3, 2, 1, 4, 3)
    keys, values = cache.write_columns(0, key, value, torch.arange(3), torch.tensor([0, 5, 2]))
    for row, column in enumerate([0, 5, 2]):
        assert torch.equal(keys[row, :, column], key[row, :, 0])
        assert torch.equal(values[row, :, column], value[row, :, 0])
    assert int((keys.abs().sum(dim=(1, 3)) > 0).sum()) == 3  # nothing else was written


def test_the_layouts_share_the_one_cache():
    assert all(issubclass(c, StaticKV) for c in (SlotCache, KVCache, StaticDraftCache))
    kv = KVCache(8)
    kv.write(0, *_kv(1, 2, 3, 4, 4), torch.arange(3))
    kv.length = 3
    kv.reserve(16)  # growing drops the buffers and the committed tokens
    assert kv.max_len == 16 and not kv.keys and kv.length == 0
    with pytest.raises(RuntimeError, match="KV cache of 16 slots is full"):
        kv.length = 10
        kv.check_room(7)
    draft = StaticDraftCache(12)
    draft.slots = torch.tensor([4, 5])
    key, value = _kv(1, 2, 2, 4, 5)
    keys, _ = draft.update(key, value, 0)
    assert keys.shape == (1, 2, 12, 4) and torch.equal(keys[:, :, 4:6], key)


def test_the_slot_cache_prefill_rolls_left_padded_rows_into_columns_from_zero():
    cache = SlotCache(num_slots=4, max_length=8)
    key, value = _kv(2, 1, 5, 3, 6)  # two prompts padded on the left to 5: lengths 5 and 3
    cache.prefill(torch.tensor([3, 1]), torch.tensor([0, 2]))
    cache.update(key, value, 0)
    assert torch.equal(cache.keys[0][3, :, :5], key[0]) and torch.equal(cache.keys[0][1, :, :3], key[1, :, 2:])
    cache.decode(torch.tensor([5, 3, 0, 0]), length=6)
    step_key, step_value = _kv(4, 1, 1, 3, 7)
    keys, values = cache.update(step_key, step_value, 0)
    assert keys.shape == (4, 1, 6, 3)  # attention reads the first `length` columns
    assert torch.equal(keys[1, :, 3], step_key[1, :, 0]) and torch.equal(values[0, :, 5], step_value[0, :, 0])


def test_the_attention_switch_points_every_config_and_back():
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    switch = AttentionSwitch(model)
    before = [c._attn_implementation for c in switch.configs]
    assert before and "eager" not in before  # so that the switch below changes something
    previous = switch.set("eager")
    assert previous == before and all(c._attn_implementation == "eager" for c in switch.configs)
    switch.set(previous)
    assert [c._attn_implementation for c in switch.configs] == before
