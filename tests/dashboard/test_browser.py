"""The dashboard in headless Chromium against a real ``skytrain serve`` (SQLite + a local
directory) whose local provider starts a real worker (CPU engine + GRPO trainer) serving the
tiny random model.

One service and one set of models serve the whole module, made through the SDK as a user
makes them: ``reward-run`` sampled, logged and trained two steps (plus a logged conversation
with tool calls and HTML in it), ``baseline`` with logged rewards only (the project's other
run), and ``live-run``, on which tests start jobs to watch.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

import skytrain
from tests.dashboard.conftest import run_async
from tests.fixtures.rollouts import sample_groups
from tests.fixtures.service import (
    Service,
    logs_printed_on_failure,
    start_service,
    stop_service,
)

pytestmark = [pytest.mark.e2e]

PROJECT = "dashboard"
TENANT = "viewer"
TRAIN = skytrain.TrainConfig(learning_rate=5e-3)
JOB_CONFIG = {"learning_rate": 5e-3}  # TRAIN, as POST /v1/training-jobs takes it
WAIT_S = 300.0
TRAINED_STEPS = 2
# Text that a page which parsed it as HTML would run; the dashboard must show it as text.
HOSTILE = '<script>window.__pwned = true</script><img src="x" onerror="window.__pwned = true">'
BASELINE_REWARDS = {0: [0.1, 0.3], 1: [0.2, 0.4], 2: [0.6, 0.8]}
TOOL_REWARDS = (0.25, 0.75)


@dataclass
class Runs:
    """What the SDK made, and what it logged, to compare with what the page shows."""

    key: str
    run_id: str
    inference_name: str
    baseline_id: str
    live_id: str
    live_inference_name: str
    val_rewards: dict[int, list[float]] = field(default_factory=dict)
    sampled: dict[str, Any] = field(default_factory=dict)  # a logged sampled trajectory


def js_number(value: float) -> str:
    """A number as the page writes it (dom.js formatNumber, for 1e-3 <= |value| < 1e6).

    ``toPrecision(4)`` rounds the exact binary value and takes the larger magnitude on a tie
    (0.90625 -> 0.9063), where Python's formatting takes the even digit (0.9062)."""
    if float(value).is_integer():
        return str(int(value))
    exact = Decimal(float(value))
    rounded = float(exact.quantize(Decimal(1).scaleb(exact.adjusted() - 3), ROUND_HALF_UP))
    return str(int(rounded)) if rounded.is_integer() else repr(rounded)


def tool_conversation(reward: float) -> skytrain.Trajectory:
    """A logged agent turn with a tool call, whose user message carries HTML."""
    return skytrain.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": f"What is the weather in Paris? {HOSTILE}"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_7",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_7", "content": "18 C and sunny"},
            {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        reward=reward,
        metrics={"turns": 2},
    )


def rewards_of(groups: list[skytrain.TrajectoryGroup]) -> list[float]:
    return [trajectory.reward for group in groups for trajectory in group.trajectories]


