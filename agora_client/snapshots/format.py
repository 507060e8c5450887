"""Stage snapshots on disk: safetensors for tensors, JSON for everything else, never pickles.

Layout under a snapshot root::

    <stage>/latest.json                        {"stage", "epoch", "timestamp", "manifest": "<name>/manifest.json"}
    <stage>/<epoch:08d>-<UTC time>/params.safetensors      the module's state_dict (persistent entries only)
    <stage>/<epoch:08d>-<UTC time>/optimizer.safetensors   optimizer state, keys "state.<param index>.<name>"
    <stage>/<epoch:08d>-<UTC time>/manifest.json           stage, epoch, timestamp, files {name: {sha256, size}},
                                                           optimizer class, hyperparameters, parameter names,
                                                           and the caller's extra sections (a checkpoint's run
                                                           config and training statistics)

The manifest is written last; ``store.py`` makes a snapshot appear only complete (a renamed
directory, or for S3 the manifest uploaded after the files) and replaces ``latest.json`` after it.
Readers verify every hash (but trust files a download verified as they streamed in: ``download_marks.py``)
and every name and shape before touching the module or the optimizer, then stream the files tensor by tensor.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from .download_marks import verified_by_download
from .durable import fsync_dir, fsync_file, write_json
from .errors import SnapshotError
from .tensor_file import TensorFile

FORMAT = "agora-stage-snapshot"
FORMAT_VERSION = 1
PARAMS_FILE = "params.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest.json"
_SNAPSHOT_NAME = re.compile(r"^\d{8,}-\d{8}T\d{6}\.\d{6}Z$")
_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class SnapshotInfo:
    epoch: int
    timestamp: float
    stage: str = ""
    directory: Path | None = None


def snapshot_name(epoch: int, timestamp: float) -> str:
    moment = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    return f"{epoch:08d}-{moment.strftime('%Y%m%dT%H%M%S.%f')}Z"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def snapshot_time(name: str) -> float | None:
    """The wall-clock time a snapshot directory name carries, or None if it is not a snapshot name."""
    if not _SNAPSHOT_NAME.match(name):
        return None
    moment = datetime.strptime(name.split("-", 1)[1], "%Y%m%dT%H%M%S.%fZ").replace(tzinfo=timezone.utc)
    return moment.timestamp()


@dataclass(frozen=True)
class StageState:
    """A stage's tensors as a snapshot holds them: the module's state_dict, the optimizer's flattened state
    (keys "state.<param index>.<name>") and its description for the manifest."""

    params: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    optimizer_meta: dict[str, Any]


def live_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> StageState:
    """The stage's tensors where they live, not copied: read them (or copy them) under the stage's state lock."""
    params = {key: value.detach() for key, value in module.state_dict().items()}
    tensors, meta = _flatten_optimizer(module, optimizer)
    return StageState(params, tensors, meta)


def cpu_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> StageState:
    """The stage's state as CPU tensors that share no storage, ready to write (a GPU stage's tensors are copied).

    Take it outside averaging rounds and optimizer steps, so parameters and optimizer state belong to the same step.
    """
    live = live_state(module, optimizer)
    return StageState(_cpu_tensors(live.params), _cpu_tensors(live.optimizer), live.optimizer_meta)


def write_state_files(
    directory: Path,
    stage: str,
    state: StageState,
    epoch: int,
    *,
    timestamp: float | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write params, optimizer state and the manifest (last) into the existing ``directory``; return the manifest.

    ``state`` holds contiguous CPU tensors that share no storage (``cpu_state``, or a worker's host copy);
    ``extra`` adds JSON sections to the manifest (training statistics, the run config).
    """
    timestamp = time.time() if timestamp is None else timestamp
    directory = Path(directory)
    save_file(state.params, str(directory / PARAMS_FILE))
    save_file(state.optimizer, str(directory / OPTIMIZER_FILE))
    files = {}
    for file_name in (PARAMS_FILE, OPTIMIZER_FILE):
        path = directory / file_name
        fsync_file(path)
        files[file_name] = {"sha256": file_sha256(path), "size": path.stat().st_size}
    manifest = {
        **(extra or {}),
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "stage": stage,
        "epoch": int(epoch),
        "timestamp": timestamp,
        "created": datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(),
        "files": files,
        "params": {key: list(tensor.shape) for key, tensor in state.params.items()},
        "optimizer": state.optimizer_meta,
    }
    write_json(directory / MANIFEST_FILE, manifest)
    fsync_dir(directory)
    return manifest


