"""The configuration of a distanom run: pydantic models, YAML loading, `--set` overrides.

This is the only place defaults live. Every model is frozen and rejects unknown keys, so a
typo in a YAML file is an error, not a silently ignored setting. `load_config` turns any
problem into a one-line `ConfigError` naming the file and the key; `render_defaults_yaml`
writes the commented reference file `configs/default.yaml`. Nothing here imports torch.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from distanom.errors import ConfigError
from distanom.safe_yaml import YamlRefused
from distanom.safe_yaml import load as load_yaml

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_LISTEN_ADDR = re.compile(r"^[A-Za-z0-9.:-]+$")  # an IPv4/IPv6 address or a host name
MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; refuse anything absurd


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RunConfig(_Section):
    """`run:` how the run directory's run id is named."""

    name: str | None = Field(
        None,
        description="prefix of the run id (letters, digits, '.', '_', '-'); "
        "null: a timestamp alone",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str | None) -> str | None:
        if value is not None and (not _RUN_NAME.match(value) or ".." in value):
            raise ValueError(
                "must be 1-64 letters, digits, '.', '_' or '-', start with a letter or "
                "digit, and contain no '..'"
            )
        return value


class StepConfig(_Section):
    """`step:` what ends a training step (the optimizer's step() or distanom.step())."""

    source: Literal["optimizer", "manual"] = Field(
        "optimizer",
        description="what ends a step: 'optimizer' (every optimizer.step(), no change to "
        "the script) or 'manual' (only calls to distanom.step())",
    )
    optimizer: str | None = Field(
        None,
        description="class name of the optimizer whose step() ends a training step, when "
        "there are several (e.g. AdamW); null: the first optimizer that steps",
    )
    optimizer_index: int = Field(
        0,
        ge=0,
        le=1000,
        description="which of several optimizers of that class counts, in the order they "
        "first step (0: the first; 1: the second, e.g. a GAN's generator)",
    )
    phases: bool = Field(
        True,
        description="time each step's phases (data, forward, backward, optimizer) on the "
        "host and, with CUDA, the GPU, so verdicts say where a slow step's time went",
    )


class ClockConfig(_Section):
    """`clock:` how a step's duration is measured."""

    mode: Literal["auto", "adaptive", "cuda_event", "host_sync", "host"] = Field(
        "auto",
        description="how a step is timed: 'cuda_event' (a GPU event per step, read without "
        "a synchronize, decisions lag a step or two), 'adaptive' (GPU events, and the host "
        "clock while steps are under 10 ms and the GPU keeps up with the host: cheaper, "
        "but a GPU delay the host does not wait for goes unseen), 'host_sync' (the seed "
        "recipe: host clock after torch.cuda.synchronize()), 'host' (host clock only); "
        "'auto': cuda_event when the job uses CUDA, host otherwise",
    )


class DetectConfig(_Section):
    """`detect:` when a step counts as anomalous and which anomalies form one episode."""

    multiplier: float = Field(
        1.5, gt=1.0, le=1000.0, description="a step is anomalous above multiplier x median"
    )
    spread_sigmas: float = Field(
        5.0,
        ge=0.0,
        le=100.0,
        description="and above the median plus this many robust standard deviations of "
        "the window (1.4826 x its median absolute deviation): a loaded host's jitter stays "
        "under it, a 2x step on a quiet GPU does not; 0: no fence",
    )
    min_slowdown_ms: float = Field(
        2.0,
        ge=0.0,
        le=3_600_000.0,
        description="and at least this many ms over the median: on a launch-bound loop of "
        "a few ms the host's own hiccups (the OS, another thread's turn) make 1.5x steps "
        "that lose a ms or two; 0: no floor",
    )
    window_steps: int = Field(
        200, ge=5, le=100_000, description="rolling window of past steps the median is taken over"
    )
    warmup_steps: int = Field(
        10, ge=0, le=1_000_000, description="first steps never judged nor used for the median"
    )
    min_steps: int = Field(
        20, ge=3, le=100_000, description="steps the window must hold before any step is judged"
    )
    merge_gap_steps: int = Field(
        5,
        ge=0,
        le=100_000,
        description="anomalous steps at most this many steps apart are one episode (a lasting "
        "slowdown is one event with a count): its first traced step is captured, and a "
        "later one with a third more slowdown (time over the median) than its last capture",
    )