async def make_runs(service: Service, key: str, base_model: Path) -> Runs:
    async with skytrain.Backend(service.url, key, timeout=60.0) as backend:
        run = skytrain.TrainableModel(
            name="reward-run", project=PROJECT, base_model=str(base_model)
        )
        await run.register(backend, timeout=WAIT_S, poll_interval=0.5, progress=False)
        assert run.id is not None
        val_rewards: dict[int, list[float]] = {}
        for step in range(TRAINED_STEPS + 1):
            val = await sample_groups(run, groups=1, size=3)
            await run.log(val, split="val")
            val_rewards[step] = rewards_of(val)
            if step == TRAINED_STEPS:
                break
            train = await sample_groups(run, groups=2, size=3)
            result = await run.train(train, config=TRAIN, poll_interval=0.5, progress=False)
            assert result.step == step + 1
        tools = skytrain.TrajectoryGroup([tool_conversation(reward) for reward in TOOL_REWARDS])
        await run.log([tools], split="val")
        val_rewards[TRAINED_STEPS] += list(TOOL_REWARDS)
        sampled = val[0].trajectories[0]  # logged at the last step

        baseline = skytrain.TrainableModel(
            name="baseline", project=PROJECT, base_model=str(base_model)
        )
        await baseline.register(backend, wait=False)
        for step, rewards in BASELINE_REWARDS.items():
            logged = [
                skytrain.Trajectory(
                    messages_and_choices=[{"role": "user", "content": "Hi."}], reward=reward
                )
                for reward in rewards
            ]
            await baseline.log([skytrain.TrajectoryGroup(logged)], split="val", step=step)

        live = skytrain.TrainableModel(name="live-run", project=PROJECT, base_model=str(base_model))
        await live.register(backend, timeout=WAIT_S, poll_interval=0.5, progress=False)
    assert baseline.id is not None and live.id is not None
    return Runs(
        key=key,
        run_id=run.id,
        inference_name=run.get_inference_name(),
        baseline_id=baseline.id,
        live_id=live.id,
        live_inference_name=live.get_inference_name(),
        val_rewards=val_rewards,
        sampled=sampled.model_dump(mode="json"),
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """``skytrain serve`` with the local provider; one worker holds every model here."""
    overrides = {
        "SKYTRAIN_JOB_LEASE_S": "60",
        "SKYTRAIN_WORKER_HEARTBEAT_TIMEOUT_S": "45",
        "SKYTRAIN_WORKER_MAX_MODELS": "16",
    }
    service = start_service(overrides, tmp_path_factory.mktemp("dashboard") / "home")
    yield service
    stop_service(service)


@pytest.fixture(scope="module")
def runs(service: Service, tiny_model_path: Path) -> Runs:
    return run_async(make_runs(service, service.key(TENANT), tiny_model_path))


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest, service: Service) -> Iterator[None]:
    with logs_printed_on_failure(request, service):
        yield


def goto(page: Page, service: Service, route: str) -> None:
    page.goto(f"{service.url}/{route}")


def chart_data(page: Page, name: str) -> dict[str, Any]:
    """What a chart draws: its series' labels and its data arrays (x first)."""
    card = page.locator(f'[data-chart="{name}"]')
    expect(card).to_be_visible()
    # uPlot draws on a canvas; the card holds the instance from then on.
    expect(card.locator("canvas")).to_be_visible()
    return dict(
        card.evaluate(
            "card => ({labels: card.uplot.series.map(s => s.label), data: card.uplot.data,"
            " x: [card.uplot.scales.x.min, card.uplot.scales.x.max]})"
        )
    )


# --- sign-in and models -----------------------------------------------------------------------


@pytest.mark.slow
def test_sign_in_shows_the_tenants_models_and_a_wrong_key_is_refused(
    service: Service, runs: Runs, open_page: Callable[..., Page], screenshot: Any
) -> None:
    page = open_page(expected_errors=(r"status of 401",))
    goto(page, service, "")
    key_field = page.get_by_label("API key")
    expect(key_field).to_be_visible()

    key_field.fill("sk-st-not-a-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("API key is not valid")

    key_field.fill(runs.key)
    page.get_by_role("button", name="Sign in").click()
    rows = page.locator("table.models tbody tr")
    expect(rows).to_have_count(3)
    run_row = page.locator(f'tr[data-model-id="{runs.run_id}"]')
    expect(run_row.locator("th")).to_have_text("reward-run")
    cells = run_row.locator("td")
    expect(cells.nth(0)).to_have_text(PROJECT)
    expect(cells.nth(2)).to_have_text(str(TRAINED_STEPS))
    expect(cells.nth(3).locator(".badge")).to_have_text("ready")
    expect(cells.nth(3)).to_contain_text("worker")
    expect(cells.nth(5)).to_contain_text("ago")
    screenshot(page, "models")

    # The key stays in the browser: a reload is still signed in, until signing out.
    page.reload()
    expect(rows).to_have_count(3)
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("API key")).to_be_visible()
    assert page.evaluate("localStorage.getItem('skytrain.apiKey')") is None


