"""GaudiConfig: the JSON file that switches Gaudi performance features on for a model.

People keep one next to each model (``gaudi_config.json``), so it must load from a file, a directory, a
bundled name or the Hub, keep reading configs written for older releases, and refuse a typo loudly:
a misspelt key that silently disabled fused AdamW would cost days of compute before anyone noticed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import UserError
from .hub import HubUnavailableError, require_hub

logger = logging.getLogger(__name__)

GAUDI_CONFIG_NAME = "gaudi_config.json"

# Keys of configs written for Habana's mixed-precision (HMP) package, mapped onto today's autocast fields.
_LEGACY_KEYS = {
    "use_habana_mixed_precision": "use_torch_autocast",
    "hmp_bf16_ops": "autocast_bf16_ops",
    "hmp_fp32_ops": "autocast_fp32_ops",
    "hmp_is_verbose": None,  # no equivalent: autocast is not verbose
    "hmp_opt_level": None,  # no equivalent: torch autocast has a single level
}

# Short names people use for a bundled config that is stored under a longer name.
_ALIASES = {
    "pythia": "gpt-neox",
    "bert-large-uncased": "bert-large-uncased-whole-word-masking",
    "distilbert": "distilbert-base-uncased",
}


class GaudiConfigError(UserError, ValueError):
    """A Gaudi config that cannot be loaded as written; the message says what to change."""


def bundled_configs_dir() -> Path:
    """Where the bundled configs live: ``gaudi_configs/`` of a source checkout, or the installed copy."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package.parent / "gaudi_configs", package / "gaudi_configs"):
        if candidate.is_dir():
            return candidate
    return package / "gaudi_configs"


def bundled_config_names() -> list[str]:
    """Names that ``GaudiConfig.from_pretrained`` resolves without the Hub (aliases included)."""
    names = {p.stem for p in bundled_configs_dir().glob("*.json")}
    names |= {alias for alias, target in _ALIASES.items() if target in names}
    return sorted(names)


def _bundled_path(name: str) -> Path | None:
    short = name.split("/", 1)[1] if name.lower().startswith("habana/") else name
    short = _ALIASES.get(short.lower(), short.lower())
    path = bundled_configs_dir() / f"{short}.json"
    return path if path.is_file() else None


