"""Crafted GGUF headers: refused with one line before MLX reads the file, nothing written."""

from __future__ import annotations

import pytest

from tests.bad_input import refused
from tests.conftest import run_cli
from tests.gguf_files import ARR, F32, HIDDEN, I32, STR, U32, U64, base_meta, base_tensors, gguf

pytestmark = pytest.mark.usefixtures("fresh_home")


def test_the_crafted_base_file_converts(tmp_path):
    """The writer makes a file the importer accepts: every refusal below is the change's."""
    from mlxkv.models.gguf import convert_gguf

    f = tmp_path / "ok.gguf"
    f.write_bytes(gguf(base_meta(), base_tensors()))
    out = convert_gguf(f, tmp_path / "out")
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_two_conversions_into_one_folder_at_once_both_end_with_it(tmp_path):
    """Two `mlxkv pull` at once: the second removed the first's folder in the making as
    stale, and the first failed with a FileNotFoundError traceback."""
    import threading

    from mlxkv.models.gguf import MARKER, convert_gguf

    f = tmp_path / "ok.gguf"
    f.write_bytes(gguf(base_meta(), base_tensors()))
    out, results = tmp_path / "models" / "tiny", []

    def convert():
        try:
            results.append(convert_gguf(f, out))
        except Exception as e:  # noqa: BLE001 - the failure is what the test reports
            results.append(e)

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [out, out, out]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER]
    )
    assert [p.name for p in out.parent.iterdir() if p.name.endswith(".partial")] == []


def _with(**changes):
    meta = base_meta()
    for k, v in changes.items():
        key = k.replace("__", ".")
        if v is None:
            meta.pop(key)
        else:
            meta[key] = v
    return meta


CASES = {
    "alignment 0": (
        _with(general__alignment=(U32, 0)),
        "general.alignment 0 is not a positive power of two",
    ),
    "alignment 3": (
        _with(general__alignment=(U32, 3)),
        "general.alignment 3 is not a positive power of two",
    ),
    "nested arrays": (
        _with(general__tags=(ARR, (ARR, [(U32, [1])]))),
        "GGUF metadata with nested arrays is not supported",
    ),
    "eos out of range": (
        _with(tokenizer__ggml__eos_token_id=(U32, 99999)),
        "'tokenizer.ggml.eos_token_id' 99999 is not a token id (0 to 4)",
    ),
    "scalar token list": (
        _with(tokenizer__ggml__tokens=(U32, 4)),
        "'tokenizer.ggml.tokens' must be a non-empty list of strings",
    ),
    "zero heads": (
        _with(llama__attention__head_count=(U32, 0)),
        "'llama.attention.head_count' must be a positive integer, not 0",
    ),
    "string length": (
        _with(llama__embedding_length=(STR, "8")),
        "'llama.embedding_length' must be a positive integer, not '8'",
    ),
    "huge block count": (
        _with(llama__block_count=(U64, 10**9)),
        "'llama.block_count' must be a positive integer, not 1000000000",
    ),
    "block count past the layer cap": (
        _with(llama__block_count=(U32, 2000)),
        "block_count is 2,000; mlxkv plans models of up to 1,024",
    ),
    "odd head size": (
        _with(llama__rope__dimension_count=(U32, 3)),
        "rope.dimension_count 3 is odd; rotary heads come in halves",
    ),
    "more blocks than tensors": (
        _with(llama__block_count=(U32, 3)),
        "block_count is 3 but the file holds 1 layers",
    ),
    "token types of another length": (
        _with(tokenizer__ggml__token_type=(ARR, (I32, [1]))),
        "'tokenizer.ggml.token_type' has 1 entries for 5 tokens",
    ),
    "template not a string": (
        _with(tokenizer__chat_template=(U32, 7)),
        "'tokenizer.chat_template' must be a string",
    ),
    "missing heads": (
        _with(llama__attention__head_count=None),
        "metadata is missing 'llama.attention.head_count'",
    ),
    "merge of unknown tokens": (
        _with(tokenizer__ggml__merges=(ARR, (STR, ["a zz"]))),
        "unsupported tokenizer: merge 'a zz' joins tokens that are not in the vocabulary",
    ),
    "nan epsilon": (
        _with(llama__attention__layer_norm_rms_epsilon=(F32, float("nan"))),
        "'llama.attention.layer_norm_rms_epsilon' must be a positive number",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_header_is_one_line(capsys, tmp_path, case):
    meta, words = CASES[case]
    align = meta.get("general.alignment", (0, 32))[1]
    f = tmp_path / "m.gguf"
    data = gguf(meta, base_tensors(), align=align if align in (1, 2, 4, 8, 16, 32) else 32)
    f.write_bytes(data)
    line = refused(capsys, "pull", str(f))
    assert words in line, line
    assert f.read_bytes() == data
    models = tmp_path / "home" / "models"
    assert not models.exists() or not any(models.iterdir())


@pytest.mark.parametrize(
    "tensors, words",
    [
        (
            [*base_tensors()[:-1], ("blk.0.ffn_norm.weight", (1,) * 10)],
            "blk.0.ffn_norm.weight has 10 dimensions (1 to 4 allowed)",
        ),
        (
            [*base_tensors(), ("blk.0.attn_q.weight.x", (8,))],
            "tensor name 'blk.0.attn_q.weight.x' is not a llama layer tensor",
        ),
        (
            [("token_embd.weight", (6, HIDDEN)), *base_tensors()[1:]],
            "tensor token_embd.weight has shape [6, 8], the metadata says [5, 8]",
        ),
    ],
)
def test_crafted_tensor_table_is_one_line(capsys, tmp_path, tensors, words):
    f = tmp_path / "m.gguf"
    f.write_bytes(gguf(base_meta(), tensors))
    assert words in refused(capsys, "pull", str(f))


def test_tensors_that_share_bytes_are_refused_before_conversion(capsys, tmp_path):
    """Every tensor at offset 0: a 1.2 MB file converted into 3 GB before its layer count
    was refused, and the folder stayed."""
    f = tmp_path / "m.gguf"
    f.write_bytes(gguf(base_meta(), base_tensors(), stacked=True))
    line = refused(capsys, "pull", str(f))
    assert "GGUF tensors output_norm.weight and blk.0.attn_norm.weight share bytes" in line, line
    models = tmp_path / "home" / "models"
    assert not models.exists() or not any(models.iterdir())


def test_ten_dimensions_never_reach_mlx(tmp_path):
    """This one aborted inside MLX's GGUF reader (exit 134): checked in a subprocess."""
    f = tmp_path / "m.gguf"
    f.write_bytes(gguf(base_meta(), [*base_tensors(), ("blk.0.x.weight", (1,) * 10)]))
    p = run_cli("pull", str(f), env={"MLXKV_HOME": str(tmp_path / "home")}, timeout=60)
    assert p.returncode == 2, p.stderr
    errors = [x for x in p.stderr.splitlines() if ": error: " in x]
    assert len(errors) == 1 and "10 dimensions" in errors[0], p.stderr
    assert "Traceback" not in p.stderr


def test_a_fifo_named_as_gguf_is_refused_without_blocking(capsys, tmp_path):
    import os

    f = tmp_path / "pipe.gguf"
    os.mkfifo(f)
    line = refused(capsys, "pull", str(f))
    assert "pipe.gguf" in line
