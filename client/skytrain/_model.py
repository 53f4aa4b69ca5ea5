"""Models: prompted ones on any OpenAI-compatible endpoint, and trainable ones on skytrain.

A ``TrainableModel`` is a LoRA adapter over ``base_model`` that skytrain serves and trains.
After ``await model.register(backend)`` its ``openai_client()`` talks to skytrain's endpoint,
and ``train``, ``log`` and the checkpoint calls act on it. A ``Model`` is a baseline to
compare against: the same ``openai_client()`` / ``get_inference_name()``, pointed anywhere.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
from openai import AsyncOpenAI
from pydantic import BaseModel, Field, PrivateAttr

from skytrain._backend import Backend
from skytrain._exceptions import (
    ConfigurationError,
    NotRegisteredError,
    ServingFailedError,
    TrainingFailedError,
    WaitTimeoutError,
)
from skytrain._progress import _format_metrics, _progress_bar, _StatusLine
from skytrain._trajectories import Trajectory, TrajectoryGroup
from skytrain._types import Checkpoint, ModelConfig, SFTConfig, TrainConfig, TrainResult
from skytrain._wire import (
    _JobAnswer,
    _LogBody,
    _ModelAnswer,
    _ModelCreateBody,
    _SFTTrainBody,
    _TrainBody,
)

_TERMINAL_JOB_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
# The longest the server holds one request for a job's next event.
_FOLLOW_WAIT_S = 30.0


def _cut_words(started: Mapping[str, Any]) -> str | None:
    """What a ``training_started`` event says its rows cut of longer sequences, in words
    (None: nothing)."""
    row = int(started.get("packing/row_length") or 0)
    cut, cut_tokens = int(started.get("sequences/truncated") or 0), started.get("tokens/truncated")
    dropped, dropped_tokens = (
        int(started.get("sequences/dropped") or 0),
        started.get("tokens/dropped"),
    )
    said = []
    if cut or cut_tokens:
        said.append(
            f"{cut} sequences were cut to its rows of {row} tokens, "
            f"{int(cut_tokens or 0)} trained tokens left out"
        )
    if dropped:
        said.append(
            f"{dropped} sequences longer than its rows of {row} tokens were left out "
            f"({int(dropped_tokens or 0)} trained tokens)"
        )
    return "; ".join(said) or None


def _numeric(data: Mapping[str, object]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in data.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
    }


def _groups_payload(groups: Iterable[TrajectoryGroup]) -> list[dict[str, Any]]:
    payload = []
    for index, group in enumerate(groups):
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(
                f"groups[{index}] is a {type(group).__name__}, not a skytrain.TrajectoryGroup"
            )
        if not group.is_resolved:
            raise ValueError(
                f"groups[{index}] still holds rollouts that have not run: await the group or "
                "pass the groups through gather_trajectory_groups first"
            )
        payload.append(group.model_dump(mode="json"))
    return payload


class Model(BaseModel):
    """A model served by any OpenAI-compatible endpoint, e.g. a prompted baseline."""

    name: str
    project: str
    entity: str | None = None
    inference_model_name: str | None = None
    inference_base_url: str | None = None
    inference_api_key: str | None = Field(default=None, repr=False, exclude=True)

    _openai_client: AsyncOpenAI | None = PrivateAttr(default=None)

    def openai_client(self) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client for the model's endpoint (made once, then reused)."""
        if self._openai_client is None:
            if self.inference_base_url is None:
                raise ConfigurationError(
                    f"model {self.name!r} has no inference_base_url: pass the URL of the "
                    "OpenAI-compatible endpoint that serves it"
                )
            self._openai_client = AsyncOpenAI(
                base_url=self.inference_base_url, api_key=self.inference_api_key
            )
        return self._openai_client

    def get_inference_name(self, step: int | None = None) -> str:
        """The ``model`` argument for chat completions on this model's endpoint."""
        if step is not None:
            raise ValueError(f"model {self.name!r} is a prompted model: it has no steps")
        return self.inference_model_name or self.name


