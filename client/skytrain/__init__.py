"""skytrain: train LLM agents with reinforcement learning on a self-hosted skytrain server.

import skytrain

backend = skytrain.Backend()  # $SKYTRAIN_BASE_URL, $SKYTRAIN_API_KEY
model = skytrain.TrainableModel(name="agent-1", project="2048", base_model="Qwen/Qwen2.5-3B")
await model.register(backend)
groups = await skytrain.gather_trajectory_groups(
    skytrain.TrajectoryGroup(rollout(model, scenario) for _ in range(8))
    for scenario in scenarios
)
result = await model.train(groups, config=skytrain.TrainConfig(learning_rate=1e-5))
"""

from skytrain._backend import Backend
from skytrain._exceptions import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AuthenticationError,
    ConfigurationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    NotRegisteredError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
    ServingFailedError,
    SkytrainError,
    TrainingFailedError,
    WaitTimeoutError,
)
from skytrain._gather import gather_trajectory_groups
from skytrain._model import Model, TrainableModel
from skytrain._trajectories import (
    History,
    Message,
    MessageOrChoice,
    Messages,
    MessagesAndChoices,
    Metrics,
    RolloutException,
    Tools,
    Trajectory,
    TrajectoryGroup,
)
from skytrain._types import Checkpoint, ModelConfig, SFTConfig, TrainConfig, TrainResult
from skytrain._version import __version__

__all__ = [
    "APIConnectionError",
    "APIError",
    "APITimeoutError",
    "AuthenticationError",
    "Backend",
    "Checkpoint",
    "ConfigurationError",
    "ConflictError",
    "History",
    "InvalidRequestError",
    "Message",
    "MessageOrChoice",
    "Messages",
    "MessagesAndChoices",
    "Metrics",
    "Model",
    "ModelConfig",
    "NotFoundError",
    "NotRegisteredError",
    "RateLimitError",
    "RolloutException",
    "SFTConfig",
    "ServerError",
    "ServiceUnavailableError",
    "ServingFailedError",
    "SkytrainError",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "TrainingFailedError",
    "Trajectory",
    "TrajectoryGroup",
    "WaitTimeoutError",
    "__version__",
    "gather_trajectory_groups",
]
