"""A new model's plan check reads its base model's config.json (the object store, the Hub)
with no database connection held: a slow Hub must not hold a connection per request."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api.admission import model_rules
from skytrain_backend.config import Settings
from skytrain_backend.errors import ModelConfigUnavailable


class _Provider:
    def accelerator_choices(self) -> list[str]:
        return ["L4:1"]


class _Configs:
    """Stands for ``ModelConfigs``: records whether the caller's session held a transaction
    (and so a connection) while the config was read, and answers as a Hub that is down."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.in_transaction: list[bool] = []

    def get(self, base_model: str, **_: Any) -> dict[str, Any]:
        self.in_transaction.append(self.session.in_transaction())
        raise ModelConfigUnavailable("the Hub is down")


@pytest.mark.parametrize(
    "check",
    [
        functools.partial(model_rules.check_fits_a_gpu, lora_rank=8),
        functools.partial(model_rules.check_fits_a_gpu, lora_rank=8, one_device=True),
        model_rules.check_dense,
    ],
    ids=["fits_a_gpu", "one_device_trains", "dense"],
)
def test_the_base_models_config_is_read_with_no_transaction_open(
    check: Callable[..., None], settings: Settings, db_sessions: sessionmaker[Session]
) -> None:
    with db_sessions() as session:
        configs = _Configs(session)
        check(
            session,
            base_model="Qwen/Qwen2.5-7B-Instruct",
            settings=settings,
            provider=_Provider(),
            configs=configs,
        )
    assert configs.in_transaction == [False]