def test_a_sign_in_link_signs_in_and_leaves_no_key_in_the_address(
    service: Service, runs: Runs, open_page: Callable[..., Page]
) -> None:
    page = open_page()
    goto(page, service, f"#/models/{runs.run_id}?key={runs.key}")
    expect(page.locator("h1.model-name")).to_contain_text("reward-run")
    assert runs.key not in page.url
    assert page.url.endswith(f"#/models/{runs.run_id}")


# --- a model's metrics ------------------------------------------------------------------------


def test_the_reward_chart_has_one_point_per_step_with_the_logged_values(
    service: Service, runs: Runs, open_page: Callable[..., Page], screenshot: Any
) -> None:
    page = open_page(runs.key)
    goto(page, service, f"#/models/{runs.run_id}")
    reward = chart_data(page, "reward")
    screenshot(page, "model-metrics")

    steps = list(range(TRAINED_STEPS + 1))
    labels, data = reward["labels"], reward["data"]
    assert data[0] == steps
    val = data[labels.index("val")]
    expected = [statistics.fmean(runs.val_rewards[step]) for step in steps]
    assert val == pytest.approx(expected)
    spread = [statistics.pstdev(runs.val_rewards[step]) for step in steps]
    assert data[labels.index("val + std")] == pytest.approx(
        [m + s for m, s in zip(expected, spread, strict=True)]
    )
    # Train reward: what each training job reported, at the step it produced.
    with service.http(TENANT) as http:
        checkpoints = http.get(f"/v1/models/{runs.run_id}/checkpoints").json()["data"]
    train = data[labels.index("train")]
    assert train[0] is None
    assert train[1:] == pytest.approx([c["metrics"]["train/reward"] for c in checkpoints[1:]])

    # Every metric the training jobs logged has a chart of its own, with a point per step.
    names = page.locator("[data-chart]").evaluate_all("cards => cards.map(c => c.dataset.chart)")
    for metric in ("loss/policy", "grad_norm", "entropy", "learning_rate", "clip_ratio/high"):
        assert metric in names, names
    assert chart_data(page, "grad_norm")["data"][0] == [1, 2]
    assert chart_data(page, "chars")["labels"] == ["step", "val"]

    # The numbers under "Data" are the chart's.
    card = page.locator('[data-chart="reward"]')
    card.locator("summary", has_text="Data").click()
    expect(card.locator("table.data tbody th")).to_have_text([str(step) for step in steps])
    first_row = card.locator("table.data tbody tr").first.locator("td")
    no_value = "\N{EN DASH}"
    expect(first_row).to_have_text([no_value, js_number(expected[0])])  # train, val at step 0

    # Dragging across the plot zooms in on the steps under it.
    overlay = card.locator(".u-over")
    box = overlay.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.05, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.55, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()
    low, high = chart_data(page, "reward")["x"]
    assert 0 < high - low < TRAINED_STEPS


def test_several_runs_of_a_project_share_one_chart(
    service: Service, runs: Runs, open_page: Callable[..., Page], screenshot: Any
) -> None:
    page = open_page(runs.key)
    goto(page, service, f"#/?project={PROJECT}")
    page.get_by_role("link", name=f"Compare the runs of {PROJECT}").click()
    chart = chart_data(page, "val/reward")
    assert chart["labels"] == ["step", "reward-run", "baseline", "live-run"]
    steps = chart["data"][0]
    assert steps == [0, 1, 2]
    baseline = chart["data"][chart["labels"].index("baseline")]
    assert baseline == pytest.approx([statistics.fmean(BASELINE_REWARDS[s]) for s in steps])
    run = chart["data"][chart["labels"].index("reward-run")]
    assert run == pytest.approx([statistics.fmean(runs.val_rewards[s]) for s in steps])
    screenshot(page, "compare")

    page.get_by_label("baseline").uncheck()
    # One line less: the legend lists the steps and the runs still chosen.
    legend = page.locator('[data-chart="val/reward"] .u-legend .u-series')
    expect(legend).to_have_count(3)
    expect(legend.nth(2)).to_contain_text("live-run")