class ConsensusConfig(_Section):
    """`consensus:` the rounds in which ranks share their step times."""

    # a round's work holds the GIL a launch-bound training thread needs: rounds are paced
    # in time, not per step (docs/agent.md, "The control thread wakes per round")
    interval_ms: float = Field(
        1000.0,
        gt=0,
        le=60_000,
        description="pace of the rounds: each covers as many steps as take about this long "
        "at the median step time (at least 1, at most batch_steps)",
    )
    batch_steps: int = Field(
        128,
        ge=1,
        le=1000,
        description="at most this many steps per all-gather round of step times across "
        "ranks; a round holding a step the tracer may record ends within half of "
        "tracer.history_steps of it, so its trace is still kept when the decision about it "
        "arrives",
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        le=86_400,
        description="a round not complete after this long means a rank is gone: capture "
        "steps aside, training goes on",
    )
    setup_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="how long to wait for every rank to join distanom's group",
    )


class TracerConfig(_Section):
    """`tracer:` which backend records events, how much history it keeps, its budget."""

    backend: Literal["auto", "kineto", "cupti", "none"] = Field(
        "auto",
        description="'cupti' (NVIDIA, raw CUPTI records, lowest overhead), 'kineto' "
        "(torch.profiler, any device, CPU too), 'none' (detect only); 'auto': cupti where "
        "it works, else kineto",
    )
    history_steps: int = Field(
        32,
        ge=2,
        le=10_000,
        description="past steps whose events are kept in memory, so a step can still be "
        "captured after the (lagging) decision about it arrives",
    )
    kineto_window_steps: int = Field(
        4,
        ge=1,
        le=1000,
        description="kineto: steps per profiler cycle (each cycle ends with a flush)",
    )
    ring_mb: int = Field(
        256,
        ge=8,
        le=65_536,
        description="cupti: memory for raw activity buffers, oldest dropped first",
    )
    overhead_budget_pct: float | None = Field(
        1.0,
        gt=0,
        le=100,
        description="duty-cycle tracing so its measured overhead stays under this percent "
        "of step time; detection stays on for every step; null: trace every step except "
        "one window in 64 (its place drawn from the run id, different each period and "
        "each run), left untraced to measure the overhead; an anomaly there is counted "
        "(`anomalous_untraced`), not captured",
    )
    probe_seed: int | None = Field(
        None,
        ge=0,
        description="with overhead_budget_pct null: draws the untraced windows' places "
        "from this number instead of the run id, the same in every run (tests that "
        "place faults)",
    )


class CaptureConfig(_Section):
    """`capture:` how many traces are written, how large, and how often a reference."""

    max_captures: int = Field(
        50,
        ge=0,
        le=1_000_000,
        description="anomaly captures kept; when full, a more severe one replaces the least severe",
    )
    max_disk_mb: float = Field(
        2048.0, gt=0, le=10_000_000, description="trace bytes one rank may write in this run"
    )
    min_gap_steps: int = Field(
        0, ge=0, le=1_000_000, description="fewest steps between two anomaly captures"
    )
    reference_every_steps: int = Field(
        500,
        ge=0,
        le=10_000_000,
        description="keep a healthy reference step this often, the first as soon as a "
        "typical traced step is judged (the latest replaces the previous); 0: never",
    )
    gzip_level: int = Field(5, ge=1, le=9, description="gzip level of trace files")


class AnalysisConfig(_Section):
    """`analysis:` who computes the tables of a capture, and when."""

    engine: Literal["auto", "builtin", "tracelens"] = Field(
        "auto",
        description="who computes gpu_timeline and kernel_summary: 'tracelens' if importable "
        "under 'auto', else the built-in identical implementation",
    )
    on_capture: Literal["now", "exit", "report"] = Field(
        "exit",
        description="when each rank computes its captures' tables: 'now' (in the "
        "background, right after writing: competes with training for the GIL), 'exit' "
        "(once training ends, within exit_timeout_s), 'report' (by distanom report)",
    )
    exit_timeout_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="at the end of training, how long to wait for pending trace writes "
        "and analysis",
    )


class ControlConfig(_Section):
    """`control:` how often on-demand requests are read and live status written."""

    poll_interval_s: float = Field(
        1.0, gt=0, le=3600, description="how often rank 0 looks for on-demand capture requests"
    )
    status_interval_s: float = Field(
        2.0, gt=0, le=3600, description="how often the live status file is rewritten"
    )
    side_process: bool = Field(
        True,
        description="write this rank's steps file from a side process (python, no torch, "
        "~45 MB), off the training process's GIL; false, or when it cannot start: in the "
        "rank's own control thread",
    )


