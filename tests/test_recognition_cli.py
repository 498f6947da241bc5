"""`normkit recognition` (what make test-latest prints): real model families as installed, each
patched in a dry run, with the norms patched or left alone and the blocks fused or left unfused."""
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def _run(*args):
    return subprocess.run([sys.executable, "-m", "normkit", "recognition", *args], capture_output=True, text=True,
                          timeout=300)


def test_recognition_reports_patched_norms_fused_and_unfused_blocks():
    done = _run("--models", "transformers/llama,transformers/t5-encoder,transformers/olmo2", "--strict")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "transformers/llama: 5 norms patched, 0 kinds left alone" in out
    assert "fused    LlamaDecoderLayer x2: residual add + post_attention_layernorm" in out
    assert "transformers/t5-encoder: 5 norms patched, 0 kinds left alone" in out  # T5LayerNorm, by computation
    assert "unfused  Olmo2DecoderLayer x2: its forward computes no residual add" in out  # post-norm adds
    assert out.strip().endswith("3 families, 0 with a norm left alone or not building")


def test_recognition_names_unknown_families():
    done = _run("--models", "transformers/nope")
    assert done.returncode != 0 and "--models: unknown ['transformers/nope']" in done.stderr
    listed = _run("--list").stdout.split()
    assert "transformers/llama" in listed and "diffusers/unet2d" in listed
