"""CUDA only (skipped elsewhere): the compiled flex_attention path gives the dense SDPA path's numbers, and the
trainer runs compiled in bf16 on a GPU, sequences of changing length included, and resumes."""


import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")



def test_compiled_flex_equals_dense_on_cuda():
    from dflashkit.drafter import DrafterConfig, build_drafter
    from dflashkit.train.data import pack_sequences
    from dflashkit.train.drafter_pass import PassOptions, compile_layers, forward_blocks

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    V, H, B = 64, 64, 8
    cfg = DrafterConfig(hidden_size=H, num_target_layers=4, vocab_size=V, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, target_layer_ids=[0, 2],
                        block_size=B, mask_token_id=V - 1, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=5)
    dense_model = build_drafter(cfg).cuda()
    flex_model = build_drafter(cfg).cuda()
    flex_model.load_state_dict(dense_model.state_dict())
    compile_layers(flex_model)  # as the trainer compiles them
    head = torch.nn.Module()
    head.embed_tokens = torch.nn.Embedding(V, H).cuda()
    head.lm_head = torch.nn.Linear(H, V, bias=False).cuda()
    head.embed = head.embed_tokens
    for L in (200, 173):  # two lengths: the compiled graph must follow a new shape
        ids = torch.randint(0, V - 1, (L,))
        mask = torch.ones(L, dtype=torch.bool)
        anchors = torch.sort(torch.randperm(L - 1)[:24]).values
        anchors[0] = 0
        batch = pack_sequences([ids], [mask], [torch.randn(L, 2 * H)], [anchors], B, V - 1).to("cuda")
        outs = {}
        for name, model, backend in (("dense", dense_model, "dense"), ("flex", flex_model, "flex")):
            model.zero_grad()
            out = forward_blocks(model, head, batch,
                                 PassOptions(block_size=B, layer_types=cfg.layer_types, sliding_window=5,
                                             backend=backend))
            out.loss_sum.backward()
            outs[name] = (out.loss_sum.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        assert outs["flex"][0] == pytest.approx(outs["dense"][0], rel=1e-4)
        for n, g in outs["dense"][1].items():
            torch.testing.assert_close(outs["flex"][1][n], g, rtol=2e-3, atol=2e-5, msg=n)


def test_trainer_compiled_bf16_on_cuda(tmp_path, capsys):
    from dflashkit.train.checkpoint import list_checkpoints
    from dflashkit.train.recipe import load_config
    from dflashkit.train.tracking import read_metrics
    from dflashkit.train.trainer import train

    from support.shards import make_shards
    from support.tiny_targets import make_tiny_target

    target = make_tiny_target(tmp_path / "target", heads=2)  # head_dim 16: the least compiled flex_attention takes
    shards = make_shards(tmp_path / "shards", target, num_samples=20, lengths=(60, 140))
    kw = dict(shards=str(shards), output_dir=str(tmp_path / "run"), mask_token_id=95, num_hidden_layers=2,
              block_size=8, num_anchors=16, eval_samples=2, eval_anchors=8, epochs=2, grad_accum=2,
              mixed_precision="bf16", compile=True, wandb=False, save_every=3, log_every=1, num_workers=1,
              progress=False, drafter={"intermediate_size": 64}, micro_batch_tokens=0)
    summary = train(load_config(None, [], **kw))
    assert summary["step"] == 18 and "attention mask: flex (compiled drafter layers)" in capsys.readouterr().out
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert len(losses) == 18 and all(torch.isfinite(torch.tensor(losses)))
    assert [p.name for p in list_checkpoints(tmp_path / "run")][-1] == "step-00000018"