# --- trajectories -----------------------------------------------------------------------------


def test_trajectories_show_a_logged_conversation_with_its_reward_and_tokens_by_logprob(
    service: Service, runs: Runs, open_page: Callable[..., Page], screenshot: Any
) -> None:
    page = open_page(runs.key)
    goto(page, service, f"#/models/{runs.run_id}/trajectories?split=val&step={TRAINED_STEPS}")
    group = page.locator('.group[data-group="0"]')
    trajectories = group.locator("details.trajectory")
    expect(trajectories).to_have_count(3)
    # Sorted by reward within the group, best first.
    shown = [float(r) for r in trajectories.evaluate_all("ds => ds.map(d => d.dataset.reward)")]
    assert shown == sorted(runs.val_rewards[TRAINED_STEPS][:3], reverse=True)

    first = group.locator('details.trajectory[data-index="0"]')
    expect(first.locator("summary .reward")).to_have_text(
        f"reward {js_number(runs.sampled['reward'])}"
    )
    first.locator("summary").click()
    messages = first.locator(".message")
    expect(messages).to_have_count(2)
    expect(messages.nth(0)).to_contain_text(runs.sampled["messages_and_choices"][0]["content"])
    # The sampled turn: one shaded span per sampled token, with its logprob.
    choice = runs.sampled["messages_and_choices"][1]
    tokens = messages.nth(1).locator(".token")
    expect(tokens).to_have_count(len(choice["logprobs"]["content"]))
    logprobs = [float(v) for v in tokens.evaluate_all("ts => ts.map(t => t.dataset.logprob)")]
    assert logprobs == pytest.approx([entry["logprob"] for entry in choice["logprobs"]["content"]])
    page.locator("#step-select").scroll_into_view_if_needed()
    screenshot(page, "trajectories")


def test_tool_calls_are_shown_and_html_in_messages_is_shown_as_text(
    service: Service, runs: Runs, open_page: Callable[..., Page]
) -> None:
    page = open_page(runs.key)
    goto(page, service, f"#/models/{runs.run_id}/trajectories?split=val&step={TRAINED_STEPS}")
    batch = page.locator("#batch-select")
    batch.select_option(index=1)  # the second batch logged at this step: the tool calls
    trajectories = page.locator('.group[data-group="0"] details.trajectory')
    expect(trajectories).to_have_count(2)
    assert trajectories.evaluate_all("ds => ds.map(d => d.dataset.index)") == ["1", "0"]
    page.get_by_label("Sort by reward within each group").uncheck()
    assert trajectories.evaluate_all("ds => ds.map(d => d.dataset.index)") == ["0", "1"]

    conversation = trajectories.first
    expect(conversation.locator("summary .reward")).to_have_text("reward 0.25")
    conversation.locator("summary").click()
    user = conversation.locator('.message[data-role="user"]')
    expect(user).to_contain_text(HOSTILE)
    assert user.locator("script, img").count() == 0
    assert page.evaluate("window.__pwned") is None
    call = conversation.locator('.tool-call[data-tool="get_weather"]')
    expect(call).to_contain_text('"city": "Paris"')
    expect(conversation.locator('.message[data-role="tool"]')).to_contain_text("result of call_7")
    expect(conversation.locator('.message[data-role="tool"]')).to_contain_text("18 C and sunny")
    expect(conversation.locator(".tools summary")).to_have_text("tools offered: get_weather")


# --- checkpoints and jobs ---------------------------------------------------------------------


