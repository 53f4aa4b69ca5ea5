"""The control plane's base-model configs: read from the Hub once, then from the object store
by every control plane sharing it (the loopback Hub of tests/fixtures/hub.py, a real local
object store)."""

from __future__ import annotations

import pytest

from skytrain_backend.config import Settings
from skytrain_backend.errors import ModelConfigUnavailable
from skytrain_backend.scheduler import model_configs
from skytrain_backend.scheduler.model_configs import ModelConfigs
from skytrain_backend.storage import open_object_store
from tests.fixtures.hub import LoopbackHub
from tests.fixtures.services import MakeSettings

QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"


def _configs(settings: Settings) -> ModelConfigs:
    return ModelConfigs(
        settings, open_object_store(settings.storage.resolved_object_store_url, settings)
    )


def test_a_config_read_from_the_hub_serves_every_control_plane_sharing_the_store(
    make_settings: MakeSettings, loopback_hub: LoopbackHub
) -> None:
    settings = make_settings(hub={"endpoint": loopback_hub.url})
    first = _configs(settings).get(QWEN_7B)
    assert first is not None and first["hidden_size"] == 3584
    asked = len(loopback_hub.requests)
    assert asked > 0
    loopback_hub.online = False  # another control plane, the Hub down meanwhile
    assert _configs(settings).get(QWEN_7B) == first
    assert len(loopback_hub.requests) == asked


def test_a_failure_is_not_asked_again_at_once_unless_fresh(
    make_settings: MakeSettings, loopback_hub: LoopbackHub
) -> None:
    configs = _configs(make_settings(hub={"endpoint": loopback_hub.url}))
    with pytest.raises(ModelConfigUnavailable, match="nobody/no-such-model is not on the"):
        configs.get("nobody/no-such-model")
    asked = len(loopback_hub.requests)
    with pytest.raises(ModelConfigUnavailable, match="check the model id"):
        configs.get("nobody/no-such-model")
    assert len(loopback_hub.requests) == asked  # remembered, not asked again
    with pytest.raises(ModelConfigUnavailable):
        configs.get("nobody/no-such-model", fresh=True)  # the scheduler, before a launch
    assert len(loopback_hub.requests) > asked


def test_what_one_process_keeps_is_bounded_whatever_base_models_tenants_name(
    make_settings: MakeSettings, loopback_hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The configs and failures were kept in dicts by base-model string, without end: a tenant
    naming new models kept growing the control plane's memory. (The bounds made small here,
    so the test asks the Hub a few times, not a thousand.)"""
    monkeypatch.setattr(model_configs, "KNOWN_FAILURES", 3)
    monkeypatch.setattr(model_configs, "KNOWN_CONFIGS", 1)
    configs = _configs(make_settings(hub={"endpoint": loopback_hub.url}))
    for index in range(5):
        with pytest.raises(ModelConfigUnavailable):
            configs.get(f"nobody/no-such-model-{index}")
    assert len(configs._failed) == 3
    assert configs.get(QWEN_7B) is not None
    assert len(configs._known) == 1