def load_stage_snapshot(
    directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, stage: str | None = None
) -> SnapshotInfo:
    """Verify the snapshot in ``directory`` against its manifest, then load it into module (and optimizer).

    Nothing is modified unless every file's hash (skipped for files its download verified) and every tensor's
    name and shape match; otherwise SnapshotError. The files are then read one tensor at a time, each copied
    straight into the module's tensor or the optimizer's state, so a load holds at most one tensor of the files
    beyond the stage itself. A file that fails to read midway leaves the stage partly loaded (SnapshotError).
    """
    directory = Path(directory)
    manifest = read_manifest(directory / MANIFEST_FILE)
    if stage is not None and manifest["stage"] != stage:
        raise SnapshotError(
            f"{directory} is a snapshot of stage {manifest['stage']}, not {stage}; download the {stage} snapshot"
        )
    if not verified_by_download(directory, MANIFEST_FILE, manifest["files"]):
        verify_files(directory, manifest)
    params = TensorFile(directory / PARAMS_FILE)
    targets = module.state_dict()
    params.check_fits(targets)
    optimizer_load = None
    if optimizer is not None:
        if OPTIMIZER_FILE not in manifest["files"]:
            raise SnapshotError(f"{directory} holds no optimizer state")
        optimizer_load = _OptimizerLoad(
            TensorFile(directory / OPTIMIZER_FILE), manifest.get("optimizer"), module, optimizer
        )
    params.load_into(targets)
    if optimizer_load is not None:
        with torch.no_grad():
            optimizer_load.apply()
    return SnapshotInfo(
        epoch=manifest["epoch"], timestamp=manifest["timestamp"], stage=manifest["stage"], directory=directory
    )