class HangConfig(_Section):
    """`hang:` when a job counts as hung, and what each rank writes then."""

    enabled: bool = Field(
        True,
        description="watch for hangs: no step ended for `after_s`, or a consensus round timed out",
    )
    after_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="a rank with no step ended for this long writes a hang record; null: "
        "median_factor x the median step time, at least floor_s",
    )
    median_factor: float = Field(
        50.0, gt=1, le=1_000_000, description="with after_s null: the limit in median steps"
    )
    floor_s: float = Field(
        120.0,
        gt=0,
        le=86_400,
        description="with after_s null: the least limit (phases without optimizer steps, "
        "such as a long evaluation, must stay under it)",
    )
    poll_s: float = Field(
        1.0, gt=0, le=600, description="how often the watch looks at the step counter"
    )
    max_frames: int = Field(
        48, ge=1, le=1000, description="innermost frames kept per thread in a hang record"
    )
    max_collectives: int = Field(
        8,
        ge=1,
        le=1000,
        description="latest Flight Recorder entries kept per process group in a hang record",
    )


class LogConfig(_Section):
    """`log:` distanom's own log level."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="distanom's own log level (stderr, prefixed [distanom rR/W])"
    )


class MetricsConfig(_Section):
    """`metrics:` live Prometheus metrics, served by local rank 0 of each node (off by
    default; needs the `metrics` extra, prometheus_client)."""

    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="TCP port of the /metrics endpoint on local rank 0 of each node; "
        "null: no metrics (docs/metrics.md)",
    )
    addr: str = Field(
        "0.0.0.0",
        min_length=1,
        max_length=253,
        description="address the endpoint listens on: all interfaces, so Prometheus on "
        "another host can scrape it; 127.0.0.1 keeps it on this host",
    )

    @field_validator("addr")
    @classmethod
    def _plain_addr(cls, value: str) -> str:
        if not _LISTEN_ADDR.match(value):
            raise ValueError(
                "must be an IP address or a host name (letters, digits, '.', '-', ':')"
            )
        return value


class Config(_Section):
    """The whole configuration: one frozen section per YAML top-level key."""

    run: RunConfig = Field(default_factory=RunConfig, description="run naming")
    step: StepConfig = Field(default_factory=StepConfig, description="what counts as a step")
    clock: ClockConfig = Field(default_factory=ClockConfig, description="step timing")
    detect: DetectConfig = Field(default_factory=DetectConfig, description="anomaly detection")
    consensus: ConsensusConfig = Field(
        default_factory=ConsensusConfig, description="cross-rank agreement"
    )
    tracer: TracerConfig = Field(default_factory=TracerConfig, description="event collection")
    capture: CaptureConfig = Field(default_factory=CaptureConfig, description="what is written")
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig, description="tables")
    control: ControlConfig = Field(
        default_factory=ControlConfig, description="on-demand capture and live status"
    )
    log: LogConfig = Field(default_factory=LogConfig, description="logging")
    hang: HangConfig = Field(default_factory=HangConfig, description="hang watch")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="live Prometheus metrics (docs/metrics.md)"
    )


def _format_validation_error(source: str, err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "(top level)"
    kind = first["type"]
    others = [".".join(str(part) for part in e["loc"]) or "(top level)" for e in err.errors()[1:]]
    more = ""
    if others:
        more = f" (also wrong: {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})"
    if kind == "extra_forbidden":
        allowed = _allowed_keys(first["loc"][:-1])
        return f"{source}: unknown key '{key}' (allowed here: {', '.join(allowed)}){more}"
    got = first.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    if isinstance(got, bool) and kind != "bool_type":  # `yes`, `no`, `on`, `off` in YAML 1.1
        shown = f" (got {got!r}: YAML reads yes/no/on/off as true/false; quote it)"
    message = _clean_message(first["msg"])
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "must be a section of keys (key: value lines), not a single value"
    return f"{source}: {key}: {message}{shown}{more}"


# pydantic prefixes the message of an error raised in a validator with its kind
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _clean_message(message: str) -> str:
    """The validator's own words, on one line: no pydantic prefix, no line breaks."""
    for prefix in _PYDANTIC_PREFIXES:
        if message.startswith(prefix):
            message = message[len(prefix) :]
            break
    return " ".join(message.split())


