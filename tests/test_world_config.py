"""Issue 58: WorldConfig's bounds, refused with the field named before any build (``nla world build``)."""

from __future__ import annotations

import pytest
import yaml
from test_validation import assert_one_error_line, cli

from nla.world.build import MAX_VOCAB, MIN_SEQ_LEN, WorldConfig


@pytest.mark.parametrize("field, value, said", [
    ("name", "../../evil", "WorldConfig.name: expected letters, digits, '.', '_' or '-'"),
    ("name", "a/b", "found 'a/b'; the name becomes a cache directory"),
    ("name", "", "WorldConfig.name"),
    ("seq_len", 1, f"WorldConfig.seq_len: must be >= {MIN_SEQ_LEN}"),  # a ZeroDivisionError in pretraining
    ("vocab_size", 10**9, f"WorldConfig.vocab_size: must be <= {MAX_VOCAB}"),  # a Rust backtrace of the BPE trainer
])
def test_world_config_bounds(field, value, said):
    with pytest.raises(ValueError, match=None) as exc:
        WorldConfig(**{field: value})
    assert said in str(exc.value)


def test_world_build_refuses_them_through_the_cli(capsys, tmp_path):
    for field, value, said in (("name", "../../evil", "WorldConfig.name"), ("seq_len", 1, "WorldConfig.seq_len"),
                               ("vocab_size", 1e9, "vocab_size")):
        cfg = tmp_path / f"{field}.yaml"
        cfg.write_text(yaml.safe_dump({"name": "w", field: value}))
        code, lines = cli(capsys, "world", "build", "--config", cfg, "--out", tmp_path / "cache")
        assert code == 2, lines
        assert_one_error_line(lines, "world", said)
    assert not (tmp_path / "evil").exists() and not (tmp_path / "cache").exists()
    assert WorldConfig(name="tiny-2.b_x").name == "tiny-2.b_x"
