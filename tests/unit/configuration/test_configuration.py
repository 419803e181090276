import json
import logging

import pytest

from optimum_gaudi import GaudiConfig, GaudiConfigError
from optimum_gaudi.configuration.gaudi_config import GAUDI_CONFIG_NAME, bundled_config_names, bundled_configs_dir

REQUIRED_BUNDLED = [
    "gpt2",
    "gpt-neox",
    "pythia",
    "llama",
    "mistral",
    "bert-base-uncased",
    "bert-large-uncased",
    "roberta-base",
    "distilbert",
    "t5",
    "bart",
    "vit",
    "wav2vec2",
]


def write(tmp_path, data, name="gaudi_config.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("name", REQUIRED_BUNDLED)
def test_every_required_bundled_config_loads_by_name_and_habana_name(name):
    plain = GaudiConfig.from_pretrained(name)
    assert GaudiConfig.from_pretrained(f"Habana/{name}") == plain
    assert plain.use_fused_adam and plain.use_fused_clip_norm


def test_every_file_in_gaudi_configs_loads():
    files = sorted(bundled_configs_dir().glob("*.json"))
    assert len(files) >= 12
    for f in files:
        assert isinstance(GaudiConfig.from_pretrained(f.stem), GaudiConfig)
    assert set(REQUIRED_BUNDLED) <= set(bundled_config_names())


def test_gpt2_bundled_config_has_op_lists():
    config = GaudiConfig.from_pretrained("Habana/gpt2")
    assert config.use_torch_autocast
    assert "linear" in config.autocast_bf16_ops
    assert "softmax" in config.autocast_fp32_ops


def test_load_from_file_and_directory(tmp_path):
    path = write(tmp_path, {"use_fused_adam": True})
    assert GaudiConfig.from_pretrained(path).use_fused_adam
    assert GaudiConfig.from_pretrained(tmp_path).use_fused_adam
    assert GaudiConfig.from_pretrained(str(path)).use_fused_clip_norm is False


def test_save_and_reload_roundtrip(tmp_path):
    config = GaudiConfig(use_fused_adam=True, use_torch_autocast=True, autocast_bf16_ops=["linear"])
    saved = config.save_pretrained(tmp_path / "out")
    assert saved.name == GAUDI_CONFIG_NAME
    assert GaudiConfig.from_pretrained(tmp_path / "out") == config
    assert json.loads(config.to_json_string()) == config.to_dict()
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_op_list_from_text_file_relative_to_config(tmp_path):
    (tmp_path / "bf16.txt").write_text("# ops in bf16\nlinear\n\nmatmul  # inline comment\n")
    path = write(tmp_path, {"use_torch_autocast": True, "autocast_bf16_ops": "bf16.txt"})
    assert GaudiConfig.from_pretrained(path).autocast_bf16_ops == ["linear", "matmul"]


def test_missing_op_list_file_is_an_error(tmp_path):
    path = write(tmp_path, {"autocast_fp32_ops": "nope.txt"})
    with pytest.raises(GaudiConfigError, match="autocast_fp32_ops.*nope.txt.*does not exist"):
        GaudiConfig.from_pretrained(path)


def test_legacy_keys_map_with_one_warning(tmp_path, caplog):
    legacy = {
        "use_habana_mixed_precision": True,
        "hmp_bf16_ops": ["linear"],
        "hmp_fp32_ops": ["softmax"],
        "hmp_is_verbose": False,
        "hmp_opt_level": "O1",
        "optimum_version": "1.5.0",
        "transformers_version": "4.30.0",
    }
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        config = GaudiConfig.from_pretrained(write(tmp_path, legacy))
    assert config.use_torch_autocast
    assert config.autocast_bf16_ops == ["linear"]
    assert config.autocast_fp32_ops == ["softmax"]
    deprecations = [r for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(deprecations) == 1
    assert "hmp_opt_level" in deprecations[0].getMessage()


def test_unknown_key_names_the_closest_valid_key(tmp_path):
    with pytest.raises(GaudiConfigError, match="Unknown key 'use_fused_adma'.*Did you mean 'use_fused_adam'"):
        GaudiConfig.from_pretrained(write(tmp_path, {"use_fused_adma": True}))


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    with pytest.raises(GaudiConfigError, match="Unknown key 'zzz'.*Valid keys: use_fused_adam"):
        GaudiConfig.from_pretrained(write(tmp_path, {"zzz": 1}))


@pytest.mark.parametrize(
    "data, match",
    [
        ({"use_fused_adam": "yes"}, "'use_fused_adam' must be true or false.*'yes'"),
        ({"use_dynamic_shapes": 1}, "'use_dynamic_shapes' must be true or false"),
        ({"autocast_bf16_ops": [1, 2]}, "'autocast_bf16_ops' must be a list of operator names"),
        ({"autocast_fp32_ops": {"a": 1}}, "'autocast_fp32_ops' must be a list"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_wrong_types_name_the_key_and_expected_type(tmp_path, data, match):
    with pytest.raises(GaudiConfigError, match=match):
        GaudiConfig.from_pretrained(write(tmp_path, data))


def test_wrong_type_in_constructor():
    with pytest.raises(GaudiConfigError, match="use_fused_clip_norm"):
        GaudiConfig(use_fused_clip_norm="true")


def test_malformed_json_names_file_and_line(tmp_path):
    path = write(tmp_path, '{\n  "use_fused_adam": true,\n  "use_fused_clip_norm": tru\n}\n')
    with pytest.raises(GaudiConfigError, match=rf"Malformed JSON in {path}, line 3"):
        GaudiConfig.from_pretrained(path)


def test_directory_without_config(tmp_path):
    with pytest.raises(GaudiConfigError, match="has no gaudi_config.json"):
        GaudiConfig.from_pretrained(tmp_path)


def test_missing_json_path_is_a_clear_error(tmp_path):
    with pytest.raises(GaudiConfigError, match="does not exist.*bundled names: .*gpt2"):
        GaudiConfig.from_pretrained(str(tmp_path / "missing.json"))


def test_unknown_hub_name_offline_fails_fast_listing_bundled_names(monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(GaudiConfigError, match="HF_HUB_OFFLINE.*bundled names: .*gpt2.*llama"):
        GaudiConfig.from_pretrained("someone/not-bundled")
    assert time.monotonic() - start < 5


def test_unreachable_hub_fails_fast(monkeypatch):
    from optimum_gaudi.configuration import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_endpoint_reachable", lambda: False)
    with pytest.raises(GaudiConfigError, match="cannot be reached"):
        GaudiConfig.from_pretrained("someone/not-bundled")


def test_op_list_files_live_in_a_directory_only_this_user_can_write(tmp_path, monkeypatch):
    """Another user could pre-create a shared directory and choose what this user's runs autocast."""
    import stat
    from pathlib import Path

    from optimum_gaudi.errors import UserError
    from optimum_gaudi.precision.op_lists import op_list_dir, op_list_environment

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    env = op_list_environment(["linear"], ["softmax"])
    directory = op_list_dir()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert all(Path(p).parent == directory for p in env.values())
    bf16_file = Path(next(iter(env.values())))
    bf16_file.write_text("softmax\n")  # tampered with: the file is trusted by content, not by name
    assert Path(op_list_environment(["linear"], ["softmax"])[next(iter(env))]).read_text() == "linear\n"
    directory.chmod(0o777)
    with pytest.raises(UserError, match="not a directory only you can write"):
        op_list_environment(["linear"], ["softmax"])
    directory.chmod(0o700)
