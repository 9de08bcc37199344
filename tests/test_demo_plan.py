"""scripts/demo.py's plan, without running it: `make demo` (no flag) keeps the state demo's commands,
and `--vision` plans the pixels pipeline consistently — the same camera and frame size in the
demonstrations, the recipe's overrides (which the trainer must accept) and the evaluation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.vla import VLAConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("evalforge_demo_script", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _option(command: list[str], name: str) -> str:
    assert command.count(name) == 1, (name, command)
    return command[command.index(name) + 1]


def _overrides(train_command: list[str]) -> list[str]:
    """The ``--section.key value`` pairs after ``trainer vla``'s own ``--config`` and ``--resume``."""
    rest = train_command[train_command.index("vla") + 1:]
    assert rest[:4] == ["--config", rest[1], "--resume", "auto"], rest
    return rest[4:]


def test_without_flag_the_state_demo_is_planned_as_before(demo, tmp_path):
    plan = demo.plan(demo.parse_args(["--root", str(tmp_path)]))
    assert plan.suite == "metaworld-mt1-reach" and plan.policy_name == "reach-bc-fast"
    assert plan.cameras is None and plan.caveat is None and plan.tags == ["demo"]
    assert plan.demos == tmp_path / "demos" / "reach-400" and plan.run_dir == tmp_path / "vla-reach-fast"
    assert plan.collect_command[1:] == ["-m", "trainer.cli", "collect-demos", "--suite", "metaworld-mt1-reach",
                                        "--episodes-per-task", "400", "--out", str(plan.demos)]
    assert plan.train_command[1:] == ["-m", "trainer.cli", "vla", "--config", str(REPO / "configs/vla-reach-fast.yaml"),
                                      "--resume", "auto", "--run_dir", str(plan.run_dir), "--data.path", str(plan.demos)]
    small = demo.plan(demo.parse_args(["--root", str(tmp_path), "--demos", "6", "--train-steps", "10"]))
    assert small.run_dir == tmp_path / "vla-reach-10steps"
    assert _overrides(small.train_command)[-4:] == ["--schedule.train_steps", "10", "--schedule.warmup_steps", "1"]


@pytest.mark.parametrize("size", [32, 48])
def test_vision_plan_uses_one_camera_and_size_throughout(demo, tmp_path, size):
    args = demo.parse_args(["--vision", "--root", str(tmp_path), "--image-size", str(size)])
    plan = demo.plan(args)
    assert plan.suite == "metaworld-mt1-reach-pixels" and plan.policy_name == "reach-pixels-demo"
    assert plan.caveat and "not expected to reach the goal" in plan.caveat
    collect = plan.collect_command
    assert _option(collect, "--suite") == plan.suite and _option(collect, "--cameras") == "corner"
    assert _option(collect, "--image-size") == str(size) and _option(collect, "--out") == str(plan.demos)
    assert _option(collect, "--episodes-per-task") == str(args.demos)

    assert _option(plan.train_command, "--config") == str(REPO / "configs/vla-reach-pixels.yaml")
    cfg = load_config(VLAConfig, REPO / "configs/vla-reach-pixels.yaml", _overrides(plan.train_command))
    assert cfg.data.path == str(plan.demos) and cfg.run_dir == str(plan.run_dir)
    assert cfg.data.suite == plan.suite and cfg.vision.camera_names == ["corner"]
    assert cfg.vision.image_size == size and cfg.vision.image_size // cfg.vision.patch_size == 4  # 16 rows
    assert cfg.schedule.train_steps == args.train_steps < 1500  # the recipe's full run is not the demo
    assert plan.cameras == {"corner": (size, size)}  # the evaluation renders what the policy was trained on
    assert "vision" in plan.tags


def test_vision_runs_of_other_sizes_do_not_reuse_each_other(demo, tmp_path):
    plans = [demo.plan(demo.parse_args(["--vision", "--root", str(tmp_path), *extra]))
             for extra in ([], ["--image-size", "48"], ["--demos", "10"], ["--train-steps", "20"])]
    assert len({p.run_dir for p in plans}) == len(plans)
    assert len({p.demos for p in plans}) == 3  # the step count does not change the demonstrations
    state = demo.plan(demo.parse_args(["--root", str(tmp_path)]))
    assert not {state.demos, state.run_dir} & {p for plan in plans for p in (plan.demos, plan.run_dir)}


@pytest.mark.parametrize("argv", [["--image-size", "32"], ["--vision", "--image-size", "30"],
                                  ["--vision", "--image-size", "12"]])
def test_bad_image_size_is_refused(demo, argv, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(argv)
    assert "--image-size" in capsys.readouterr().err
