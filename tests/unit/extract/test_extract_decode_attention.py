"""Slot decode attention: the PyTorch twin against the generator's masked grouped attention, the Triton kernel
against both (interpreter on the CPU, and on a GPU where there is one)."""

import textwrap

import pytest
import torch

from dflashkit.extract.generation.decode_attention import decode_attention_reference

from support.attention_cases import decode_case, masked_grouped
from support.triton_interpreter import INTERPRETER_PREAMBLE, run_in_interpreter


@pytest.mark.parametrize("group,window", [(1, None), (3, None), (3, 9), (1, 40)])
def test_twin_matches_masked_grouped_attention(group, window):
    q, k, v, positions = decode_case(group=group)
    ours = decode_attention_reference(q, k, v, positions, 0.3, window)
    assert ours.shape == (5, 1, 2 * group, 24)
    assert (ours - masked_grouped(q, k, v, positions, 0.3, window)).abs().max() < 1e-5


def test_twin_with_a_window_of_one_is_the_own_value():
    q, k, v, positions = decode_case(group=3)
    out = decode_attention_reference(q, k, v, positions, 0.3, window=1)
    own = v[torch.arange(5), :, positions].repeat_interleave(3, dim=1)  # [slots, Hq, d]
    assert (out[:, 0] - own).abs().max() < 1e-6


KERNEL_SCRIPT = INTERPRETER_PREAMBLE + textwrap.dedent("""
    from support.attention_cases import decode_case, masked_grouped
    from dflashkit.extract.generation.decode_attention import decode_attention, decode_attention_reference
    from dflashkit.extract.generation.decode_attention_triton import decode_attention_triton
    errors = []
    cases = [(1, None, None, 0), (3, None, None, 1), (3, None, 3, 2), (1, 9, 2, 3), (3, 20, None, 4),
             (3, 1, 3, 5), (2, None, 4, 6)]
    for dtype in (torch.float32, torch.float16):  # the interpreter's tl.dot gets bf16 wrong (the CUDA test has it)
        for group, window, splits, seed in cases:
            q, k, v, positions = decode_case(seed=seed, group=group, dtype=dtype)
            twin = decode_attention_reference(q, k, v, positions, 0.3, window).float()
            grouped = masked_grouped(q, k, v, positions, 0.3, window).float()
            out = decode_attention_triton(q, k, v, positions, 0.3, window, num_splits=splits, block_n=16).float()
            errors.append([str(dtype), (out - twin).abs().max().item(), (out - grouped).abs().max().item()])
    # the dispatcher picks the kernel under the interpreter; d = 64 and the default tiles
    q, k, v, positions = decode_case(seed=7, slots=3, hkv=3, group=3, d=64, columns=150)
    out = decode_attention(q, k, v, positions, 0.125, 64)
    errors.append(["dispatch", (out - decode_attention_reference(q, k, v, positions, 0.125, 64)).abs().max().item(),
                   (out - masked_grouped(q, k, v, positions, 0.125, 64)).abs().max().item()])
    print(json.dumps(errors))
""")


def test_triton_kernel_matches_twin_and_grouped_attention_in_interpreter():
    errors = run_in_interpreter(KERNEL_SCRIPT)
    assert len(errors) == 15, errors
    for kind, to_twin, to_grouped in errors:
        tolerance = 3e-3 if kind == "torch.float16" else 1e-5  # fp16: roundings of p and of the output
        assert to_twin < tolerance and to_grouped < tolerance, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernel_matches_twin_on_cuda():
    pytest.importorskip("triton", reason="triton is not installed")
    from dflashkit.extract.generation.decode_attention_triton import decode_attention_triton

    for dtype, tolerance in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        for group, window, slots in ((3, None, 1024), (3, None, 40), (1, 100, 40), (3, 7, 8)):
            q, k, v, positions = (t.cuda() for t in decode_case(slots=slots, hkv=3, group=group, d=64, columns=1400,
                                                          dtype=dtype))
            ref = decode_attention_reference(q, k, v, positions, 0.125, window).float()
            out = decode_attention_triton(q, k, v, positions, 0.125, window)
            assert (out.float() - ref).abs().max() < tolerance


GENERATOR_SCRIPT = INTERPRETER_PREAMBLE + textwrap.dedent("""
    from transformers import AutoModelForCausalLM
    from support.tiny_targets import tiny_family_config
    import dflashkit.extract.generation.generator as generator
    import dflashkit.extract.generation.slot_cache as slot_cache
    calls = []
    kernel = slot_cache.decode_attention
    def counted(*args):
        calls.append(args[5])  # the layer's window
        return kernel(*args)
    slot_cache.decode_attention = counted
    torch.set_num_threads(1)
    results = {}
    for family in sys.argv[2:]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_family_config(family)).eval()
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(4, 244, (n,), generator=g).tolist() for n in (3, 11, 7, 20, 5)]
        sdpa = generator.SlotGenerator(model, [], num_slots=3, length_step=16, decode_attention="sdpa").generate(
            prompts, 6)
        calls.clear()
        gen = generator.SlotGenerator(model, [], num_slots=3, length_step=16)  # the default: the kernel
        same = gen.generate(prompts, 6) == sdpa
        results[family] = [gen.decode_attention, same, gen.kernel_layers, len(calls), sorted({str(w) for w in calls})]
    print(json.dumps(results))
""")


def test_generator_with_the_kernel_equals_the_sdpa_path_in_interpreter():
    """Greedy tokens with the default decode_attention ("triton": the kernel, run by the interpreter) equal the
    SDPA path's:
    full attention with GQA (llama), sliding windows (gemma3_text), attention sinks left to the old path
    (gpt_oss: the kernel is never called, and the generator falls back to SDPA)."""
    results = run_in_interpreter(GENERATOR_SCRIPT, "llama", "gemma3_text", "gpt_oss")
    assert results["llama"][:3] == ["triton", True, 4] and results["llama"][3] > 0
    assert results["llama"][4] == ["None"]
    assert results["gemma3_text"][:3] == ["triton", True, 4] and results["gemma3_text"][4] == ["4", "None"]
    assert results["gpt_oss"] == ["sdpa", True, 0, 0, []]  # no layer can: the generator says so and uses SDPA
