"""benchmarks: ``Suite.definition_hash`` — a golden value, agreement across processes, what it covers."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from benchmarks.registry import get_suite, list_suites
from benchmarks.suite import CameraSpec, TaskSpec

# Changing this value means metaworld-mt1-reach has a new definition, so a new leaderboard version:
# every earlier result on it drops off the default board. Update it only on purpose, and say so in
# the commit and in docs/benchmarks.md.
METAWORLD_MT1_REACH_HASH = "13d5ccbf533587c23b0c956b59af07836131f46ca3a5e806dbf49a9a3668cff0"


def test_golden_hash_of_metaworld_mt1_reach():
    assert get_suite("metaworld-mt1-reach").definition_hash() == METAWORLD_MT1_REACH_HASH


def test_two_processes_agree_on_every_suites_hash():
    script = ("from benchmarks.registry import get_suite, list_suites\n"
              "for name in list_suites(): print(name, get_suite(name).definition_hash())")
    # Different hash seeds: a hash that depended on set or dict iteration order of str keys would differ.
    outputs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    here = "".join(f"{name} {get_suite(name).definition_hash()}\n" for name in list_suites())
    assert outputs[0] == outputs[1] == here


def test_every_registered_suite_declares_a_seed_rule_and_has_its_own_hash():
    names = list_suites()
    assert all(get_suite(name).seed_rule for name in names), [n for n in names if not get_suite(n).seed_rule]
    hashes = {get_suite(name).definition_hash() for name in names}
    assert len(hashes) == len(names)


REACH = get_suite("metaworld-mt1-reach")
TASK = REACH.tasks[0]


@pytest.mark.parametrize("change", [
    {"name": "metaworld-mt1-reach-2"},
    {"simulator": "metaworld-4"},
    {"tasks": (dataclasses.replace(TASK, max_steps=TASK.max_steps - 1),)},
    {"tasks": (dataclasses.replace(TASK, instruction=TASK.instruction + "!"),)},
    {"tasks": (TASK, TaskSpec("push-v3", "push", 500))},
    {"action_low": (-0.5,) + REACH.action_low[1:]},
    {"action_high": REACH.action_high[:-1] + (0.5,)},
    {"fps": 40.0},
    {"state_names": REACH.state_names[:-1] + ("something_else",)},
    {"action_names": REACH.action_names[:-1] + ("grip",)},
    {"cameras": (dataclasses.replace(REACH.cameras[0], height=128),) + REACH.cameras[1:]},
    {"cameras": REACH.cameras + (CameraSpec("extra", 64, 64),)},
    {"seed_rule": REACH.seed_rule + " (changed)"},
], ids=lambda change: next(iter(change)))
def test_a_change_to_any_fact_of_the_definition_changes_the_hash(change):
    assert dataclasses.replace(REACH, **change).definition_hash() != METAWORLD_MT1_REACH_HASH


def test_prose_and_replay_choices_leave_the_hash_alone():
    cameras = tuple(dataclasses.replace(c, description="another description") for c in REACH.cameras)
    changed = dataclasses.replace(REACH, description="another description", cameras=cameras,
                                  overview_camera=REACH.cameras[-1].name)
    assert changed.definition_hash() == METAWORLD_MT1_REACH_HASH
