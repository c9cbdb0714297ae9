"""Issue 58: YAML readers with a size bound. An alias bomb in a list field (``lora.target_modules``)
gave a 58 MB error line, and one level deeper ran past a minute; now the document is refused on its
expansion before anything walks it, through every reader (configs, sidecars, --set)."""

from __future__ import annotations

import time

import pytest
from test_validation import assert_one_error_line, cli

from nla.util.validation import MAX_YAML_BYTES, MAX_YAML_VALUES, InputError, load_yaml, safe_load_unique


def bomb(levels: int, width: int = 10) -> str:
    lines = ['a0: &a0 ["q_proj"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join(f'*a{i - 1}' for _ in range(width))}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_on_its_expansion(tmp_path):
    # 10**5 leaves expand past the cap of 100,000 values; 10**4 do not
    assert MAX_YAML_VALUES == 100_000
    safe_load_unique(bomb(4))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"the document expands to more than 100,000 values \(YAML aliases"):
        safe_load_unique(bomb(9))  # 10**8 values if walked
    assert time.perf_counter() - t0 < 5
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(bomb(7) + "lora:\n  target_modules: *a6\n")
    with pytest.raises(InputError, match=r"rl.yaml: the rl config is refused: the document expands to more than "):
        load_yaml(cfg, "rl config")


def test_a_file_over_the_cap_is_not_read(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("x: " + "a" * (MAX_YAML_BYTES + 10) + "\n")
    with pytest.raises(InputError, match=r"big.yaml: the config is 4,194,318 bytes; the cap is 4,194,304"):
        load_yaml(big)


def test_the_cli_refuses_a_bomb_with_one_short_line(capsys, tmp_path):
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(bomb(8) + "av: a\nar: b\ndataset: c\nlora:\n  target_modules: *a7\n")
    t0 = time.perf_counter()
    code, lines = cli(capsys, "rl", "--config", cfg, "--out", tmp_path / "o")
    assert code == 2 and time.perf_counter() - t0 < 20
    line = assert_one_error_line(lines, "rl", "expands to more than 100,000 values")
    assert len(line) < 600
    code, lines = cli(capsys, "rl", "--config", tmp_path / "none.yaml", "--set", "lora.target_modules=" + bomb(8))
    assert code == 2 and all(len(ln) < 2000 for ln in lines)


def test_an_error_quotes_at_most_a_short_value():
    from nla.train.config import LoRAConfig
    from nla.util.configcheck import check_config_types

    with pytest.raises(ValueError) as exc:
        check_config_types(LoRAConfig, {"target_modules": [[["x"] * 1000] * 100] * 100})
    message = str(exc.value)
    assert "LoRAConfig.target_modules" in message and "['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', ...]" in message
    assert len(message) < 1500