class TrainableModel(Model):
    """A LoRA adapter over ``base_model`` that skytrain serves and trains.

    ``base_model`` is any Hugging Face model id (or a path the workers can read). ``config``
    fixes the adapter's shape at registration; fields left ``None`` take the server's default.
    """

    base_model: str
    config: ModelConfig | None = None

    _backend: Backend | None = PrivateAttr(default=None)
    _id: str | None = PrivateAttr(default=None)

    @property
    def id(self) -> str | None:
        """The server's id of this model, once registered."""
        return self._id

    def openai_client(self) -> AsyncOpenAI:
        """A client for skytrain's OpenAI-compatible endpoint, authenticated with the API key."""
        if self.inference_base_url is None:
            self._registered()
        return super().openai_client()

    def get_inference_name(self, step: int | None = None) -> str:
        """``entity/project/name``, or ``entity/project/name:step<N>`` to pin a checkpoint."""
        name = self.inference_model_name
        if name is None:
            if self.entity is None:
                raise NotRegisteredError(
                    f"model {self.name!r} has no entity yet: await model.register(backend) "
                    "first, or pass entity=..."
                )
            name = f"{self.entity}/{self.project}/{self.name}"
        if step is None:
            return name
        if step < 0:
            raise ValueError(f"step={step} must not be negative")
        return f"{name}:step{step}"

    # --- registration -----------------------------------------------------------------------

    async def register(
        self,
        backend: Backend,
        *,
        wait: bool = True,
        timeout: float = 1800.0,  # noqa: ASYNC109 - bounds a polling wait, named in its error
        poll_interval: float = 2.0,
        progress: bool = True,
    ) -> None:
        """Create the model on the server (or find it), then wait until it is served.

        Registering again is safe: the server returns the existing model. With ``wait``, a
        status line shows what the server is doing (provisioning a worker, loading the base
        model) until the model answers, ``ServingFailedError`` says why it cannot, and
        ``WaitTimeoutError`` ends a wait longer than ``timeout`` seconds.
        """
        body = _ModelCreateBody(
            project=self.project,
            name=self.name,
            base_model=self.base_model,
            return_existing=True,
        )
        if self.entity is not None:
            body["entity"] = self.entity
        if self.config is not None:
            body["config"] = self.config._to_request()
        created = await backend._register_model(body)
        self._backend = backend
        self._id = str(created["id"])
        self.entity = created["entity"]
        self.inference_model_name = created["inference_name"]
        self.inference_base_url = backend._inference_base_url
        self.inference_api_key = backend.api_key
        self._openai_client = None
        if wait and "serving" in created:
            await self._wait_until_served(
                created, limit_s=timeout, poll_interval=poll_interval, progress=progress
            )

    async def _wait_until_served(
        self, model: _ModelAnswer, *, limit_s: float, poll_interval: float, progress: bool
    ) -> None:
        backend, model_id = self._registered()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        status = _StatusLine(f"serving {self.get_inference_name()}", enabled=progress)
        try:
            while True:
                serving = model.get("serving")
                if serving is None or serving.get("ready"):
                    status.show("ready")
                    return
                message = serving.get("message") or serving.get("state") or "waiting"
                if serving.get("state") == "failed":
                    raise ServingFailedError(
                        f"model {self.get_inference_name()} cannot be served: {message}"
                    )
                status.show(message)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise WaitTimeoutError(
                        f"model {self.get_inference_name()} was not served within {limit_s:g} s "
                        f"(last status: {message}); the server keeps trying, so register() "
                        "again to keep waiting, or pass a longer timeout"
                    )
                await asyncio.sleep(min(poll_interval, remaining))
                model = await backend._get_model(model_id)
        finally:
            status.close()

    def _registered(self) -> tuple[Backend, str]:
        if self._backend is None or self._id is None:
            raise NotRegisteredError(
                f"model {self.name!r} is not registered: await model.register(backend) first"
            )
        return self._backend, self._id

    async def set_replicas(
        self, *, min_replicas: int | None = None, max_replicas: int | None = None
    ) -> _ModelAnswer:
        """Change how many workers may serve the model (``max_replicas`` at most the
        tenant's ``max_workers``); the server adds replicas while demand per replica stays
        high and drains them while it stays low. Returns the model as the server shows it
        (its ``replicas``, each with its requests in flight, and its ``demand``)."""
        backend, model_id = self._registered()
        body = {
            key: value
            for key, value in (("min_replicas", min_replicas), ("max_replicas", max_replicas))
            if value is not None
        }
        return await backend._update_model(model_id, body)

    # --- training ---------------------------------------------------------------------------

    async def train(
        self,
        groups: Iterable[TrajectoryGroup],
        *,
        config: TrainConfig | None = None,
        poll_interval: float = 1.0,
        timeout: float | None = 6 * 3600.0,  # noqa: ASYNC109 - bounds a polling wait
        progress: bool = True,
    ) -> TrainResult:
        """Train one GRPO step on ``groups`` and wait for it, following the job's events.

        A progress bar counts gradient steps and shows the latest metrics; until the job
        starts, it says why the job waits (the server's words). Returns the new
        step and its metrics (the trainer's, averaged over gradient steps, with
        ``train/reward``, the mean reward trained on); ``TrainingFailedError`` carries the server's reason when the
        job fails. ``timeout`` (seconds, ``None`` for no limit) bounds the whole wait; the job
        keeps running on the server if the wait ends. A ``RuntimeWarning`` says when the job
        found its trainer's logprobs of the sampled tokens far from the engine's (the job's
        ``logprob_agreement/*`` metrics say by how much), and when trajectories are longer
        than the job's row (the model's ``max_seq_length`` or the job's
        ``packed_sequence_length``): at submission, how many and the longest, for those
        sampled through skytrain; once training starts, how many the trainer cut and the
        trained tokens it left out. A job that yields its worker to
        another tenant's job between two steps resumes where it stopped: the bar says so
        meanwhile, and the result is the one it would have had without the pause.
        """
        backend, model_id = self._registered()
        groups = list(groups)
        body = _TrainBody(model_id=model_id, trajectory_groups=_groups_payload(groups))
        if config is not None:
            body["config"] = config._to_request()
        job = await backend._create_training_job(body)
        if too_long := job.get("too_long"):
            warnings.warn(
                f"training job {job['id']}: {too_long['sequences']} of its trajectories are "
                f"longer than its rows of {too_long['row_tokens']} tokens (the longest: "
                f"{too_long['longest_tokens']}); the trainer cuts them to the row (under ART's "
                "rules, leaves them out): raise the model's max_seq_length or the job's "
                "packed_sequence_length, or send shorter trajectories",
                RuntimeWarning,
                stacklevel=2,
            )
        result = await self._follow_job(
            str(job["id"]), poll_interval=poll_interval, limit_s=timeout, progress=progress
        )
        return TrainResult(step=result.step, metrics=_reward_metrics(groups) | result.metrics)

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory],
        *,
        config: SFTConfig | None = None,
        poll_interval: float = 1.0,
        timeout: float | None = 6 * 3600.0,  # noqa: ASYNC109 - bounds a polling wait
        progress: bool = True,
    ) -> TrainResult:
        """Fine-tune on ``trajectories`` (supervised, on their assistant turns) and wait."""
        backend, model_id = self._registered()
        sft_body = _SFTTrainBody(
            model_id=model_id,
            trajectories=[trajectory.model_dump(mode="json") for trajectory in trajectories],
        )
        if config is not None:
            sft_body["config"] = config._to_request()
        job = await backend._create_sft_training_job(sft_body)
        return await self._follow_job(
            str(job["id"]), poll_interval=poll_interval, limit_s=timeout, progress=progress
        )

    async def _follow_job(
        self, job_id: str, *, poll_interval: float, limit_s: float | None, progress: bool
    ) -> TrainResult:
        """Read the job's events from the last seen one on, until it ends or fails.

        Each request waits on the server for the next event (``wait_s``), so events arrive as
        they happen; ``poll_interval`` is the pause after an answer with none. When no new
        event arrives the job's status is checked too, so a job cancelled on the
        server (which emits no event) ends the wait instead of hanging it.
        """
        backend, _ = self._registered()
        loop = asyncio.get_running_loop()
        deadline = None if limit_s is None else loop.time() + limit_s
        bar = _progress_bar(desc="train", total=None, unit="step") if progress else None
        steps: list[dict[str, float]] = []  # each gradient step's metrics, in order
        cursor: str | None = None
        job_finished: _JobAnswer | None = None

        def mean_metrics() -> dict[str, float]:
            values: defaultdict[str, list[float]] = defaultdict(list)
            for metrics in steps:
                for key, value in metrics.items():
                    values[key].append(value)
            return {key: sum(v) / len(v) for key, v in values.items()}

        def show_waiting(job: _JobAnswer) -> None:
            # A queued job says why it has not started (no worker yet, the tenant's quota,
            # another job first): the bar says so until training starts.
            if bar is not None and job.get("waiting"):
                bar.set_description_str(f"train: {job['waiting']}")

        try:
            if bar is not None:
                show_waiting(await backend._get_training_job(job_id))
            while True:
                # The server holds the request until the next event (a long-poll), within
                # the request's own timeout and the wait's deadline.
                wait_s = min(_FOLLOW_WAIT_S, backend.timeout / 2)
                if deadline is not None:
                    wait_s = max(0.0, min(wait_s, deadline - loop.time()))
                page = await backend._training_job_events(
                    job_id, after=cursor, limit=100, wait_s=round(wait_s, 3)
                )
                for event in page["data"]:
                    cursor = str(event["id"])
                    kind, data = event["type"], event.get("data") or {}
                    if kind == "training_started":
                        steps.clear()  # a retried attempt starts over
                        if bar is not None:
                            bar.set_description_str("train")
                            bar.reset(total=data.get("num_gradient_steps"))
                        if data.get("warning"):
                            # The trainer's logprobs are far from the sampler's: say so.
                            warnings.warn(
                                f"training job {job_id}: {data['warning']}",
                                RuntimeWarning,
                                stacklevel=2,
                            )
                        if cut := _cut_words(data):
                            warnings.warn(
                                f"training job {job_id}: {cut}", RuntimeWarning, stacklevel=2
                            )
                    elif kind == "gradient_step":
                        metrics = _numeric(data)
                        steps.append(metrics)
                        if bar is not None:
                            bar.set_postfix(_format_metrics(metrics), refresh=False)
                            bar.update(1)
                    elif kind == "training_preempted" and bar is not None:
                        bar.set_description_str(
                            f"train (yielded the worker to another tenant's job after step "
                            f"{data.get('steps_done')}; resumes there)"
                        )
                    elif kind == "training_resumed":
                        # From the state saved after that step: steps an attempt trained
                        # after it (and lost with its worker) are trained again.
                        del steps[int(data.get("steps_done", len(steps))) :]
                        if bar is not None:
                            bar.set_description_str("train")
                            bar.n = len(steps)
                            bar.total = bar.total or data.get("num_gradient_steps")
                            bar.refresh()
                    elif kind == "training_ended":
                        return TrainResult(
                            step=int(data["step"]), metrics=mean_metrics() | _numeric(data)
                        )
                    elif kind == "training_failed":
                        raise TrainingFailedError(
                            str(data.get("error_message") or "the server gave no reason"),
                            job_id=job_id,
                        )
                if page.get("has_more"):
                    continue
                if job_finished is not None:
                    # The job ended and every event after it has been read: none said how.
                    step = job_finished["step"]
                    if job_finished["status"] == "succeeded" and step is not None:
                        return TrainResult(step=int(step), metrics=mean_metrics())
                    raise TrainingFailedError(
                        str(job_finished.get("error") or f"the job was {job_finished['status']}"),
                        job_id=job_id,
                    )
                if not page["data"]:
                    job = await backend._get_training_job(job_id)
                    show_waiting(job)
                    if job["status"] in _TERMINAL_JOB_STATUSES:
                        job_finished = job
                        continue  # read the events written before the status changed
                if deadline is not None and loop.time() >= deadline:
                    raise WaitTimeoutError(
                        f"training job {job_id} did not finish within {limit_s:g} s; it keeps "
                        f"running on the server (POST /v1/training-jobs/{job_id}/cancel stops it)"
                    )
                await asyncio.sleep(poll_interval)
        finally:
            if bar is not None:
                bar.close()

    # --- logging, steps, checkpoints --------------------------------------------------------

    async def log(
        self, groups: Iterable[TrajectoryGroup], *, split: str = "val", step: int | None = None
    ) -> None:
        """Store scored trajectories (e.g. a validation run) with their summary metrics.

        ``step`` defaults to the model's current step on the server.
        """
        backend, model_id = self._registered()
        body = _LogBody(trajectory_groups=_groups_payload(groups), split=split)
        if step is not None:
            body["step"] = step
        await backend._log(model_id, body)

    async def get_step(self) -> int:
        """The latest trained step (0 before the first training job)."""
        backend, model_id = self._registered()
        model = await backend._get_model(model_id)
        return int(model["latest_step"])

    async def list_checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint of the model, oldest step first."""
        backend, model_id = self._registered()
        return [Checkpoint._from_api(item) async for item in backend._checkpoints(model_id)]

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Delete every checkpoint except the latest and the best; return the deleted steps.

        The best is the step whose checkpoint has the highest ``best_checkpoint_metric``. The
        server records ``model.log(groups, split=...)`` summaries in the checkpoint of the step
        they were logged at, as ``<split>/<metric>``: ``val/reward`` is the mean reward of the
        validation trajectories logged at that step. Step 0 (the base model, no files) is kept.
        """
        backend, model_id = self._registered()
        checkpoints = [c for c in await self.list_checkpoints() if c.step > 0]
        if len(checkpoints) <= 1:
            return []
        scored = [c for c in checkpoints if best_checkpoint_metric in c.metrics]
        if not scored:
            known = sorted({key for c in checkpoints for key in c.metrics})
            raise ValueError(
                f"no checkpoint of model {self.name!r} has metric {best_checkpoint_metric!r}, so "
                "the best one is unknown: log validation trajectories at each step with "
                "model.log(groups, split='val'), or pass best_checkpoint_metric= one of the "
                f"checkpoints' metrics {known}"
            )
        best = max(scored, key=lambda c: (c.metrics[best_checkpoint_metric], c.step)).step
        latest = max(c.step for c in checkpoints)
        doomed = sorted(c.step for c in checkpoints if c.step not in (best, latest))
        if not doomed:
            return []
        result = await backend._delete_checkpoints(model_id, doomed)
        not_found = set(result.get("not_found_steps") or [])
        return [step for step in doomed if step not in not_found]

    async def pull_checkpoint(self, step: int, path: str | os.PathLike[str]) -> Path:
        """Download checkpoint ``step``'s files (the LoRA adapter) into directory ``path``.

        Files are downloaded into a temporary directory beside ``path`` and moved into place
        only once all have arrived complete, so a failed pull leaves ``path`` untouched.
        """
        backend, model_id = self._registered()
        files = await backend._checkpoint_files(model_id, step)
        if not files:
            raise ValueError(
                f"checkpoint step {step} of model {self.name!r} has no files: step 0 is the "
                f"base model itself ({self.base_model})"
            )
        directory = Path(path)
        for file in files:
            name = file["name"]
            if Path(name).name != name or name in ("", ".", ".."):
                raise ValueError(
                    f"the server listed a checkpoint file named {name!r}, which is not a plain "
                    f"file name; refusing to write outside {directory}"
                )
        await anyio.Path(directory).mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            for file in files:
                await backend._download_checkpoint_file(
                    model_id,
                    step,
                    file["name"],
                    staging / file["name"],
                    expected_size=file.get("size"),
                )
            for file in files:
                (staging / file["name"]).replace(directory / file["name"])
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return directory


def _reward_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """``train/reward`` (mean) and ``train/num_trajectories`` of what was trained on."""
    rewards = [trajectory.reward for group in groups for trajectory in group.trajectories]
    if not rewards:
        return {}
    return {
        "train/reward": sum(rewards) / len(rewards),
        "train/num_trajectories": float(len(rewards)),
    }
