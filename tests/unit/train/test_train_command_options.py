"""`dflashkit init-drafter` and `dflashkit export`: each command's parser is built from its options dataclass
(dflashkit/options.py), and a parse gives the object its library function takes."""

import pytest

from dflashkit.options import flag_fields, flag_name, parse_options
from dflashkit.train import export, init_drafter
from dflashkit.train.export import ExportOptions
from dflashkit.train.init_drafter import InitDrafterOptions


def parser_flags(parser) -> list[str]:
    """Every flag and positional of a parser but --help, in the order they were added."""
    return [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions if a.dest != "help"]


@pytest.mark.parametrize("module, options", [(init_drafter, InitDrafterOptions), (export, ExportOptions)])
def test_the_help_lists_exactly_the_options_class_flags(module, options):
    parser = module.build_parser()
    assert parser_flags(parser) == [flag_name(f) for f in flag_fields(options)]
    text = " ".join(parser.format_help().split())  # the help text without its line breaks
    for f in flag_fields(options):
        assert flag_name(f) in text
        if f.metadata["dflashkit.option"]["help"]:
            assert " ".join(f.metadata["dflashkit.option"]["help"].split()) in text, f.name


def test_init_drafter_parse_gives_the_options_and_their_train_config():
    argv = ["--target", "t", "seed=3", "--out", "o", "lr=0.5", "--num-layers", "3", "--target-layer-ids", "1", "2",
            "--layer-types", "sliding", "--sliding-window", "8", "--dtype", "float32"]
    options = init_drafter.options_from(InitDrafterOptions, init_drafter.parse_args(argv))
    assert options == InitDrafterOptions(target="t", out="o", num_layers=3, target_layer_ids=[1, 2],
                                         layer_types="sliding", sliding_window=8, dtype="float32",
                                         overrides=["seed=3", "lr=0.5"])
    cfg = options.train_config()
    assert (cfg.target, cfg.num_hidden_layers, cfg.target_layer_ids, cfg.sliding_window, cfg.seed, cfg.lr) == (
        "t", 3, [1, 2], 8, 3, 0.5)
    assert cfg.layer_types == ["sliding_attention"] * 3
    # a flag wins over the same field given as key=value; a flag not given leaves the recipe's value
    assert InitDrafterOptions(target="t", out="o", seed=7, overrides=["seed=3"]).train_config().seed == 7
    with pytest.raises(SystemExit):
        init_drafter.parse_args(["--out", "o"])  # --target is required


def test_export_parse_gives_the_options_the_export_takes():
    parser = export.build_parser()
    assert parse_options(ExportOptions, ["ckpt", "out", "--for", "vllm", "--dtype", "float32"], parser) == \
        ExportOptions(checkpoint="ckpt", out_dir="out", dtype="float32", engine="vllm", overwrite=False)
    assert parse_options(ExportOptions, ["ckpt", "out"], parser) == ExportOptions("ckpt", "out")
    with pytest.raises(SystemExit):
        parse_options(ExportOptions, ["ckpt", "out", "--for", "sglang"], parser)