def test_checkpoints_give_each_steps_inference_name_and_files(
    service: Service, runs: Runs, open_page: Callable[..., Page], screenshot: Any, tmp_path: Path
) -> None:
    page = open_page(runs.key)
    goto(page, service, f"#/models/{runs.run_id}/checkpoints")
    rows = page.locator("table.checkpoints tbody tr")
    expect(rows).to_have_count(TRAINED_STEPS + 1)
    assert rows.evaluate_all("rs => rs.map(r => r.dataset.step)") == ["2", "1", "0"]
    latest = rows.first
    expect(latest.locator(".copy-field")).to_have_value(f"{runs.inference_name}:step2")
    expect(latest.locator(".metrics-cell")).to_contain_text("val/reward")
    screenshot(page, "checkpoints")

    latest.get_by_role("button", name="Files").click()
    with page.expect_download() as download:
        latest.locator('[data-file="adapter_config.json"]').click()
    saved = tmp_path / "adapter_config.json"
    download.value.save_as(saved)
    assert json.loads(saved.read_text())["peft_type"] == "LORA"


@pytest.mark.slow
def test_a_jobs_events_appear_on_its_page_while_it_runs_and_its_step_on_the_charts(
    service: Service, runs: Runs, open_page: Callable[..., Page], screenshot: Any
) -> None:
    # The model's page, open before the job: its charts appear when the job's step lands.
    watcher = open_page(runs.key)
    goto(watcher, service, f"#/models/{runs.live_id}")
    expect(watcher.locator(".tab-content")).to_contain_text("No metrics yet")
    watcher.evaluate("window.__loaded = true")  # gone if the page were loaded again

    groups = run_async(_sample_for(service, runs, groups=2, size=4))
    # Short rows: the batch takes several of them, one gradient step each.
    job_id = _queued_job(service, runs, groups, packed_sequence_length=64)

    page = open_page(runs.key)
    goto(page, service, f"#/jobs/{job_id}")
    status = page.locator("#job-status")
    expect(status).to_be_visible()
    # Record what the page shows each time it changes, without reloading it.
    page.evaluate(
        """() => {
          window.__seen = [];
          const record = () => window.__seen.push({
            status: document.querySelector('#job-status')?.dataset.status,
            events: [...document.querySelectorAll('tr.event')].map(e => e.dataset.type),
          });
          record();
          new MutationObserver(record).observe(document.querySelector('main'),
            {childList: true, subtree: true});
        }"""
    )
    expect(status).to_have_attribute("data-status", "succeeded", timeout=WAIT_S * 1000)
    events = page.locator("tr.event").evaluate_all("rs => rs.map(r => r.dataset.type)")
    assert events[0] == "training_started" and events[-1] == "training_ended", events
    assert "gradient_step" in events
    seen = page.evaluate("window.__seen")
    assert seen[0]["status"] in ("queued", "running") and "training_ended" not in seen[0]["events"]
    # While the job ran, its first events were on the page already.
    assert any(s["status"] == "running" and s["events"] for s in seen), seen
    steps = events.count("gradient_step")
    expect(page.locator(".progress-row")).to_contain_text(f"{steps} of {steps} gradient steps")
    expect(page.locator('[data-chart="gradient-steps"]')).to_be_visible()
    screenshot(page, "job")

    expect(watcher.locator('[data-chart="loss/policy"] canvas')).to_be_visible()
    assert chart_data(watcher, "grad_norm")["data"][0] == [1]
    assert watcher.evaluate("window.__loaded") is True


def test_a_failed_jobs_message_is_shown_on_its_page_and_in_the_jobs_tab(
    service: Service, runs: Runs, open_page: Callable[..., Page]
) -> None:
    groups = run_async(_sample_for(service, runs, groups=1, size=2))
    # Rows of 16 tokens end inside the chat template's preamble: the trainer refuses the job.
    job_id = _queued_job(service, runs, groups, packed_sequence_length=16)

    page = open_page(runs.key)
    goto(page, service, f"#/jobs/{job_id}")
    expect(page.locator("#job-status")).to_have_attribute(
        "data-status", "failed", timeout=WAIT_S * 1000
    )
    expect(page.get_by_role("alert")).to_contain_text("every trained token lies beyond 16 tokens")
    expect(page.locator("tr.event").last).to_have_attribute("data-type", "training_failed")

    page.get_by_role("link", name="Jobs", exact=True).last.click()
    row = page.locator(f'tr[data-job-id="{job_id}"]')
    expect(row.locator(".badge")).to_have_text("failed")
    expect(row.locator(".job-error")).to_contain_text("every trained token lies beyond 16 tokens")


