"""The rules a new model meets, whichever protocol creates it: ``POST /v1/models`` (the REST API
and ART's client) and the Tinker protocol's training runs (``create_model``,
``create_training_client_from_state``) and base-model samplers (``create_sampling_session``).

- its base model is a Hugging Face id or a directory the operator allows
  (``base_models.check_base_model``: no host path such as ``/etc`` reaches a worker);
- its LoRA rank is one a worker for that base model loads (``ranks.check_lora_rank``);
- it is not a mixture of experts (``check_dense``: ``planning.experts`` says why), by its
  config.json from this machine's copies, or from the Hub when the provider has GPUs to plan;
- its base model fits one of the GPUs the provider's workers may get at the model's own LoRA
  rank, by its config.json (read from the Hub when this control plane has none;
  ``check_fits_a_gpu``: the memory plan's reasons otherwise);
- for a Tinker training run, one device trains it: Tinker runs use a one-process trainer, so a
  base model the memory plan shards over several GPUs is refused up front
  (``check_fits_a_gpu(one_device=True)``; the worker refuses such a run too);
- the tenant owns fewer models than its ``max_models`` quota: checked where the model row is
  inserted (``registry.check_model_quota``), so asking for one that exists is never refused.

Each is checked before anything is stored, so a refused request leaves nothing behind.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from skytrain_backend.base_models import check_base_model
from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db.models import Tenant
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import InvalidRequest, ModelConfigUnavailable
from skytrain_backend.json_types import JSONObject
from skytrain_backend.planning import choose_worker_gpu, experts, find_model_config
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.provision.base import Provider
from skytrain_backend.scheduler import placement, ranks
from skytrain_backend.scheduler.loop import Scheduler
from skytrain_backend.scheduler.model_configs import ModelConfigs


def check_new_model(
    session: Session,
    tenant: Tenant,
    base_model: str,
    config: ModelConfig,
    *,
    settings: Settings,
    scheduler: Scheduler,
    tinker_training: bool = False,
) -> TenantLimits:
    """Refuse (``InvalidRequest``, ``FitsNoGpu``) a base model or LoRA rank (``config``'s)
    the tenant may not use (``tinker_training``: for a Tinker training run), planned for the
    scheduler's provider with its cache of configs; the tenant's limits, whose ``max_models``
    the creation then enforces."""
    lora_rank, provider, configs = config.lora_rank, scheduler.provider, scheduler.configs
    check_base_model(base_model, allowed_dirs=settings.storage.resolved_base_model_dirs)
    ranks.check_lora_rank(
        session,
        base_model=base_model,
        lora_rank=lora_rank,
        default_limit=settings.engine.max_lora_rank,
        launches=provider is not None,
    )
    check_dense(
        session, base_model=base_model, settings=settings, provider=provider, configs=configs
    )
    if tinker_training and settings.worker.tinker_max_runs == 0:
        raise InvalidRequest(
            "this deployment runs no Tinker training runs (its workers hold none: "
            "SKYTRAIN_WORKER_TINKER_MAX_RUNS is 0); train with skytrain's training jobs "
            "(REST, SDK or ART's client), or ask the operator to allow Tinker runs"
        )
    check_fits_a_gpu(
        session,
        base_model=base_model,
        lora_rank=lora_rank,
        settings=settings,
        provider=provider,
        configs=configs,
        one_device=tinker_training,
    )
    return tenants.limits_of(tenant, settings)


def check_fits_a_gpu(
    session: Session,
    *,
    base_model: str,
    lora_rank: int,
    settings: Settings,
    provider: Provider | None,
    configs: ModelConfigs,
    one_device: bool = False,
) -> None:
    """Refuse (FitsNoGpu, 400, with each GPU's reason) a base model that fits none of the
    GPUs the provider's workers may get at ``lora_rank`` (the new model's), by its
    config.json (read from the Hub when this control plane has none: ``model_configs``);
    with ``one_device`` (a Tinker training run: its trainer is one process on one device),
    refuse too one whose plan shards the trainer over several GPUs.

    A config the Hub does not give passes: the model is created, and its status says why
    no worker is launched for it (``placement.NOT_LAUNCHED``), until the config can be read. An
    unknown GPU passes (the worker plans for itself), and so does a base model a registered
    worker already serves (it planned for its own GPUs: the worker refuses then, if it must).
    """
    accelerators = provider.accelerator_choices() if provider is not None else None
    if not accelerators or placement.served_by_a_registered_worker(session, base_model=base_model):
        return
    try:
        config = _base_config(session, base_model, accelerators, settings=settings, configs=configs)
    except ModelConfigUnavailable:
        return
    choice = choose_worker_gpu(
        base_model, accelerators, settings=settings, lora_rank=lora_rank, config=config
    )
    plan = choice.plan if choice is not None else None
    if one_device and plan is not None and plan.trainer_shards > 1:
        raise InvalidRequest(
            f"{base_model} trains sharded over {plan.trainer_shards} GPUs ({plan.gpu}), and "
            "Tinker training runs train on one GPU for now: train it with skytrain's training "
            "jobs (REST, SDK or ART's client), or choose a base model one GPU trains "
            "(sampling it through Tinker works)"
        )


def check_dense(
    session: Session,
    *,
    base_model: str,
    settings: Settings,
    provider: Provider | None,
    configs: ModelConfigs,
) -> None:
    """Refuse a mixture-of-experts base model (``planning.experts``). Its config.json comes
    from the Hub (``configs``, as the plan's) only when the provider has GPUs to plan for,
    so a local control plane never waits on the Hub; a config that cannot be had passes
    here, and the plan (``WorkerPlan``) or the worker refuses the model once it is read."""
    accelerators = provider.accelerator_choices() if provider is not None else None
    try:
        config = _base_config(session, base_model, accelerators, settings=settings, configs=configs)
    except ModelConfigUnavailable:
        return
    reason = experts.check_config(base_model, config)
    if reason is not None:
        raise InvalidRequest(reason)


def _base_config(
    session: Session,
    base_model: str,
    accelerators: list[str] | None,
    *,
    settings: Settings,
    configs: ModelConfigs,
) -> JSONObject | None:
    """The base model's config.json (ModelConfigUnavailable when it cannot be had now): from
    ``configs`` (the object store, else the Hub, up to ``SKYTRAIN_HUB_TIMEOUT_S``) when the
    provider has GPUs to plan for, the session's transaction ended first (its rows stay
    readable) so that no database connection is held meanwhile; else from this machine's
    copies only, so that a local control plane never waits on the Hub."""
    if accelerators:
        session.commit()
        return configs.get(base_model)
    return find_model_config(base_model, cache_dir=settings.storage.resolved_model_cache_dir)
