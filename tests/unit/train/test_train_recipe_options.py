"""The recipe options of the study (issue 26): Muon (orthogonalised updates, resume), anchor density, the linear
lr schedule and the target's argmax as labels. Each keeps online = offline, packed = unpacked and resume (Muon
under DDP: tests/integration/test_train_processes.py)."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.train import muon
from dflashkit.train.anchors import anchor_candidates, anchor_count
from dflashkit.train.data import CollateOptions, collate_blocks
from dflashkit.train.drafter_pass import target_argmax_labels
from dflashkit.train.muon import RMS_MATCH, Muon, check_backend, muon_param_groups, newton_schulz, stacks
from dflashkit.train.recipe import load_config
from dflashkit.train.setup import lr_at
from dflashkit.train.tracking import read_metrics
from dflashkit.train.trainer import train

from support.shards import make_shards
from support.tiny_targets import make_tiny_target
from support.training import online_overrides as overrides
from support.training import tiny_overrides
from support.training import train_losses as losses

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def with_singular_values(m: int, n: int, values: torch.Tensor, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    k = values.numel()
    return u[:, :k] @ torch.diag(values) @ v[:, :k].T, u[:, :k], v[:, :k]


# --------------------------------------------------------------------------- Muon
@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (48, 48)])
def test_newton_schulz_keeps_the_singular_vectors_and_maps_the_values_near_one(shape):
    values = torch.logspace(-1.5, 1.0, min(shape))  # condition number ~316
    g, u, v = with_singular_values(*shape, values)
    out = newton_schulz(g)
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.6 and s.max() < 1.25, s  # from 0.03..10 into the quintic's band around 1
    core = u.T @ out @ v  # U^T NS(G) V is diagonal: the same singular vectors, only the values change
    assert (core - torch.diag(torch.diag(core))).abs().max() < 1e-4
    assert torch.allclose(newton_schulz(5.0 * g), out, atol=1e-5)  # invariant to the gradient's scale
    with pytest.raises(ValueError, match="matrices"):
        newton_schulz(g.reshape(-1))


def tiny_drafter():
    from dflashkit.drafter import DrafterConfig, build_drafter

    cfg = DrafterConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_layer_ids=[0, 2],
                        num_target_layers=4, block_size=4, mask_token_id=39)
    return build_drafter(cfg)


def test_muon_step_orthogonalises_the_matrices_and_adamw_moves_the_rest():
    model = tiny_drafter()
    groups = muon_param_groups(model, lr=1e-2, muon_lr=2e-2, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for g in groups if g["use_muon"] for p in g["params"]}
    assert "fc.weight" in muon_names and "layers.0.self_attn.q_proj.weight" in muon_names
    assert "layers.1.mlp.down_proj.weight" in muon_names
    assert not any("norm" in n for n in muon_names)  # norms, 1-D, stay on AdamW and are never decayed
    table = torch.nn.Module()  # a table indexed by token (an embedding, DFlash2's codebooks) is not a linear map
    table.codebook, table.proj = torch.nn.Parameter(torch.randn(40, 8)), torch.nn.Linear(8, 8, bias=False)
    by_kind = {g["use_muon"]: g["params"] for g in muon_param_groups(table, lr=1e-3, muon_lr=0.0, weight_decay=0.0)}
    assert by_kind[True] == [table.proj.weight] and by_kind[False] == [table.codebook]
    assert all(g["weight_decay"] == 0.0 for g in groups if not g["use_muon"] and g["params"][0].ndim == 1)
    opt = Muon(groups, momentum=0.95)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        delta = p.detach() - before[n]
        if n in muon_names:  # first step: buffer = g, Nesterov direction (1 + mu) g; NS ignores the scale
            decayed = before[n] * (1 - 2e-2 * 0.1)
            update = (decayed - p.detach()) / (2e-2 * RMS_MATCH * max(p.shape) ** 0.5)
            torch.testing.assert_close(update, newton_schulz(grads[n]), rtol=1e-4, atol=1e-5)
            s, s_grad = torch.linalg.svdvals(update), torch.linalg.svdvals(grads[n])
            # every direction above 3% of the largest is lifted near 1 (a square random matrix has a few below)
            assert s.max() < 1.25 and (s > 0.6).sum() >= (s_grad > 0.03 * s_grad.max()).sum(), n
            # the RMS of the update is that of AdamW's first step (lr * sign): 0.2 * sqrt(max(m, n)) * rms(U V^T)
            assert 0.1 < (p.detach() - decayed).pow(2).mean().sqrt().item() / 2e-2 < 0.3, n
        else:  # AdamW's first step: -lr * g / |g| (bias-corrected), no decay on norms
            torch.testing.assert_close(delta, -1e-2 * grads[n].sign(), rtol=1e-4, atol=1e-6)
    state = opt.state_dict()  # a round trip restores the buffers exactly
    again = Muon(muon_param_groups(model, lr=1e-2, muon_lr=2e-2, weight_decay=0.1), momentum=0.95)
    again.load_state_dict(state)
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(again.state[p][key], value)


def test_newton_schulz_of_a_stack_is_each_matrix_on_its_own():
    g = torch.randn(4, 24, 40, generator=torch.Generator().manual_seed(1))
    g[2] *= 50.0  # each matrix is normalised by its own norm, not the stack's
    for x in (g, g.mT):  # wide and tall
        out = newton_schulz(x)
        for i in range(len(x)):
            torch.testing.assert_close(out[i], newton_schulz(x[i]), rtol=1e-5, atol=1e-6)


def test_stacks_group_matrices_of_one_shape_in_order_within_the_byte_cap():
    ts = [torch.zeros(4, 8), torch.zeros(8, 4), torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float64),
          torch.zeros(4, 8), torch.zeros(8, 4)]
    assert stacks(ts) == [[0, 2, 4], [1, 5], [3]]
    assert stacks(ts, max_bytes=2 * 4 * 8 * 4) == [[0, 2], [4], [1, 5], [3]]  # two 4x8 fp32 matrices at most
    assert stacks(ts, max_bytes=0) == [[0], [2], [4], [1], [5], [3]]  # a matrix over the cap goes alone


def test_muon_batched_step_equals_one_matrix_at_a_time(monkeypatch):
    """The stacked Newton-Schulz and the foreach updates give the per-matrix step (over steps: momentum, decay),
    on a drafter whose matrices come in several shapes, some shared."""
    import copy

    model = tiny_drafter()
    alone = copy.deepcopy(model)
    groups = muon_param_groups(model, lr=1e-2, muon_lr=2e-2, weight_decay=0.1)
    shapes = [tuple(p.shape) for g in groups if g["use_muon"] for p in g["params"]]
    assert len(set(shapes)) < len(shapes)  # something is stacked
    batched = Muon(groups, momentum=0.95)
    one = Muon(muon_param_groups(alone, lr=1e-2, muon_lr=2e-2, weight_decay=0.1), momentum=0.95)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(model.parameters(), alone.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        batched.step()
        with monkeypatch.context() as m:
            m.setattr(muon, "STACK_BYTES", 0)  # every matrix its own stack: the per-matrix loop
            one.step()
    for (n, p), q in zip(model.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=n)
        assert not torch.equal(p.detach(), before[n]), n  # every parameter moved


def test_muon_adamw_part_is_torch_adamw():
    """The parameters Muon leaves to AdamW (norms, tables) step as torch.optim.AdamW with the same groups:
    decoupled decay (here on half of them), bias corrections, over several steps."""
    import copy

    model = tiny_drafter()
    ref = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    plain = [p for g in muon_param_groups(model, lr=1e-2, muon_lr=2e-2, weight_decay=0.1) if not g["use_muon"]
             for p in g["params"]]
    half = len(plain) // 2
    assert half >= 2
    split = [(plain[:half], 0.1), (plain[half:], 0.0)]
    ours = Muon([{"params": ps, "use_muon": False, "lr": 1e-2, "weight_decay": wd} for ps, wd in split],
                betas=(0.9, 0.95), eps=1e-8)
    by_name = dict(ref.named_parameters())
    oracle = torch.optim.AdamW([{"params": [by_name[names[id(p)]] for p in ps], "lr": 1e-2, "weight_decay": wd}
                                for ps, wd in split], betas=(0.9, 0.95), eps=1e-8, foreach=False)
    start = {names[id(p)]: p.detach().clone() for p in plain}
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        for p in plain:
            p.grad = torch.randn(p.shape, generator=gen)
            by_name[names[id(p)]].grad = p.grad.clone()
        ours.step()
        oracle.step()
    for p in plain:
        n = names[id(p)]
        assert not torch.equal(p.detach(), start[n]), n  # it moved
        torch.testing.assert_close(p.detach(), by_name[n].detach(), rtol=1e-6, atol=1e-7, msg=n)


def test_newton_schulz_in_bf16_keeps_the_fp32_result_within_bf16_rounding():
    """muon_ns_dtype=bfloat16: the same singular vectors and the values in the same band, each within bf16
    rounding of the fp32 result (condition number ~316, as the fp32 test)."""
    values = torch.logspace(-1.5, 1.0, 48)
    g, u, v = with_singular_values(48, 96, values)
    stack = torch.stack([g, 3.0 * g])
    full, half = newton_schulz(stack), newton_schulz(stack, dtype=torch.bfloat16)
    assert half.dtype == torch.float32 and not torch.equal(half, full)  # computed apart, handed back in fp32
    for out in half:
        core = u.T @ out @ v  # U^T NS(G) V: diagonal, the mapped singular values
        values_out = torch.diag(core)
        assert values_out.min() > 0.6 and values_out.max() < 1.25, values_out
        torch.testing.assert_close(values_out, torch.diag(u.T @ full[0] @ v), rtol=0, atol=0.03)
        assert (core - torch.diag(values_out)).abs().max() < 0.05  # bf16 rounding off the diagonal


def test_muon_ns_dtype_reaches_the_step_and_a_bad_one_is_refused(tmp_path):
    model = tiny_drafter()
    opt = Muon(muon_param_groups(model, lr=1e-2, muon_lr=1e-2, weight_decay=0.0), ns_dtype="bfloat16")
    assert opt.ns_dtype == torch.bfloat16
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()  # the first step's update is NS(g) (NS ignores the gradient's scale): here the bf16 one
    q = "layers.0.mlp.down_proj.weight"
    p = dict(model.named_parameters())[q]
    update = (before[q] - p.detach()) / (1e-2 * RMS_MATCH * max(p.shape) ** 0.5)
    near_bf16 = (update - newton_schulz(grads[q], dtype=torch.bfloat16)).norm()
    assert near_bf16 < 0.5 * (update - newton_schulz(grads[q])).norm()  # closer to bf16's than to fp32's
    state = opt.state_dict()  # the choice is the run's config, not part of the saved state
    again = Muon(muon_param_groups(model, lr=1e-2, muon_lr=1e-2, weight_decay=0.0))
    again.load_state_dict(state)
    assert again.ns_dtype == torch.float32
    with pytest.raises(ValueError, match="muon_ns_dtype: 'fp16'"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "use_muon": True}], ns_dtype="fp16")
    with pytest.raises(ValueError, match="muon_ns_dtype: 'half'; use 'float32', 'bfloat16' or 'auto'"):
        load_config(None, ["muon_ns_dtype=half"], output_dir=str(tmp_path))
    from dflashkit.train.setup_drafter import build_optimizer

    cfg = load_config(None, ["optimizer=muon", "muon_ns_dtype=bfloat16"], output_dir=str(tmp_path))
    assert build_optimizer(cfg, model, "NO").ns_dtype == torch.bfloat16


def test_muon_refuses_sharded_backends_and_a_flattened_matrix():
    for backend in ("FSDP", "DEEPSPEED"):  # the trainer's check, before any step (accelerate's backend names)
        with pytest.raises(ValueError, match=f"needs whole weight matrices on every rank, and {backend} shards"):
            check_backend(backend)
    for backend in ("NO", "MULTI_CPU", "MULTI_GPU"):  # one process and DDP hold whole matrices
        check_backend(backend)
    p = torch.nn.Parameter(torch.randn(12))
    opt = Muon([{"params": [p], "use_muon": True}])
    p.grad = torch.randn(12)
    with pytest.raises(ValueError, match="FSDP, DeepSpeed ZeRO"):
        opt.step()


@pytest.mark.slow
def test_muon_resume_equals_the_straight_run_and_linear_lr_is_logged(tiny_run, tmp_path):
    """10 steps straight = 4 steps, checkpoint, resume, 6 steps: identical weights (Muon buffers and AdamW moments
    restored); every logged lr is the linear schedule's."""
    _, shards = tiny_run
    kw = dict(optimizer="muon", muon_lr=3e-3, lr_schedule="linear", warmup_ratio=0.2, keep_last=10)
    straight = train(load_config(None, [], **tiny_overrides(shards, tmp_path / "straight", **kw)))
    assert straight["step"] == 10
    ckpt = tmp_path / "straight" / "checkpoints" / "step-00000004"
    opt_state = load_file(str(ckpt / "optimizer.safetensors"))
    assert "state.fc.weight.momentum_buffer" in opt_state and "state.norm.weight.exp_avg" in opt_state
    again = tmp_path / "resumed"
    shutil.copytree(ckpt, again / "checkpoints" / ckpt.name)
    resumed = train(load_config(None, [], **tiny_overrides(shards, again, **kw)))
    assert resumed["step"] == 10 and sorted(losses(again)) == list(range(5, 11))
    a = load_file(str(Path(straight["checkpoint"]) / "model.safetensors"))
    b = load_file(str(Path(resumed["checkpoint"]) / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    adamw = train(load_config(None, [], **tiny_overrides(shards, tmp_path / "adamw", keep_last=10)))
    c = load_file(str(Path(adamw["checkpoint"]) / "model.safetensors"))
    assert not torch.allclose(a["fc.weight"], c["fc.weight"])  # the option reaches the optimizer
    logged = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "straight") if "lr" in r}
    for step, lr in logged.items():  # the lr logged at step s is the one step s - 1 (0-based) trained with
        assert lr == pytest.approx(6e-4 * lr_at(step - 1, 10, 2, 0.0, "linear")), step


