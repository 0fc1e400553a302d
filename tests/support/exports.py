"""An exported drafter as a machine without dflashkit runs it, and the relative error the reference-compatibility
tests compare tensors by."""

import subprocess
import sys
import textwrap
from pathlib import Path

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def forward_without_dflashkit(export_dir: Path, inputs: dict, work: Path, class_name: str) -> torch.Tensor:
    """The exported drafter's forward on ``inputs`` in a child interpreter where importing dflashkit or dflash
    fails, as on a machine without them: loaded with transformers' AutoModel and the modeling file the export
    ships (``trust_remote_code``); ``class_name`` is the class it must be."""
    from safetensors.torch import load_file, save_file

    save_file({k: v.contiguous() for k, v in inputs.items()}, str(work / "x.safetensors"))
    code = textwrap.dedent(f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('dflashkit', 'dflash'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import torch
        from safetensors.torch import load_file, save_file
        from transformers import AutoModel
        m = AutoModel.from_pretrained({str(export_dir)!r}, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(m).__name__ == {class_name!r}, type(m)
        x = load_file({str(work / 'x.safetensors')!r})
        with torch.no_grad():
            save_file({{'y': m(**x).contiguous()}}, {str(work / 'y.safetensors')!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=work)
    return load_file(str(work / "y.safetensors"))["y"]
