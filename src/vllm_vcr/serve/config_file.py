"""`vllm serve --config file.yaml`: the file's keys become flags, as vLLM's FlexibleArgumentParser does.

Each `key: value` turns into `--key value` and is placed right after `serve` (and after MODEL when
the command line has one), so flags on the command line, parsed later, win. `true` gives `--key`,
`false` gives `--no-key` when the flag has that form (else nothing), a list gives `--key a b`, a
mapping gives `--key '<json>'`. A key that is not a flag is therefore an "unrecognized arguments"
error, as in vLLM.
"""

from __future__ import annotations

import json
from typing import Any


class ConfigFileError(ValueError):
    """The config file is missing, not YAML, or not a mapping."""


def config_file_args(path: str, has_flag: Any) -> list[str]:
    """The flags a config file stands for; `has_flag(name)` says whether the parser knows a flag."""
    ext = path.rsplit(".", 1)[-1]
    if ext not in ("yaml", "yml"):
        raise ConfigFileError(f"Config file must be of a yaml/yml type. {ext} supplied")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ConfigFileError(f"Unable to read the config file at {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"Unable to parse the config file at {path}: {e}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ConfigFileError(f"The config file at {path} must be a mapping of flag names to values")
    return mapping_args(config, has_flag)


def mapping_args(config: dict, has_flag: Any) -> list[str]:
    """The flags a mapping of `key: value` stands for (the rules above)."""
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key)
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif has_flag("--no-" + str(key)):
                out.append("--no-" + str(key))
        elif isinstance(value, list):
            if value:
                out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def expand_config_file(argv: list[str], has_flag: Any) -> list[str]:
    """`serve [MODEL] ... --config F ...` with F's flags spliced in (cli > config file > defaults)."""
    if not argv or argv[0] != "serve":
        return argv
    joined = [a for a in argv if a == "--config" or a.startswith("--config=")]
    if not joined:
        return argv
    if len(joined) > 1:
        raise ConfigFileError("More than one config file specified!")
    index = next(i for i, a in enumerate(argv) if a in joined)
    if argv[index] == "--config":
        if index == len(argv) - 1:
            raise ConfigFileError("No config file specified! Please check your command-line arguments.")
        path, rest = argv[index + 1], argv[index + 2:]
    else:
        path, rest = argv[index].split("=", 1)[1], argv[index + 1:]
    extra = config_file_args(path, has_flag)
    before = argv[1:index]
    if before and not before[0].startswith("-"):  # MODEL on the command line stays first
        return ["serve", before[0], *extra, *before[1:], *rest]
    return ["serve", *extra, *before, *rest]
