"""RLConfig: sections, YAML one to one, and refusals that name the field, the expected and the found value."""

from pathlib import Path

import pytest
import yaml

from nla.rl.config import BACKENDS, SECTIONS, LossConfig, RLConfig, load_rl_config, save_rl_config
from nla.rl.roles import OptimSettings, PolicyLossSettings

PATHS = dict(av="av_dir", ar="ar_dir", dataset="rl.parquet")
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "rl"


def cfg_of(**data) -> RLConfig:
    return RLConfig.from_dict({**PATHS, **data})


def test_dynamic_sampling_needs_groups_of_two_or_more():
    # A group of one sample has zero reward spread, so dynamic sampling would drop every
    # group and never update: refused up front, for any estimator.
    with pytest.raises(ValueError, match=r"rollout.n_samples_per_prompt: expected >= 2 with dynamic_sampling: "
                                         r"true.*found 1"):
        cfg_of(loss=dict(advantage="reinforce_baseline"), rollout=dict(n_samples_per_prompt=1, dynamic_sampling=True))
    cfg_of(loss=dict(advantage="reinforce_baseline"), rollout=dict(n_samples_per_prompt=1))  # without it: fine
    cfg_of(rollout=dict(n_samples_per_prompt=2, dynamic_sampling=True))
    # the group estimators say so themselves (registry), whatever dynamic sampling does
    with pytest.raises(ValueError, match=r"rollout.n_samples_per_prompt: expected >= 2 for the group baseline of "
                                         r"loss.advantage 'drgrpo', found 1"):
        cfg_of(loss=dict(advantage="drgrpo"), rollout=dict(n_samples_per_prompt=1))


def test_drgrpo_normaliser_is_the_generation_cap():
    cfg = cfg_of(loss=dict(loss_agg="seq-mean-token-sum-norm"), rollout=dict(max_response_len=37))
    assert PolicyLossSettings.from_config(cfg).norm_len == 37


def test_backend_names_come_from_one_registry():
    from nla.rl.backend import BACKEND_BUILDERS

    assert set(BACKEND_BUILDERS) == set(BACKENDS)
    with pytest.raises(ValueError, match=r"backend.name: expected one of \['local', 'ray'\], found 'slurm'"):
        cfg_of(backend=dict(name="slurm"))


def test_backend_sharding_is_fsdp_or_replicate():
    from nla.rl.distributed import RankGroup, Replicas, rank_group

    assert cfg_of().backend.sharding == "fsdp"
    assert cfg_of(backend=dict(name="ray", sharding="replicate")).backend.sharding == "replicate"
    with pytest.raises(ValueError, match=r"backend.sharding: expected one of \['fsdp', 'replicate'\], found 'ddp'"):
        cfg_of(backend=dict(name="ray", sharding="ddp"))
    # the group each name builds: FSDP averages gradients (losses x W), replicas sum them (x 1)
    fsdp, whole = rank_group("fsdp", 1, 2), rank_group("replicate", 1, 2)
    assert type(fsdp) is RankGroup and isinstance(whole, Replicas)
    assert (fsdp.grad_scale, whole.grad_scale) == (2.0, 1.0)
    assert fsdp.optim_format == whole.optim_format == "full_fqn"  # resumable under either
    with pytest.raises(ValueError, match=r"backend.sharding: expected one of \['fsdp', 'replicate'\], found 'ddp'"):
        rank_group("ddp", 0, 2)


def test_yaml_round_trip_is_one_to_one(tmp_path):
    # Every section is a mapping in the file; save -> load gives the same frozen object.
    cfg = cfg_of(steps=7, rollout=dict(rollout_batch_size=3, n_samples_per_prompt=2), loss=dict(kl_coef=0.05),
                 reconstructor=dict(lr=2e-4), backend=dict(name="ray", num_policy_workers=2))
    path = tmp_path / "rl.yaml"
    save_rl_config(cfg, path)
    raw = yaml.safe_load(path.read_text())
    assert set(SECTIONS) <= set(raw) and raw["loss"]["kl_coef"] == 0.05 and raw["backend"]["name"] == "ray"
    assert load_rl_config(path) == cfg
    assert cfg.samples_per_step == 6 and cfg.ar_lr_value == 2e-4
    assert cfg_of().ar_lr_value == cfg_of().optimiser.lr  # null reconstructor.lr = parity with the AV


def test_overrides_are_dotted_and_merge_into_sections(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump({**PATHS, "loss": {"kl_coef": 0.05, "eps_high": 0.28}}))
    cfg = load_rl_config(path, ["loss.kl_coef=0.02", "steps=3", "optimiser.lr=1e-4"])
    assert (cfg.loss.kl_coef, cfg.loss.eps_high, cfg.steps) == (0.02, 0.28, 3)
    assert cfg.optimiser.lr == 1e-4 and isinstance(cfg.optimiser.lr, float)  # YAML 1.1 reads "1e-4" as a string
    # replace: a section mapping changes only the keys it names
    again = cfg.replace(loss=dict(kl_coef=0.5))
    assert (again.loss.kl_coef, again.loss.eps_high) == (0.5, 0.28)
    assert cfg.loss.kl_coef == 0.02  # frozen: the original is untouched


