import pytest

from nla.train.config import ARTrainConfig, AVTrainConfig, load_config, save_config
from nla.util.overrides import parse_overrides


@pytest.mark.parametrize(
    "field,value",
    [
        ("lr", -1e-4),
        ("lr", 0),
        ("batch_size", 0),
        ("max_steps", -3),
        ("micro_batch_size", 64),  # > batch_size 32
        ("warmup_steps", 1000),  # > max_steps
        ("min_lr_ratio", 1.5),
        ("eval_fraction", 1.0),
        ("dtype", "fp8"),
        ("betas", (0.9, 1.2)),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"'{field}'"):
        ARTrainConfig(dataset="x.parquet", **{field: value})


def test_av_specific_validation():
    with pytest.raises(ValueError, match="'padding_side'"):
        AVTrainConfig(dataset="x.parquet", padding_side="middle")
    with pytest.raises(ValueError, match="'injection_scale'"):
        AVTrainConfig(dataset="x.parquet", injection_scale=-2.0)
    with pytest.raises(ValueError, match="'dataset'"):
        AVTrainConfig()
    assert AVTrainConfig(dataset="x", injection_scale="sqrt_d_model").injection_scale == "sqrt_d_model"


def test_yaml_overrides_roundtrip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("dataset: d.parquet\nlr: 1e-4\nbatch_size: 16\n")
    cfg = load_config(ARTrainConfig, p, ["batch_size=8", "betas=[0.9, 0.95]", "layer_index=2"])
    # YAML 1.1 reads '1e-4' as a string; the loader turns it into the number it means.
    assert cfg.lr == pytest.approx(1e-4)
    assert cfg.batch_size == 8 and cfg.betas == (0.9, 0.95) and cfg.layer_index == 2
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(ARTrainConfig, tmp_path / "resolved.yaml") == cfg
    with pytest.raises(ValueError, match="unknown config key.*'learning_rate'"):
        load_config(ARTrainConfig, p, ["learning_rate=1"])
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["lr"])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(ARTrainConfig, tmp_path / "nope.yaml")
