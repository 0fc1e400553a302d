"""Tree attention: the PyTorch twin against a per-node loop, the Triton kernel against the twin (interpreter),
and the attention function plugged into a real transformers target against plain per-path forwards."""

import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflashkit.eval.tree import build_tree
from dflashkit.eval.tree_attention import tree_attention_reference
from dflashkit.eval.verifier import TargetVerifier

from support.attention_cases import tree_case
from support.triton_interpreter import INTERPRETER_PREAMBLE, run_in_interpreter

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run faster on one thread


def _per_node_loop(q, k, v, prefix, parents, positions, scale, window, softcap):
    """Independent oracle: for each node, gather its keys explicitly and run a softmax."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    out = torch.zeros(b, n, h, d)
    for bi in range(b):
        p = int(prefix[bi])
        for i in range(n):
            chain, node = [], i
            while node >= 0:
                chain.append(node)
                node = int(parents[node])
            slots = list(range(p)) + [p + j for j in sorted(chain)]
            key_pos = list(range(p)) + [int(positions[bi, j]) for j in sorted(chain)]
            if window:
                keep = [s for s, kp in zip(slots, key_pos) if int(positions[bi, i]) - kp < window]
                slots = keep
            for head in range(h):
                kk, vv = k[bi, head // group, slots], v[bi, head // group, slots]
                scores = kk @ q[bi, head, i] * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                out[bi, i, head] = torch.softmax(scores, 0) @ vv
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 5.0), (45, 3.0)])
def test_twin_matches_per_node_loop(window, softcap):
    q, k, v, prefix, mask, positions, parents = tree_case()
    ours = tree_attention_reference(q, k, v, prefix, mask, positions, 0.3, window, softcap)
    oracle = _per_node_loop(q, k, v, prefix, parents, positions, 0.3, window, softcap)
    assert (ours - oracle).abs().max() < 1e-5


KERNEL_SCRIPT = INTERPRETER_PREAMBLE + textwrap.dedent("""
    from support.attention_cases import tree_case
    from dflashkit.eval.tree_attention import tree_attention_reference
    from dflashkit.eval.tree_attention_triton import tree_attention_triton
    errors = []
    cases = [(None, None, None), (None, None, 1), (None, None, 3), (20, None, None), (None, 5.0, 2), (45, 3.0, None)]
    for window, softcap, splits in cases:
        q, k, v, prefix, mask, positions, _ = tree_case(seed=len(errors))
        ref = tree_attention_reference(q, k, v, prefix, mask, positions, 0.3, window, softcap)
        out = tree_attention_triton(q, k, v, prefix, mask, positions, 0.3, window, softcap,
                                    block_m=16, block_n=16, num_splits=splits)
        errors.append((out - ref).abs().max().item())
    q, k, v, prefix, mask, positions, _ = tree_case(seed=9, prefixes=(0, 5))  # no prefix at all, and a short one
    ref = tree_attention_reference(q, k, v, prefix, mask, positions, 0.3)
    errors.append((tree_attention_triton(q, k, v, prefix, mask, positions, 0.3, block_m=16, block_n=16)
                   - ref).abs().max().item())
    # the CUDA-graph layout: the key range bounded by the whole buffer, not by the prefixes (empty splits)
    q, k, v, prefix, mask, positions, _ = tree_case(seed=11)
    ref = tree_attention_reference(q, k, v, prefix, mask, positions, 0.3)
    bound = k.shape[2] - q.shape[2]
    assert bound > int(prefix.max())
    errors.append((tree_attention_triton(q, k, v, prefix, mask, positions, 0.3, max_prefix_len=bound, block_m=16,
                                         block_n=16, num_splits=4) - ref).abs().max().item())
    print(json.dumps(errors))
""")


@pytest.mark.slow
def test_triton_kernel_matches_twin_in_interpreter():
    errors = run_in_interpreter(KERNEL_SCRIPT)
    assert len(errors) == 8 and max(errors) < 1e-5, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernel_matches_twin_on_cuda():
    pytest.importorskip("triton", reason="triton is not installed")
    from dflashkit.eval.tree_attention_triton import tree_attention_triton

    for dtype, tolerance in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):  # fp32 dots run in tf32
        for window, softcap in ((None, None), (20, None), (None, 5.0)):
            q, k, v, prefix, mask, positions, _ = (t.cuda() for t in tree_case(d=64, prefixes=(300, 41), slots=320))
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            ref = tree_attention_reference(q.float(), k.float(), v.float(), prefix, mask, positions, 0.3, window,
                                           softcap)
            out = tree_attention_triton(q, k, v, prefix, mask, positions, 0.3, window, softcap)
            assert (out.float() - ref).abs().max() < tolerance


def _verifier_after_prefix(budget: int, layer_ids: list[int]):
    """A tiny Llama, a 9-token prompt, a drafted tree of `budget` nodes after it and a torch-backend verifier that
    has the prompt (but its last token) in its cache: (model, prompt, tree, verifier)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 50, (9,))
    tree = build_tree(int(prompt[-1]), torch.randn(4, 50), budget=budget, top_k=3)
    verifier = TargetVerifier(model, layer_ids, backend="torch")
    verifier.reserve(64)
    verifier.forward(prompt[:-1])
    verifier.commit(list(range(8)))
    return model, prompt, tree, verifier


def test_tree_forward_matches_plain_forward_of_each_path():
    """Logits of every node = the plain model's logits after prefix + the path to that node."""
    model, prompt, tree, verifier = _verifier_after_prefix(12, [0, 1])
    tokens, parents, depths = tree.tensors("cpu")
    logits, features = verifier.forward(tokens, parents, depths)
    verifier.close()
    with torch.no_grad():
        for node in range(tree.num_nodes):
            path, x = [], node
            while x >= 0:
                path.append(tree.tokens[x])
                x = tree.parents[x]
            ids = torch.cat([prompt[:-1], torch.tensor(path[::-1])]).unsqueeze(0)
            out = model(ids, output_hidden_states=True)
            assert (out.logits[0, -1] - logits[node]).abs().max() < 1e-5
            expected = torch.cat([out.hidden_states[1][0, -1], out.hidden_states[2][0, -1]])
            assert (expected - features[node]).abs().max() < 1e-5


def test_static_steps_padded_trees_and_chains_equal_a_fresh_prefill():
    """Decode steps run on static buffers (the CUDA-graph layout): a tree padded to a larger budget gives the
    same logits and features for its real nodes, and a chain block equals the same tokens in one prefill."""
    model, prompt, tree, verifier = _verifier_after_prefix(7, [0, 2])
    tokens, parents, depths = tree.tensors("cpu")
    exact = [t.clone() for t in verifier.forward(tokens, parents, depths)]
    padded = verifier.forward(tokens, parents, depths, pad_to=16)
    assert padded[0].shape[0] == tree.num_nodes and set(verifier.steps) == {(7, False), (16, False)}
    for a, b in zip(exact, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    chain_logits, chain_features = verifier.forward(prompt[-1:].clone().repeat(3))  # a chain of 3 after the prefix
    verifier.close()
    fresh = TargetVerifier(model, [0, 2], backend="torch")
    fresh.reserve(64)
    logits, features = fresh.forward(torch.cat([prompt[:-1], prompt[-1:].repeat(3)]))
    fresh.close()
    torch.testing.assert_close(chain_logits, logits[-3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chain_features, features[-3:], atol=1e-5, rtol=1e-5)
