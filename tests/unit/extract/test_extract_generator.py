"""The slot generator (static cache, continuous batching): greedy tokens equal Hugging Face ``generate`` for every
attention-only family and the testbed; sampled first and second tokens follow HF's warped distribution; slots are
refilled while prompts wait (several ranks splitting the prompts: tests/integration/test_regenerate_processes.py)."""

import json

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflashkit.extract.generation.generator import SlotGenerator
from dflashkit.targets.loading import load_target
from dflashkit.targets.runtime.parts import attention_only
from dflashkit.targets.runtime.sampling import sample_next

from support.chat_data import REGENERATE_RECORDS, greedy_reference, smollm2_tokenizer
from support.tiny_targets import TINY_FAMILIES, save_tiny_target

ATTENTION_ONLY = [f for f in TINY_FAMILIES if not f.startswith(("qwen3_5", "qwen3_next"))]


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gen-targets")


def _prompts(n, seed=1, low=3, high=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 244, (int(k),), generator=g).tolist() for k in torch.randint(low, high, (n,), generator=g)]


def hf_greedy(model, prompt, max_new, stop_ids):
    """One prompt alone (no padding) through Hugging Face generate, cut before the first stop id."""
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=stop_ids or None, pad_token_id=1)
    new = out[0, len(prompt):].tolist()
    return next((new[:j] for j, t in enumerate(new) if t in stop_ids), new)


@pytest.mark.parametrize("family", ATTENTION_ONLY)
def test_greedy_equals_hf_generate(family, tiny_root):
    model = load_target(save_tiny_target(family, tiny_root / family)).model
    model.generation_config.eos_token_id = None  # the stop ids are the ones given here
    prompts = _prompts(7)  # 7 prompts through 3 slots: refilled slots, prompts longer than gemma's window of 4
    free_run = hf_greedy(model, prompts[0], 12, [])
    stop = free_run[4]  # a token the target really emits, so that some answers stop early
    refs = [hf_greedy(model, p, 12, [stop]) for p in prompts]
    assert any(len(r) < 12 for r in refs) and any(len(r) > 4 for r in refs)
    gen = SlotGenerator(model, [stop], num_slots=3, length_step=16)  # decode steps attend 16, 32 or 48 columns
    assert gen.generate(prompts, 12) == refs
    assert gen.stats["idle_slot_steps_waiting"] == 0  # a finished slot takes the next prompt at once
    assert gen.stats["prefills"] >= 3


def test_recurrent_families_are_left_to_hf_generate(tiny_root):
    for family in ("qwen3_5_text", "qwen3_next"):
        model = load_target(save_tiny_target(family, tiny_root / family)).model
        assert not attention_only(model)
        with pytest.raises(ValueError, match="linear attention"):
            SlotGenerator(model, [3])


def test_regenerate_answers_a_recurrent_target_through_hf_generate(tmp_path):
    """A Qwen3.5 (linear-attention) target takes the Hugging Face path of regenerate; its answers are the greedy
    argmax answers all the same."""
    import transformers as tf

    from dflashkit.extract.generation.answerers import AnswerSettings, TargetGenerator
    from dflashkit.extract.regenerate import main

    torch.manual_seed(0)
    config = tf.Qwen3_5TextConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                  layer_types=["linear_attention", "full_attention"], initializer_range=0.5)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "target")
    smollm2_tokenizer().save_pretrained(tmp_path / "target")
    assert TargetGenerator(str(tmp_path / "target"), AnswerSettings(max_new_tokens=4), batch_size=16).slots is None
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in REGENERATE_RECORDS[:2]))
    out = tmp_path / "out.jsonl"
    assert main(["--target", str(tmp_path / "target"), "--data", str(data), "--out", str(out), "--max-new-tokens",
                 "5", "--batch-size", "2", "--no-progress"]) == 0
    for row in map(json.loads, out.read_text().splitlines()):
        msgs = row["messages"]
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                assert m["content"] == greedy_reference(str(tmp_path / "target"), msgs[:k], 5)


def test_outputs_do_not_depend_on_slots_or_order(tiny_root):
    model = load_target(save_tiny_target("qwen3", tiny_root / "qwen3-order")).model
    prompts = _prompts(9, seed=4)
    a = SlotGenerator(model, [], num_slots=2).generate(prompts, 8)
    b = SlotGenerator(model, [], num_slots=9, prefill_tokens=40).generate(prompts, 8)  # several prefill buckets
    c = SlotGenerator(model, [], num_slots=4).generate(prompts[::-1], 8)[::-1]
    assert a == b == c
    assert all(len(x) == 8 for x in a)


def test_follow_ups_equal_separate_calls(tiny_root):
    """A prompt queued by follow_up (a conversation's next turn) gets what a call of its own would give it."""
    model = load_target(save_tiny_target("qwen3", tiny_root / "qwen3-follow")).model
    prompts = _prompts(6, seed=7)
    gen = SlotGenerator(model, [], num_slots=3)
    alone = gen.generate(prompts, 5)
    second = [p + a + [11, 12] for p, a in zip(prompts, alone)]  # a next turn built from each answer
    want = gen.generate(second, 5)
    asked = []

    def follow_up(r, tokens):
        if r >= len(prompts):
            return None
        asked.append(r)
        return prompts[r] + tokens + [11, 12]

    got = gen.generate(prompts, 5, follow_up=follow_up, max_prompt_length=max(map(len, second)))
    assert sorted(asked) == list(range(6))
    assert got[:6] == alone
    assert [got[6 + k] for k in range(6)] == [want[r] for r in asked]  # request 6 + k follows asked[k]
    with pytest.raises(ValueError, match="max_prompt_length"):
        gen.generate(prompts[:1], 2, follow_up=lambda r, t: prompts[0] * 40 if r == 0 else None)