# --------------------------------------------------------------------------- lr schedule
def test_linear_schedule_warms_up_then_falls_on_a_line_to_the_floor():
    total, warmup, floor = 110, 10, 0.1
    assert [lr_at(s, total, warmup, floor, "linear") for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(10, total, warmup, floor, "linear") == pytest.approx(1.0)
    assert lr_at(60, total, warmup, floor, "linear") == pytest.approx(floor + (1 - floor) * 0.5)
    assert lr_at(85, total, warmup, floor, "linear") == pytest.approx(floor + (1 - floor) * 0.25)
    assert lr_at(110, total, warmup, floor, "linear") == pytest.approx(floor)
    assert lr_at(60, total, warmup, floor) == pytest.approx(floor + (1 - floor) * 0.5)  # cosine midpoint
    assert lr_at(35, total, warmup, floor) > lr_at(35, total, warmup, floor, "linear")  # cosine stays higher early
    with pytest.raises(ValueError, match="lr_schedule"):
        load_config(None, ["lr_schedule=step"])


# --------------------------------------------------------------------------- anchor density
def random_samples(lengths, prompt, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, p) in enumerate(zip(lengths, prompt)):
        mask = torch.ones(n, dtype=torch.bool)
        mask[:p] = False
        out.append({"input_ids": torch.randint(0, 30, (n,), generator=g), "loss_mask": mask,
                    "hidden": torch.randn(n, 8, generator=g), "index": i})
    return out


def test_anchor_density_draws_a_share_of_each_sequence_whatever_it_is_packed_with():
    samples = random_samples([80, 40, 200, 9], [10, 30, 20, 2])
    opts = CollateOptions(block_size=4, mask_token_id=31, num_anchors=512, seed=1, epoch=0, anchor_density=0.375)
    packed = collate_blocks(samples, opts)
    cands = [anchor_candidates(s["loss_mask"]).numel() for s in samples]  # 69, 9, 179, 6
    want = [min(c, round(0.375 * len(s["input_ids"]))) for s, c in zip(samples, cands)]
    assert want == [30, 9, 75, 3]  # the 40-token one has fewer candidates (9) than its share (15)
    assert [packed.block_offsets[i + 1] - packed.block_offsets[i] for i in range(4)] == want
    for i, s in enumerate(samples):  # alone: the same anchors (packed = unpacked)
        alone = collate_blocks([s], opts, pad_multiple=1)
        lo, hi = packed.block_offsets[i], packed.block_offsets[i + 1]
        assert torch.equal(packed.anchors[lo:hi] - packed.context_offsets[i], alone.anchors)
    off = collate_blocks(samples, replace(opts, anchor_density=0.0))  # off: num_anchors (512) -> every candidate
    assert off.block_offsets[-1] == sum(cands)
    assert anchor_count(8192, 512, 0.375) == 3072 and anchor_count(1, 512, 0.375) == 1
    assert anchor_count(100, 512, 0.0) == 512
    with pytest.raises(ValueError, match="anchor_density"):
        load_config(None, ["anchor_density=3"])


# --------------------------------------------------------------------------- labels from the target
def test_target_argmax_labels_are_the_targets_greedy_tokens(tmp_path):
    import transformers as tf

    from dflashkit.targets.loading import load_target_head

    target_dir = make_tiny_target(tmp_path / "target")
    model = tf.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.randint(0, 95, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # 12 random tokens, then 12 of the target's own greedy continuation, then 12 random
        greedy = model.generate(ids[None], max_new_tokens=12, do_sample=False)[0]
        ids = torch.cat([greedy, torch.randint(0, 95, (12,), generator=torch.Generator().manual_seed(1))])
        out = model(ids[None], output_hidden_states=True)
    mask = torch.ones(ids.numel(), dtype=torch.bool)
    mask[:3] = False
    sample = {"input_ids": ids, "loss_mask": mask, "hidden": torch.zeros(ids.numel(), 8), "index": 0,
              "last_hidden": out.hidden_states[-1][0]}  # after the final norm, as shards and online store it
    batch = collate_blocks([sample],
                           CollateOptions(block_size=4, mask_token_id=95, num_anchors=64, seed=0, use_last_hidden=True))
    head = load_target_head(target_dir)
    labels = target_argmax_labels(head, batch, chunk_tokens=5)
    choice = out.logits[0].argmax(-1)  # the target's own next-token choice at each position
    valid = batch.valid
    assert torch.equal(labels[valid], choice[batch.teacher_index][valid])
    assert not labels[~valid].any()
    agree = choice[batch.teacher_index] == batch.labels
    assert (valid & agree).sum() >= 10 and (valid & ~agree).sum() >= 10  # both cases occur
    assert torch.equal(labels[valid & agree], batch.labels[valid & agree])
    assert (labels[valid & ~agree] != batch.labels[valid & ~agree]).all()


def test_target_argmax_needs_last_hidden_in_the_shards(tmp_path):
    target = make_tiny_target(tmp_path / "target")
    shards = make_shards(tmp_path / "shards", target, num_samples=6, last_hidden=False)
    with pytest.raises(ValueError, match="labels=target_argmax needs last_hidden in the shards"):
        train(load_config(None, [], **tiny_overrides(shards, tmp_path / "run", labels="target_argmax")))
    with pytest.raises(ValueError, match="labels"):
        load_config(None, ["labels=soft"])


# --------------------------------------------------------------------------- online = offline, packed = unpacked
@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_online_equals_offline_with_density_and_target_labels(chat_run, tmp_path, packed):
    target_dir, data, shards = chat_run
    kw = dict(anchor_density=0.1, labels="target_argmax", optimizer="muon",
              **(dict(micro_batch_tokens=320) if packed else {}))
    offline = train(load_config(None, [], **overrides(tmp_path / "offline", shards=str(shards), **kw)))
    online = train(load_config(None, [], **overrides(tmp_path / "online", target=target_dir, data=[data],
                                                     target_batch_tokens=1, **kw)))
    a, b = losses(tmp_path / "offline"), losses(tmp_path / "online")
    assert sorted(a) == sorted(b) and len(a) >= 2
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    if not packed:  # the labels option reaches the loss: the random tiny target disagrees with the data
        train(load_config(None, [], **overrides(tmp_path / "data", shards=str(shards), **{**kw, "labels": "data"})))
        c = losses(tmp_path / "data")
        assert sorted(c) == sorted(a) and any(abs(a[s] - c[s]) > 1e-4 for s in a)
    wa = load_file(str(Path(offline["checkpoint"]) / "model.safetensors"))
    wb = load_file(str(Path(online["checkpoint"]) / "model.safetensors"))
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6), k


# --------------------------------------------------------------------------- causal inside the block
def test_causal_option_trains_a_drafter_whose_export_every_engine_reads_as_causal(tiny_run, tmp_path):
    """causal=true: the trained drafter is causal inside the block (its held-out walk computed with that mask),
    its export declares it both ways (is_causal for SGLang and the reference, dflash_config.causal for vLLM) and
    reads back as causal; the same run without it trains other weights."""
    import json

    from dflashkit.drafter import load_drafter

    _, shards = tiny_run
    causal = train(load_config(None, [], **tiny_overrides(shards, tmp_path / "causal", causal=True, max_steps=4)))
    plain = train(load_config(None, [], **tiny_overrides(shards, tmp_path / "plain", max_steps=4)))
    exported = json.loads((tmp_path / "causal" / "export" / "config.json").read_text())
    assert exported["is_causal"] is True and exported["dflash_config"]["causal"] is True
    assert load_drafter(tmp_path / "causal" / "export").dflash.causal is True
    default = json.loads((tmp_path / "plain" / "export" / "config.json").read_text())
    assert "is_causal" not in default and "causal" not in default["dflash_config"]
    a = load_file(str(Path(causal["checkpoint"]) / "model.safetensors"))
    b = load_file(str(Path(plain["checkpoint"]) / "model.safetensors"))
    assert not torch.equal(a["fc.weight"], b["fc.weight"])  # same seed and data: the mask made the difference


def muon_step_update(model, ns_dtype: str, grads: dict, name: str) -> torch.Tensor:
    """One first step of Muon with ``ns_dtype`` from fresh weights: the update of ``name`` (its NS(g))."""
    opt = Muon(muon_param_groups(model, lr=1e-2, muon_lr=1e-2, weight_decay=0.0), ns_dtype=ns_dtype)
    p = dict(model.named_parameters())[name]
    before = p.detach().clone()
    for n, q in model.named_parameters():
        q.grad = grads[n].clone()
    opt.step()
    return before - p.detach()


def test_auto_newton_schulz_is_fp32_on_a_cpu_and_bf16_on_a_gpu():
    """muon_ns_dtype=auto (the testbed recipe's): the fp32 step, bit for bit, on a CPU; bf16 on a GPU. The
    recipe on a CPU (make demo) keeps the fast fp32 matmuls."""
    torch.manual_seed(0)
    model = tiny_drafter()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    q = "layers.0.mlp.down_proj.weight"
    updates = {}
    for form in ("auto", "float32", "bfloat16"):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        updates[form] = muon_step_update(model, form, grads, q)
    assert torch.equal(updates["auto"], updates["float32"])
    assert not torch.equal(updates["auto"], updates["bfloat16"])
    opt = Muon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "use_muon": True}], ns_dtype="auto")
    assert opt.ns_dtype is None and opt.ns_dtype_on(torch.device("cpu")) == torch.float32
    assert opt.ns_dtype_on(torch.device("cuda", 0)) == torch.bfloat16  # a device object; no GPU needed
    assert Muon(opt.param_groups, ns_dtype="float32").ns_dtype_on(torch.device("cuda")) == torch.float32
    recipe = load_config(str(RECIPES / "smollm2-135m.yaml"))
    assert recipe.optimizer == "muon" and recipe.muon_ns_dtype == "auto"