def test_a_models_replicas_and_its_scale_events_are_shown_with_their_reasons(
    service: Service, runs: Runs, open_page: Callable[..., Page]
) -> None:
    with service.http(TENANT) as http:
        raised = http.patch(f"/v1/models/{runs.run_id}", json={"max_replicas": 2})
        assert raised.status_code == 200, raised.text
        (home,) = raised.json()["replicas"]
    try:
        page = open_page(runs.key)
        goto(page, service, f"#/models/{runs.run_id}")
        summary = page.locator(".replicas-summary")
        expect(summary).to_have_text("1 serving (min 1, max 2)")
        summary.get_by_role("link").click()
        assert page.url.endswith(f"#/models/{runs.run_id}/replicas")

        row = page.locator("table.replicas tbody tr")
        expect(row).to_have_count(1)
        expect(row).to_have_attribute("data-worker-id", home["worker_id"])
        expect(row.locator("td").first).to_have_text("home")
        expect(row.locator(".badge")).to_have_text("serving")
        expect(row.locator("td.num")).to_have_text("0")  # its requests in flight
        expect(page.locator(".replica-demand")).to_contain_text("0 requests in flight")
        event = page.locator('table.scale-events tr[data-kind="replicas_set"]').first
        expect(event).to_contain_text("min_replicas=1, max_replicas=2")
    finally:
        with service.http(TENANT) as http:
            http.patch(f"/v1/models/{runs.run_id}", json={"max_replicas": 1})


def _queued_job(
    service: Service, runs: Runs, groups: list[Any], *, packed_sequence_length: int
) -> str:
    """A job of ``groups`` for the live model, in rows of ``packed_sequence_length`` tokens:
    its id."""
    config = {**JOB_CONFIG, "packed_sequence_length": packed_sequence_length}
    with service.http(TENANT) as http:
        job = http.post(
            "/v1/training-jobs",
            json={"model_id": runs.live_id, "trajectory_groups": groups, "config": config},
        )
    assert job.status_code == 201, job.text
    return str(job.json()["id"])


async def _sample_for(service: Service, runs: Runs, *, groups: int, size: int) -> list[Any]:
    """Groups sampled from live-run's endpoint, as the JSON a training job takes."""
    live = skytrain.Model(
        name="live-run",
        project=PROJECT,
        inference_base_url=f"{service.url}/v1",
        inference_api_key=runs.key,
        inference_model_name=runs.live_inference_name,
    )
    return [
        group.model_dump(mode="json")
        for group in await sample_groups(live, groups=groups, size=size)
    ]


# --- tenants ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_another_tenants_model_is_not_reachable_by_url(
    service: Service, runs: Runs, open_page: Callable[..., Page]
) -> None:
    page = open_page(service.key("intruder"), expected_errors=(r"status of 404",))
    for route in (
        f"#/models/{runs.run_id}",
        f"#/models/{runs.run_id}/trajectories",
        f"#/models/{runs.run_id}/checkpoints",
        f"#/compare?project={PROJECT}",
    ):
        goto(page, service, route)
        expect(page.get_by_role("alert")).to_be_visible()
        assert "reward-run" not in page.locator("main").inner_text(), route
    expect(page.get_by_role("alert")).to_contain_text(f"no models in project {PROJECT}")
    goto(page, service, f"#/models/{runs.run_id}")
    expect(page.get_by_role("alert")).to_contain_text(f"model '{runs.run_id}' not found")
    goto(page, service, "#/")
    expect(page.locator("main")).to_contain_text("No models yet")
    # Its quotas in use (GET /v1/usage), not the other tenant's.
    expect(page.locator("#usage")).to_have_text(
        "intruder: 0 of 100 models · 0 B of 100.00 GiB stored"
    )