def verify_files(directory: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is in ``directory`` with its size and sha256, or SnapshotError naming it."""
    for file_name, expected in manifest["files"].items():
        path = Path(directory) / file_name
        if not path.is_file():
            raise SnapshotError(f"{path} is missing; download the snapshot again")
        if path.stat().st_size != expected["size"] or file_sha256(path) != expected["sha256"]:
            raise SnapshotError(
                f"{path} does not match its sha256 in the manifest (corrupted or truncated); download the "
                "snapshot again"
            )


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and check a manifest's structure; SnapshotError says what is wrong."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SnapshotError(f"no manifest at {path}: this is not a snapshot directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SnapshotError(
            f"the manifest {path} is unreadable ({type(error).__name__}); download the snapshot again"
        ) from None
    return check_manifest(manifest, str(path))


def check_manifest(manifest: Any, source: str) -> dict[str, Any]:
    problem = _manifest_problem(manifest)
    if problem:
        raise SnapshotError(f"{source} is not a valid snapshot manifest: {problem}")
    return manifest


def latest_snapshot(stage_dir: Path) -> Path | None:
    """The directory ``latest.json`` of a stage points at, or None if there is none."""
    try:
        latest = json.loads((Path(stage_dir) / LATEST_FILE).read_text(encoding="utf-8"))
        return Path(stage_dir) / Path(latest["manifest"]).parent
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- internals ----------------------------------------------------------------------------------------


def _manifest_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"its format is not {FORMAT}"
    return _header_problem(manifest) or _files_problem(manifest.get("files")) or _optimizer_problem(manifest)


def _header_problem(manifest: dict) -> str | None:
    """What is wrong with the manifest's version, stage, epoch or timestamp, if anything."""
    if manifest.get("version") != FORMAT_VERSION:
        return f"its version is {manifest.get('version')!r}, this client reads version {FORMAT_VERSION}"
    if not isinstance(manifest.get("stage"), str) or not isinstance(manifest.get("epoch"), int):
        return "stage or epoch missing"
    if not isinstance(manifest.get("timestamp"), (int, float)):
        return "timestamp missing"
    return None


def _files_problem(files: Any) -> str | None:
    """What is wrong with the manifest's file list (the parameters file listed, each entry well formed), if anything."""
    if not isinstance(files, dict) or PARAMS_FILE not in files:
        return f"no entry for {PARAMS_FILE}"
    for name, entry in files.items():
        problem = _file_entry_problem(name, entry)
        if problem:
            return problem
    return None


def _file_entry_problem(name: Any, entry: Any) -> str | None:
    # File names come from the network: only plain names, never paths.
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith("."):
        return f"file name {name!r} is not a plain file name"
    if not isinstance(entry, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256"))):
        return f"{name} has no sha256"
    if not isinstance(entry.get("size"), int) or entry["size"] < 0:
        return f"{name} has no size"
    if "url" in entry and not (isinstance(entry["url"], str) and entry["url"].startswith(("http://", "https://"))):
        return f"{name} has a url that is not http(s)"
    return None


def _optimizer_problem(manifest: dict) -> str | None:
    optimizer = manifest.get("optimizer")
    if optimizer is not None and not (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("class"), str)
        and isinstance(optimizer.get("param_groups"), list)
        and isinstance(optimizer.get("param_names"), list)
        and isinstance(optimizer.get("scalars"), dict)
    ):
        return "its optimizer section lacks class, param_groups, param_names or scalars"
    return None


def _cpu_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU tensors.

    A tensor sharing storage with an earlier one is copied (safetensors refuses shared storage)."""
    seen: set[int] = set()
    tensors = {}
    for key, value in state.items():
        tensor = value.detach()
        tensor = tensor.cpu() if tensor.device.type != "cpu" else tensor
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(pointer)
        tensors[key] = tensor.contiguous()
    return tensors


def _flatten_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer's tensors where they live (numbers become new 0-d CPU tensors) and its manifest section."""
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, str] = {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            key = f"state.{index}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach()
            elif isinstance(value, (bool, int, float)):
                # A Python scalar becomes a 0-d tensor; its type is remembered to restore it exactly.
                scalars[key] = type(value).__name__
                tensors[key] = torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
            else:
                raise SnapshotError(
                    f"optimizer state {key} is a {type(value).__name__}; only tensors and numbers can be saved"
                )
    groups = []
    for group in state_dict["param_groups"]:
        saved = {}
        for name, value in group.items():
            if isinstance(value, torch.Tensor):
                raise SnapshotError(f"optimizer hyperparameter {name} is a tensor; use a number to snapshot it")
            saved[name] = list(value) if isinstance(value, tuple) else value
        groups.append(saved)
    names = {id(parameter): name for name, parameter in module.named_parameters()}
    parameter_names = [[names.get(id(parameter)) for parameter in group["params"]] for group in optimizer.param_groups]
    meta = {
        "class": type(optimizer).__name__,
        "param_groups": groups,
        "param_names": parameter_names,
        "scalars": scalars,
    }
    return tensors, meta


class _OptimizerLoad:
    """An optimizer file checked against the optimizer (names, shapes, groups: before anything is modified),
    then streamed into the optimizer's own state tensors by ``apply``."""

    def __init__(
        self, source: TensorFile, meta: dict[str, Any] | None, module: nn.Module, optimizer: torch.optim.Optimizer
    ):
        self.source, self.optimizer, where = source, optimizer, source.path
        if meta is None or meta["class"] != type(optimizer).__name__:
            saved = meta["class"] if meta else "no"
            raise SnapshotError(f"{where} holds {saved} state but this stage uses {type(optimizer).__name__}")
        names = {id(parameter): name for name, parameter in module.named_parameters()}
        current_names = [
            [names.get(id(parameter)) for parameter in group["params"]] for group in optimizer.param_groups
        ]
        if meta["param_names"] != current_names:
            raise SnapshotError(
                f"{where} was saved for other parameters (names or order differ); it belongs to another model config"
            )
        self.parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        self.tensors: dict[str, tuple[int, str]] = {}  # file key -> (parameter index, state name)
        self.state: dict[int, dict[str, Any]] = {}
        flat_names = _flat(current_names)
        for key, (shape, dtype) in source.entries.items():
            index, name = self._place(key, shape, flat_names)
            if key in meta["scalars"]:
                value: Any = {"bool": bool, "int": int, "float": float}[meta["scalars"][key]](source.value(key))
            else:
                # Zero bytes however large: the optimizer allocates the real tensor where it keeps its state.
                value = torch.zeros((), dtype=dtype).expand(shape)
                self.tensors[key] = (index, name)
            self.state.setdefault(index, {})[name] = value
        if len(meta["param_groups"]) != len(optimizer.param_groups):
            raise SnapshotError(
                f"{where} has {len(meta['param_groups'])} parameter groups, this optimizer "
                f"{len(optimizer.param_groups)}"
            )
        self.groups = [
            {name: tuple(value) if isinstance(current.get(name), tuple) else value for name, value in saved.items()}
            for saved, current in zip(meta["param_groups"], optimizer.param_groups, strict=True)
        ]

    def _place(self, key: str, shape: tuple[int, ...], names: list[str | None]) -> tuple[int, str]:
        """The parameter index and state name of a file entry, checked against that parameter's shape."""
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() or int(parts[1]) >= len(self.parameters):
            raise SnapshotError(f"{self.source.path} holds an unexpected entry {key!r}")
        index = int(parts[1])
        if shape and shape != tuple(self.parameters[index].shape):
            raise SnapshotError(
                f"{self.source.path}: {key} has shape {shape} but parameter {index} "
                f"({names[index]}) has {tuple(self.parameters[index].shape)}"
            )
        return index, parts[2]

    def apply(self) -> None:
        """Restore the hyperparameters and the state's structure (the optimizer places and allocates its tensors),
        then copy the file into them one tensor at a time."""
        self.optimizer.load_state_dict({"state": self.state, "param_groups": self.groups})
        for key, (index, name) in self.tensors.items():
            state = self.optimizer.state[self.parameters[index]]
            target = state[name]
            if target.data_ptr() == self.state[index][name].data_ptr():  # an optimizer that kept the placeholder
                target = state[name] = torch.empty(target.shape, dtype=target.dtype, device=target.device)
            self.source.copy_into(key, target)


def _flat(names: list[list[str | None]]) -> list[str | None]:
    return [name for group in names for name in group]