def test_refusals_name_the_key_and_where_it_belongs():
    # a flat key of the old layout says which section it moved to
    with pytest.raises(ValueError, match=r"key 'kl_coef' belongs to section 'loss'; write it as `loss: \{kl_coef: "
                                         r"\.\.\.\}` in YAML, or --set loss.kl_coef=\.\.\."):
        cfg_of(kl_coef=0.1)
    # renamed keys point at their new name; the AV's flat `lr` is the optimiser's, not the AR's
    with pytest.raises(ValueError, match=r"key 'lr' belongs to section 'optimiser'.*--set optimiser.lr=\.\.\."):
        cfg_of(lr=1e-4)
    with pytest.raises(ValueError, match=r"key 'ar_lr' is now reconstructor.lr; .*--set reconstructor.lr=\.\.\."):
        cfg_of(ar_lr=1e-4)
    with pytest.raises(ValueError, match=r"RLConfig.backend is a section; write `backend: \{name: ray\}`"):
        cfg_of(backend="ray")
    with pytest.raises(ValueError, match=r"'scale_by_std' is gone; .*loss.advantage=drgrpo"):
        cfg_of(scale_by_std=False)
    with pytest.raises(ValueError, match=r"RLConfig.loss: unknown config key\(s\) \['kl_cof'\]; valid keys: .*kl_coef"):
        cfg_of(loss=dict(kl_cof=0.1))
    with pytest.raises(ValueError, match=r"unknown section 'losses' in 'losses.kl_coef'"):
        cfg_of(**{"losses.kl_coef": 0.1})
    with pytest.raises(ValueError, match=r"RLConfig.rollout: expected a mapping of RolloutConfig keys, found 8"):
        cfg_of(rollout=8)
    with pytest.raises(ValueError, match=r"RLConfig.loss: expected a LossConfig \(a mapping in YAML\)"):
        RLConfig(**PATHS, loss={"kl_coef": 0.1})
    # cross-section checks name both ends
    with pytest.raises(ValueError, match=r"reward.overlong_buffer_len: expected an integer in \[0, "
                                         r"rollout.max_response_len=10\), found 10"):
        cfg_of(rollout=dict(max_response_len=10), reward=dict(overlong_buffer_len=10))
    with pytest.raises(ValueError, match=r"optimiser.warmup_steps: expected an integer in \[0, steps=5\], found 6"):
        cfg_of(steps=5, optimiser=dict(warmup_steps=6))
    with pytest.raises(ValueError, match=r"optimiser.global_batch_size: expected a positive divisor of .* = 64, "
                                         r"found 48"):
        cfg_of(optimiser=dict(global_batch_size=48, allow_multiple_updates=True))
    # each section validates itself, wherever it is built
    with pytest.raises(ValueError, match=r"RLConfig.loss.dual_clip_c: expected a number > 1 or null, found 0.5"):
        LossConfig(dual_clip_c=0.5)


def test_every_config_file_loads():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert files
    for path in files:
        cfg = load_rl_config(path)
        assert OptimSettings.for_reconstructor(cfg).lr == cfg.ar_lr_value, path


def test_quickstart_presets_build_valid_rl_configs():
    from pathlib import Path

    from nla.quickstart import PRESETS, rl_settings

    for name, preset in PRESETS.items():
        cfg = RLConfig.from_dict({**PATHS, **rl_settings(preset, Path("run/datagen")), "backend": {"name": "ray"}})
        assert cfg.updates_per_rollout == 1 and cfg.backend.name == "ray", name
        # every preset replays its own AR warm-start split
        assert cfg.reconstructor.replay_dataset == str(Path("run/datagen") / "ar_sft.parquet"), name
        assert cfg.loss.kl_coef == 0.05 and cfg.reward.format_penalty == 1.0, name


def test_quickstart_presets_default_and_full_differ_only_in_the_data_explainer():
    import dataclasses

    from nla.cli import build_parser
    from nla.datagen.config import DatagenConfig
    from nla.quickstart import PRESETS

    default, full = PRESETS["default"], PRESETS["full"]
    assert dataclasses.replace(full, datagen=default.datagen) == default
    explainers = {}
    for name in ("default", "full"):
        dg = DatagenConfig.from_dict(dict(out_dir="x", source="world", world_preset="default", explainer="world",
                                          **PRESETS[name].datagen))
        w = dg.world_explainer
        explainers[name] = (w.fact_rate, w.min_facts, w.max_facts, w.wrong_rate, w.fact_min_prob, w.fact_unheld,
                            w.fact_gate_below)
    # default: every true fact named (fact_rate 1.0; the count fields unused); a kind held on < half its rows
    # firm where a probe ranks it first, else unsure; full: 3-6 facts, every one firm
    assert explainers == {"default": (1.0, 3, 6, 0.1, 0.0, "hedge", 0.5), "full": (None, 3, 6, 0.1, None, "omit", None)}
    assert default.rl["steps"] == 100
    parser = build_parser()
    assert parser.parse_args(["quickstart", "--preset", "full"]).preset == "full"
    with pytest.raises(SystemExit):
        parser.parse_args(["quickstart", "--preset", "terse"])