@dataclasses.dataclass
class GaudiConfig:
    """Gaudi performance switches for one model.

    Op lists are lists of operator names, or a path to a text file with one name per line
    (blank lines and ``#`` comments ignored), resolved when the config is built.
    """

    use_fused_adam: bool = False
    use_fused_clip_norm: bool = False
    use_torch_autocast: bool = False
    autocast_bf16_ops: list[str] | None = None
    autocast_fp32_ops: list[str] | None = None
    use_dynamic_shapes: bool = False
    # Llama-family kernels where the device has them (a Gaudi: hpex FusedRMSNorm, the rotary helpers); elsewhere
    # nothing is swapped (features/kernels.py)
    use_fused_rms_norm: bool = False
    use_fused_rope: bool = False
    # a causal LM's training loss computed in chunks, never holding the full logits (features/linear_cross_entropy.py)
    use_fused_linear_cross_entropy: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_ops"):
                setattr(self, f.name, _op_list(f.name, value, base_dir=None))
            elif not isinstance(value, bool):
                raise GaudiConfigError(
                    f"Gaudi config key '{f.name}' must be true or false (a JSON boolean), got {value!r} "
                    f"({type(value).__name__})."
                )
        both = sorted(set(self.autocast_bf16_ops or ()) & set(self.autocast_fp32_ops or ()))
        if both:
            raise GaudiConfigError(
                f"Ops {both} are in both autocast_bf16_ops and autocast_fp32_ops; keep each in one list."
            )

    # ---- loading -------------------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls, config: dict[str, Any], source: str = "Gaudi config", base_dir: str | None = None
    ) -> GaudiConfig:
        """Build from a dict, translating legacy keys and rejecting unknown ones."""
        if not isinstance(config, dict):
            raise GaudiConfigError(f"{source} must hold a JSON object, got {type(config).__name__}.")
        valid = [f.name for f in dataclasses.fields(cls)]
        kwargs: dict[str, Any] = {}
        legacy_used = []
        for key, value in config.items():
            if key.endswith("_version"):
                continue  # metadata written by other tools, e.g. optimum_version
            if key in _LEGACY_KEYS:
                legacy_used.append(key)
                if _LEGACY_KEYS[key] is not None:
                    kwargs.setdefault(_LEGACY_KEYS[key], value)
                continue
            if key not in valid:
                close = difflib.get_close_matches(key, valid + list(_LEGACY_KEYS), n=1, cutoff=0.5)
                hint = f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(valid)}."
                raise GaudiConfigError(f"Unknown key '{key}' in {source}.{hint}")
            kwargs[key] = value
        if legacy_used:
            logger.warning(
                "%s uses deprecated mixed-precision keys (%s); they were mapped to use_torch_autocast / "
                "autocast_bf16_ops / autocast_fp32_ops. Re-save the config to update it.",
                source,
                ", ".join(legacy_used),
            )
        for key in ("autocast_bf16_ops", "autocast_fp32_ops"):
            if key in kwargs:
                kwargs[key] = _op_list(key, kwargs[key], base_dir=base_dir)
        return cls(**kwargs)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> GaudiConfig:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise GaudiConfigError(f"Cannot read Gaudi config {path}: {e.strerror}.") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise GaudiConfigError(f"Malformed JSON in {path}, line {e.lineno} column {e.colno}: {e.msg}.") from None
        return cls.from_dict(data, source=str(path), base_dir=str(path.parent))

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **hub_kwargs: Any) -> GaudiConfig:
        """Load from a JSON file, a directory holding gaudi_config.json, a bundled name, or a Hub repo."""
        path = Path(name_or_path)
        if path.is_file():
            return cls.from_json_file(path)
        if path.is_dir():
            if not (path / GAUDI_CONFIG_NAME).is_file():
                raise GaudiConfigError(
                    f"Directory {path} has no {GAUDI_CONFIG_NAME}; pass the JSON file itself or a bundled name."
                )
            return cls.from_json_file(path / GAUDI_CONFIG_NAME)
        name = str(name_or_path)
        bundled = _bundled_path(name)
        if bundled is not None:
            return cls.from_json_file(bundled)
        hint = f"Use a local JSON file, a directory, or one of the bundled names: {', '.join(bundled_config_names())}."
        looks_like_path = name.endswith(".json") or name.startswith((".", "/", "~")) or name.count("/") > 1
        if looks_like_path:
            raise GaudiConfigError(f"Gaudi config file {name} does not exist. {hint}")
        try:
            require_hub(f"Gaudi config '{name}'", hint)
        except HubUnavailableError as e:
            raise GaudiConfigError(str(e)) from None
        from huggingface_hub import hf_hub_download

        try:
            downloaded = hf_hub_download(name, GAUDI_CONFIG_NAME, **hub_kwargs)
        except Exception as e:  # the Hub client raises many types; all mean "not there for you"
            raise GaudiConfigError(
                f"Could not fetch {GAUDI_CONFIG_NAME} of '{name}' from the Hub ({type(e).__name__}). {hint}"
            ) from None
        return cls.from_json_file(downloaded)

    # ---- saving --------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> Path:
        """Write the config to ``json_file_path`` (optimum-habana's name for a save to one file)."""
        path = Path(json_file_path)
        path.write_text(self.to_json_string(), encoding="utf-8")
        return path

    # ---- optimum-habana's ways to hand the op lists to the Gaudi bridge -------------------------------------

    def write_bf16_fp32_ops_to_text_files(
        self, path_to_bf16_file: str | os.PathLike, path_to_fp32_file: str | os.PathLike
    ) -> None:
        """Write the bf16 and fp32 op lists, one op per line, as the bridge reads them. A list left out of the
        config is written as the list it means (Habana's default, as on every device here)."""
        from ..precision.op_lists import resolve_op_lists

        bf16, fp32 = resolve_op_lists(self.autocast_bf16_ops, self.autocast_fp32_ops)
        for path, ops in ((path_to_bf16_file, bf16), (path_to_fp32_file, fp32)):
            Path(path).write_text("".join(f"{op}\n" for op in ops), encoding="utf-8")

    def declare_autocast_bf16_fp32_ops(self) -> dict[str, str]:
        """Point the bridge's two op-list variables (``PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST``,
        ``PT_HPU_AUTOCAST_FP32_OPS_LIST``) at files holding this config's lists, as optimum-habana does; return
        what was set. GaudiTrainingArguments does this itself; a script calls it only to set the lists by hand.
        The bridge reads them once, when it loads: after that it is an error, as in optimum-habana."""
        from ..precision.op_lists import op_list_environment, resolve_op_lists

        if "habana_frameworks.torch.core" in sys.modules:  # a look at what is loaded; nothing is imported here
            raise GaudiConfigError(
                "declare_autocast_bf16_fp32_ops: habana_frameworks is already loaded and has read its op lists; "
                "build the Gaudi config and the training arguments first, or start Python with PT_HPU_AUTOLOAD=0."
            )
        environment = op_list_environment(*resolve_op_lists(self.autocast_bf16_ops, self.autocast_fp32_ops))
        os.environ.update(environment)
        return environment

    def push_to_hub(
        self,
        repo_id: str,
        commit_message: str = "Upload gaudi_config.json",
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
    ) -> str:
        """Upload ``gaudi_config.json`` to the Hub repository ``repo_id`` (created if needed); return the
        commit's URL. Offline, one line says so."""
        hint = "Save it with save_pretrained(DIR) and upload DIR/gaudi_config.json when online."
        try:
            require_hub(f"push_to_hub('{repo_id}')", hint)
        except HubUnavailableError as e:
            raise GaudiConfigError(str(e)) from None
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_file(
            path_or_fileobj=self.to_json_string().encode("utf-8"),
            path_in_repo=GAUDI_CONFIG_NAME,
            repo_id=repo_id,
            commit_message=commit_message,
            revision=revision,
        )
        return str(getattr(info, "commit_url", info))

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write gaudi_config.json into `save_directory` (created if needed) atomically; return its path."""
        directory = Path(save_directory)
        if directory.exists() and not directory.is_dir():
            raise GaudiConfigError(f"Cannot save the Gaudi config: {directory} is a file, not a directory.")
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / GAUDI_CONFIG_NAME
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(self.to_json_string(), encoding="utf-8")
        os.replace(tmp, target)
        return target


def _op_list(key: str, value: Any, base_dir: str | None) -> list[str] | None:
    """Normalise an op list given inline or as a path to a one-op-per-line text file."""
    if value is None:
        return None
    if isinstance(value, str):
        path = Path(value)
        if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).is_file():
            path = Path(base_dir) / path
        if not path.is_file():
            raise GaudiConfigError(f"Gaudi config key '{key}' names op-list file {value}, which does not exist.")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = "is not a UTF-8 text file" if isinstance(e, UnicodeDecodeError) else f"cannot be read ({e})"
            raise GaudiConfigError(
                f"Gaudi config key '{key}' names op-list file {path}, which {reason}; give a text file "
                "with one op name per line."
            ) from None
        if "\0" in text:
            raise GaudiConfigError(
                f"Gaudi config key '{key}' names op-list file {path}, which is binary; give a text file "
                "with one op name per line."
            )
        lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
        return [line for line in lines if line]
    if isinstance(value, (list, tuple)) and all(isinstance(op, str) and op.strip() for op in value):
        return [op.strip() for op in value]
    raise GaudiConfigError(
        f"Gaudi config key '{key}' must be a list of operator names or a path to a text file, got {value!r}."
    )