def _warped(logits, temperature, top_k, top_p):
    """Hugging Face's own warpers (the oracle) on [1, V] logits -> probabilities."""
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                 TopPLogitsWarper(top_p)])
    return torch.softmax(procs(None, logits.float()), dim=-1)[0]


def _tv(counts, probs):
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def test_sampled_tokens_follow_the_warped_distribution(tiny_root):
    """Total variation between the empirical draw and HF's warped softmax, for the first token (prefill) and the
    second (decode step); the same threshold rejects a distribution with a warper left out."""
    model = load_target(save_tiny_target("llama", tiny_root / "llama-sample")).model
    with torch.no_grad():
        for p in model.parameters():  # peakier logits than the random init, so that top-k and top-p both cut
            p.mul_(4.0) if p.ndim == 2 else None
    prompt, n = _prompts(1, seed=7)[0], 6000
    t, k, top_p = 0.9, 12, 0.8
    gen = SlotGenerator(model, [], num_slots=n, temperature=t, top_k=k, top_p=top_p)
    outs = gen.generate([prompt] * n, 2, seed=11)
    with torch.no_grad():
        logits1 = model(input_ids=torch.tensor([prompt])).logits[:, -1]
    first = torch.tensor([o[0] for o in outs])
    counts = torch.bincount(first, minlength=logits1.shape[-1]).double()
    ref = _warped(logits1, t, k, top_p).double()
    assert (counts[ref == 0] == 0).all()  # nothing outside top-k / top-p
    assert _tv(counts, ref) < 0.04
    assert 2 < int((ref > 0).sum()) < k  # top-p cut inside top-k
    assert _tv(counts, _warped(logits1, t, k, 1.0).double()) > 0.04  # without top-p
    assert _tv(counts, _warped(logits1, 2.0, k, top_p).double()) > 0.04  # wrong temperature
    # second token, among rows whose first token is the most common one
    t1 = int(counts.argmax())
    second = torch.tensor([o[1] for o in outs if o[0] == t1])
    with torch.no_grad():
        logits2 = model(input_ids=torch.tensor([prompt + [t1]])).logits[:, -1]
    counts2 = torch.bincount(second, minlength=logits2.shape[-1]).double()
    assert len(second) > 600
    assert _tv(counts2, _warped(logits2, t, k, top_p).double()) < 0.08
    assert _tv(counts2, _warped(logits1, t, k, top_p).double()) > 0.08  # not the first step's distribution


def test_bad_generation_flags_say_what_to_give(tmp_path, capsys):
    from dflashkit.cli import run_main
    from dflashkit.extract.regenerate import main as regenerate_main

    def main(argv):
        return run_main("dflashkit regenerate", regenerate_main, argv)

    (tmp_path / "target").mkdir()  # apart from --out: an output inside an input is refused first
    flags = ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "x.jsonl"), "--out",
             str(tmp_path / "o.jsonl")]
    assert main([*flags, "--top-p", "0"]) == 2  # a user error
    assert "top-p in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*flags, "--batch-size", "0"])
    assert e.value.code == 2 and "--batch-size: '0': give a whole number >= 1" in capsys.readouterr().err


def test_sample_next_greedy_and_seeded():
    logits = torch.randn(5, 50)
    assert torch.equal(sample_next(logits, 0.0, top_k=0, top_p=1.0), logits.argmax(-1))
    torch.manual_seed(3)
    a = sample_next(logits, 1.0, top_k=10, top_p=0.9)
    torch.manual_seed(3)
    assert torch.equal(a, sample_next(logits, 1.0, top_k=10, top_p=0.9))
    assert (sample_next(logits, 1.0, top_k=1, top_p=1.0) == logits.argmax(-1)).all()  # top-k 1 is greedy


@pytest.mark.slow
def test_testbed_greedy_equals_hf_generate():
    target = load_target("testbed:smollm2")
    tok = target.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers."]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for q in questions]
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    refs = [hf_greedy(target.model, p, 16, stop) for p in prompts]
    assert SlotGenerator(target.model, stop, num_slots=2).generate(prompts, 16) == refs


def test_reserve_before_generating_changes_nothing(tiny_root):
    model = load_target(save_tiny_target("qwen3", tiny_root / "qwen3-reserve")).model
    prompts = _prompts(5, seed=9)
    gen = SlotGenerator(model, [], num_slots=2, length_step=16)
    gen.reserve(64)
    assert gen.cache.max_length == 64 and len(gen.cache.keys) == 4
    assert gen.generate(prompts, 10) == SlotGenerator(model, [], num_slots=2).generate(prompts, 10)


def test_the_default_decode_kernel_falls_back_to_sdpa_where_triton_cannot_run(tiny_root, monkeypatch):
    """The default asks for the Triton decode kernel; on a CPU outside the interpreter it cannot run, so the
    generator takes the SDPA path (and says which it took); a name it does not know is refused."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = load_target(save_tiny_target("qwen3", tiny_root / "qwen3-default-kernel")).model
    assert SlotGenerator(model, [], num_slots=2).decode_attention == "sdpa"
    with pytest.raises(ValueError, match="give 'sdpa' or 'triton'"):
        SlotGenerator(model, [], num_slots=2, decode_attention="flash")
