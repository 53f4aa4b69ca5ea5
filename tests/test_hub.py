"""Base model resolution and the offline SmolLM2 / tiny test models."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from skytrain_backend import hub

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_smollm2_converts_with_the_original_special_tokens(smollm2_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert AutoConfig.from_pretrained(smollm2_path).eos_token_id == end
    assert GenerationConfig.from_pretrained(smollm2_path).eos_token_id == end
    # Plain weights: nothing says the model is still quantized (Trainer would refuse it).
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config


def test_the_chat_template_renders_tools_and_tool_calls(tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_weather"' in text.split("<tools>")[1].split("</tools>")[0]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_resolution_prefers_local_directories_then_the_cache(tmp_path: Path) -> None:
    local = tmp_path / "my-model"
    local.mkdir()
    assert hub.resolve_model(str(local), cache_dir=tmp_path / "cache") == str(local)
    # Unknown ids go to the Hugging Face Hub unchanged (the default path for real users).
    assert hub.resolve_model("org/unknown-model", cache_dir=tmp_path / "cache") == (
        "org/unknown-model"
    )


def test_a_build_from_an_older_recipe_is_not_used(tmp_path: Path) -> None:
    stale = hub.cache_path("org/some-model", tmp_path)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / hub.BUILD_MARKER).write_text(json.dumps({"version": hub.BUILD_VERSION - 1}))
    assert hub.resolve_model("org/some-model", cache_dir=tmp_path) == "org/some-model"
    (stale / hub.BUILD_MARKER).write_text(json.dumps({"version": hub.BUILD_VERSION}))
    assert hub.resolve_model("org/some-model", cache_dir=tmp_path) == str(stale)
