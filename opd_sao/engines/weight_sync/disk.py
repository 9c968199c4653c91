"""`disk`: the weights as an HF checkpoint under `engine.weights_dir`, loaded by each worker's
`/update_weights_from_disk` (`model_path`, `weight_version`). The workers must read that directory;
no weight-update session (SGLang loads from disk without one)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .base import WEIGHT_SYNCS, WeightSyncMode, WeightSyncRefused, check_finite, check_incoming, untied, weight_version

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def publish_checkpoint(state_dict: dict[str, torch.Tensor], template: str | Path, out_dir: Path) -> Path:
    """An HF directory a server can load: the template's config and tokenizer files with these weights."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in Path(template).iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_FILES):
            shutil.copy2(item, tmp / item.name)
    save_file(untied(state_dict), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


@WEIGHT_SYNCS.register("disk")
class DiskSync(WeightSyncMode):
    name = "disk"
    routes = {"/update_weights_from_disk": "serve_update"}
    pauses = False  # one call, which SGLang runs whole under its update lock: no request sees a partial update

    def push(self, state_dict, version, clients, each):
        if self.settings.template is None:
            raise ValueError("this engine was built without its checkpoint, which disk weight syncs need as a template")
        path = publish_checkpoint(state_dict, self.settings.template, self.settings.weights_dir / f"v{version}")
        done = self.push_checkpoint(path, version, clients, each)
        for old in self.settings.weights_dir.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return done

    def push_checkpoint(self, path, version, clients, each):
        """Every client loads the checkpoint at `path` (a directory the workers read) as `version`."""
        payload = {"model_path": str(Path(path).resolve()), "weight_version": str(version)}
        return each(lambda c: c.weight_call("/update_weights_from_disk", payload), clients)

    def serve_update(self, body: dict, target) -> dict:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise WeightSyncRefused(f"model_path must be a directory path, got {path!r}")
        version = weight_version(body)
        state = untied(target.load_checkpoint(path))
        check_incoming(target, {k: v.shape for k, v in state.items()}, {k: v.dtype for k, v in state.items()},
                       "model_path")
        check_finite(state, "model_path")
        target.install(state, version)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
