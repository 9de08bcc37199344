"""``MetaWorldReach``: EvalForge's ``metaworld-mt1-reach`` as a vla-eval ``StepBenchmark``.

vla-eval imports it from ``reach.yaml`` (``tests.policy_server.vla_eval_bench.reach:MetaWorldReach``,
the repository root on ``PYTHONPATH``). Each episode resets MetaWorld's reach task from the seed
``episode_idx`` and sends observations the way vla-eval's own benchmarks do: ``task_description`` (the suite's
instruction), ``state`` as float64 only when ``send_state`` is true (as LIBERO's adapter does: the
model server's hello asks for it through ``observation_params``, which vla-eval merges into the
constructor's parameters), and, for each camera in ``cameras``, an ``images`` entry that vla-eval's
client PNG-encodes.

Every action must be one float [4] row: anything else (a chunk, a wrong size, NaN) raises, which
vla-eval records as the episode's ``env_step`` failure. The metrics report success, the return and
the shape of the actions received.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vla_eval.benchmarks.base import StepBenchmark, StepResult
from vla_eval.specs import IMAGE_RGB, LANGUAGE, RAW, DimSpec

from benchmarks.registry import get_suite

SUITE = "metaworld-mt1-reach"


class MetaWorldReach(StepBenchmark):
    def __init__(self, cameras: dict[str, list[int]] | None = None, send_state: bool = False) -> None:
        super().__init__()
        self.send_state = send_state
        self.suite = get_suite(SUITE)
        self.cameras = {name: (int(size[0]), int(size[1])) for name, size in (cameras or {}).items()}
        self.env = self.suite.make_env(self.suite.task_names[0], seed=0)
        self.episode_return = 0.0
        self.action_shapes: set[tuple[int, ...]] = set()

    def get_tasks(self) -> list[dict[str, Any]]:
        return [{"name": task, "instruction": self.suite.instruction(task)} for task in self.suite.task_names]

    def reset(self, task: dict[str, Any]) -> Any:
        self.episode_return = 0.0
        self.action_shapes = set()
        return self.env.reset(seed=int(task["episode_idx"]))

    def step(self, action: dict[str, Any]) -> StepResult:
        actions = action["actions"]
        if not isinstance(actions, np.ndarray) or actions.shape != (self.suite.action_dim,):
            got = list(actions.shape) if isinstance(actions, np.ndarray) else type(actions).__name__
            raise ValueError(f"expected one action row of {self.suite.action_dim} floats, got {got}")
        self.action_shapes.add(actions.shape)
        result = self.env.step(actions)
        self.episode_return += result.reward
        return StepResult(obs=result.obs, reward=result.reward, done=result.done,
                          info={"success": result.success})

    def make_obs(self, raw_obs: Any, task: dict[str, Any]) -> dict[str, Any]:
        obs: dict[str, Any] = {"task_description": task["instruction"]}
        if self.send_state:
            obs["state"] = np.asarray(raw_obs["state"], dtype=np.float64)
        if self.cameras:
            obs["images"] = self.env.render_images(self.cameras)
        return obs

    def get_step_result(self, step_result: StepResult) -> dict[str, Any]:
        return {"success": bool(step_result.info.get("success", False)), "return": self.episode_return,
                "action_dim": sorted(self.action_shapes)[0][0] if self.action_shapes else 0}

    def get_metric_keys(self) -> dict[str, str]:
        return {"success": "mean", "return": "mean", "action_dim": "max"}

    def get_action_spec(self) -> dict[str, DimSpec]:
        return {"actions": RAW}

    def get_observation_spec(self) -> dict[str, DimSpec]:
        state = {"state": RAW} if self.send_state else {}
        return {**state, "language": LANGUAGE, **{name: IMAGE_RGB for name in self.cameras}}

    def get_metadata(self) -> dict[str, Any]:
        return {"max_steps": self.suite.max_steps(self.suite.task_names[0])}

    def cleanup(self) -> None:
        self.env.close()