def _allowed_keys(loc: Sequence[Any]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            return []
        if not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return sorted(model.model_fields)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: config file is larger than {MAX_CONFIG_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected YAML)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file: {err.strerror}") from None
    try:
        data = load_yaml(text)
    except YamlRefused as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML{_where(err, text)}: {_problem(err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections (run:, detect:, ...), "
            f"got {type(data).__name__}"
        )
    return data


def _where(err: yaml.YAMLError, text: str) -> str:
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return ""
    if text[mark.index :].strip() == "":  # at the end: name the last line, not the one after
        return f" at the end of the file (line {max(1, len(text.rstrip().splitlines()))})"
    return f" at line {mark.line + 1}"


def _problem(err: yaml.YAMLError) -> str:
    problem = str(getattr(err, "problem", None) or "syntax error")
    return problem.replace("'<stream end>'", "the end of the file")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `section.key=value` into its key path and YAML-typed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. detect.multiplier=2.0")
    parts = key.strip().split(".")
    if any(not part for part in parts):
        raise ConfigError(f"--set {text!r}: malformed key {key!r}")
    try:
        value = load_yaml(raw) if raw.strip() else None
    except YamlRefused as err:
        raise ConfigError(f"--set {text!r}: {err}") from None
    except yaml.YAMLError:
        value = raw  # not YAML: take the text as a string, validation decides
    return parts, value


def _apply_override(data: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {text!r}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Build the validated config from an optional YAML file and `key=value` overrides."""
    source = str(path) if path is not None else "config"
    data: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    sets = list(overrides)
    if path is None or not sets:
        for text in sets:
            _apply_override(data, *parse_override(text), text)
        return config_from_mapping(data, "--set" if sets else source)
    # a file and --set values: an error names the file when the file alone has one
    from_file = copy.deepcopy(data)
    for text in sets:
        parts, value = parse_override(text)
        try:
            _apply_override(data, parts, value, text)
        except ConfigError:  # `--set a.b=...` where the file made `a` a value
            config_from_mapping(from_file, source)  # raises the file's own error, if any
            raise
    try:
        return config_from_mapping(data, source)
    except ConfigError:
        file_ok = _is_valid(from_file)
    return config_from_mapping(data, "--set" if file_ok else f"{source} with --set")


def _is_valid(data: Mapping[str, Any]) -> bool:
    """Whether `data` validates as a config."""
    try:
        config_from_mapping(data)
    except ConfigError:
        return False
    return True


def config_from_mapping(data: Mapping[str, Any], source: str = "config") -> Config:
    """Validate an already-parsed mapping (e.g. run.json's snapshot)."""
    try:
        config = Config.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(_format_validation_error(source, err)) from None
    budget = config.tracer.overhead_budget_pct
    if budget is not None and not math.isfinite(budget):
        raise ConfigError(f"{source}: tracer.overhead_budget_pct: must be a finite number")
    if config.detect.min_steps > config.detect.window_steps:
        raise ConfigError(
            f"{source}: detect.min_steps ({config.detect.min_steps}) must not exceed "
            f"detect.window_steps ({config.detect.window_steps})"
        )
    return config


def _yaml_scalar(value: Any) -> str:
    dumped = yaml.safe_dump(value, default_flow_style=True).strip()
    return dumped.removesuffix("...").strip()


def render_defaults_yaml() -> str:
    """The commented YAML of every key at its default (the content of configs/default.yaml)."""
    return render_config_yaml(Config())


def render_config_yaml(config: Config, *, changed_by: str | None = None) -> str:
    """The commented YAML of every key of `config` (at its defaults: configs/default.yaml;
    `changed_by` says what changed it from them, e.g. the --set values), usable as a
    --config file."""
    if changed_by is None:
        lines = [
            "# distanom configuration: every key, at its default.",
            "# Generated by `distanom config --defaults`; pass your own file with --config and",
            "# change single keys with --set section.key=value.",
        ]
    else:
        changed_by = " ".join(changed_by.split())  # one comment line, whatever was typed
        lines = [
            f"# distanom configuration: every key, with {changed_by}.",
            "# Generated by `distanom config --set ...`; pass it with --config.",
        ]
    for section_name, section_field in Config.model_fields.items():
        section = getattr(config, section_name)
        lines.append("")
        lines.append(f"{section_name}:  # {section_field.description}")
        for key, field in type(section).model_fields.items():
            value = _yaml_scalar(getattr(section, key))
            lines.append(f"  {key}: {value}  # {field.description}")
    return "\n".join(lines) + "\n"
