"""Single drafter passes over packed blocks, for the training tests that compare a packed pass with its parts: a
tiny drafter (float64), a stand-in for the target's head, random samples, one pass that also returns the final
hidden states per block, and the tile truth of a dense block mask."""

import torch

from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.train.block_mask import TILE
from dflashkit.train.drafter_pass import PassOptions, forward_blocks
from dflashkit.train.loss import LossSettings


class Head(torch.nn.Module):
    """A stand-in for the target head: embedding (with a scale), lm_head."""

    def __init__(self, vocab, hidden, scale=1.0):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.embedding_scale = scale

    def embed(self, ids):
        return self.embed_tokens(ids) * self.embedding_scale


def tiny_drafter(V, H, B, layer_types=None, window=None, **fields):
    """A 2-layer drafter in float64 over 2 taps of a 4-layer target (``fields``: other DrafterConfig fields, e.g.
    a DFlash2 architecture); layer_types None: full attention."""
    cfg = DrafterConfig(hidden_size=H, num_target_layers=4, vocab_size=V, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_layer_ids=[0, 2],
                        block_size=B, mask_token_id=V - 1, layer_types=list(layer_types or []),
                        sliding_window=window, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        **fields)
    return build_drafter(cfg).double()


def make_samples(lens, V, H, seed):
    """Random samples of the given lengths (float64 features of 2 taps, last_hidden, a short unsupervised start)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for idx, n in enumerate(lens):
        mask = torch.ones(n, dtype=torch.bool)
        mask[: 2 + idx] = False
        out.append({"input_ids": torch.randint(0, V - 1, (n,), generator=g), "loss_mask": mask,
                    "hidden": torch.randn(n, 2 * H, generator=g, dtype=torch.float64),
                    "last_hidden": torch.randn(n, H, generator=g, dtype=torch.float64), "index": 10 + idx})
    return out


def drafter_pass(model, head, batch, B, layer_types, window, variant):
    """``forward_blocks`` of one batch and the drafter's final hidden states [blocks, B, H]."""
    seen = {}
    hook = model.norm.register_forward_hook(lambda m, i, o: seen.update(h=o))
    out = forward_blocks(model, head, batch,
                         PassOptions(block_size=B, layer_types=layer_types, sliding_window=window,
                                     loss=LossSettings(variant=variant, chunk_tokens=7)))
    hook.remove()
    return out, seen["h"][0].view(-1, B, seen["h"].shape[-1])


def tile_truth(dense):
    """(any visible pair, all visible) per TILE x TILE tile of a dense [queries, keys] mask."""
    q, kv = dense.shape
    nq, nk = -(-q // TILE), -(-kv // TILE)
    grid = torch.zeros(nq * TILE, nk * TILE, dtype=torch.bool)
    inside = torch.zeros_like(grid)
    grid[:q, :kv], inside[:q, :kv] = dense, True
    grid, inside = grid.view(nq, TILE, nk, TILE), inside.view(nq, TILE, nk, TILE)
    return grid.any(3).any(1), (grid | ~inside).all(3).all(1) & inside.all(3).all(1)
