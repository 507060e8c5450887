"""One stage of a checkpoint set rebuilt from its weights file alone, read tensor by tensor into the stage.

Only ``params.safetensors`` (and the manifest) is fetched and hashed: an export never needs the optimizer
state. The file's tensors are read straight into the stage's own parameters (snapshots/tensor_file.py), so
loading holds nothing but the stage itself.
"""

from __future__ import annotations

from pathlib import Path

from agora_client.config import ModelConfig
from agora_client.model import StageModule, build_stage
from agora_client.snapshots import SnapshotError, SnapshotStore, StoredSnapshot, read_manifest
from agora_client.snapshots.format import MANIFEST_FILE, PARAMS_FILE, verify_files
from agora_client.snapshots.tensor_file import TensorFile

from .sets import CheckpointError


def load_stage_weights(
    store: SnapshotStore, snapshot: StoredSnapshot, config: ModelConfig, seed: int, cache: Path
) -> StageModule:
    """The stage of ``snapshot`` with the checkpoint's weights (sha256 and every shape checked), in eval mode."""
    stage = snapshot.stage
    try:
        directory = store.local_dir(snapshot, cache, files=(PARAMS_FILE,))
        manifest = read_manifest(directory / MANIFEST_FILE)
        if manifest["stage"] != stage:
            raise SnapshotError(f"{directory} holds a checkpoint of stage {manifest['stage']}, not {stage}")
        verify_files(directory, {**manifest, "files": {PARAMS_FILE: manifest["files"][PARAMS_FILE]}})
        module = build_stage(config, stage, seed=seed, seeded_weights=False)  # the checkpoint sets every weight
        TensorFile(directory / PARAMS_FILE).load_into(module.state_dict())
    except SnapshotError as error:
        raise CheckpointError(f"stage {stage}, checkpoint {snapshot.name}: {error}") from None
    return module.eval()
