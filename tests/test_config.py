"""Settings: grouped by concern in code, read from the same flat environment variables."""

from __future__ import annotations

import pydantic
import pytest

from skytrain_backend.config import GatewaySettings, Settings, variables

# Values to try for a variable, in order: the first its field takes, other than its default.
CANDIDATES = ("7", "64", "0.5", "true", "false", "hf", "json", "skypilot", "fsdp", "skyx-")
CANDIDATES += ("http://hub.example", "/srv/skytrain")


def test_every_variable_sets_its_groups_field(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*variables(), "HF_TOKEN", "HF_ENDPOINT"]:
        monkeypatch.delenv(name, raising=False)
    defaults = Settings()
    unread = []
    for name, (group, field) in variables().items():
        group_settings = getattr(defaults, group)
        default = getattr(group_settings, field)
        for value in CANDIDATES:
            monkeypatch.setenv(name, value)
            try:
                read = getattr(type(group_settings)(), field)
            except pydantic.ValidationError:
                continue
            if read != default:
                break
        else:
            unread.append(name)
        monkeypatch.delenv(name)
    assert not unread, f"no value of these variables reaches its setting: {unread}"


def test_the_variables_keep_their_flat_names() -> None:
    named = variables()
    assert named["SKYTRAIN_HOME"] == ("storage", "home")
    assert named["SKYTRAIN_GATEWAY_DEFAULT_MAX_TOKENS"] == ("gateway", "default_max_tokens")
    assert named["SKYTRAIN_TENANT_MAX_MODELS"] == ("tenant_limits", "max_models")
    assert named["SKYTRAIN_ENGINE"] == ("engine", "kind")
    assert named["SKYTRAIN_VLLM_PYTHON"] == ("engine", "vllm_python")
    assert named["SKYTRAIN_HF_TOKEN"] == ("hub", "token")
    assert named["PROMETHEUS_MULTIPROC_DIR"] == ("observability", "prometheus_multiproc_dir")


def test_a_group_given_in_part_reads_the_rest_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SKYTRAIN_GATEWAY_LOADING_WAIT_S", "5")
    monkeypatch.setenv("SKYTRAIN_TENANT_MAX_MODELS", "3")
    settings = Settings(gateway={"default_max_tokens": 64})
    assert (settings.gateway.default_max_tokens, settings.gateway.loading_wait_s) == (64, 5.0)
    assert settings.tenant_limits.max_models == 3
    built = Settings(gateway=GatewaySettings(default_max_tokens=64))
    assert (built.gateway.default_max_tokens, built.gateway.loading_wait_s) == (64, 5.0)


def test_the_hubs_own_variables_are_read_when_skytrains_are_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SKYTRAIN_HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf-of-the-host")
    token = Settings().hub.token
    assert token is not None and token.get_secret_value() == "hf-of-the-host"
    monkeypatch.setenv("SKYTRAIN_HF_TOKEN", "hf-of-skytrain")
    token = Settings().hub.token
    assert token is not None and token.get_secret_value() == "hf-of-skytrain"


def test_a_setting_outside_its_group_or_misspelled_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="gateway_default_max_tokens"):
        Settings(gateway_default_max_tokens=64)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError, match=r"default_max_token\b"):
        Settings(gateway={"default_max_token": 64})
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        Settings(gateway={"default_max_tokens": 0})
