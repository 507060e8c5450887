"""The rehearsal's last act (bench/rehearsal.py): the newest checkpoint set exported by `agora export`, as an
operator would, then loaded by `transformers` in a process of its own and asked to continue a prompt.

The figures: the set's time and loss (the export's agora_export.json), the model's class and
parameter count, the tokens it generated and their text. A failed export or load is a figure too: its last line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from agora_client.swarm.processes import CLI

EXPORT_TIMEOUT_S = 600.0
PROMPT = "The swarm"
NEW_TOKENS = 24

# run by a fresh interpreter: what a user of the exported directory does first
_LOAD_AND_GENERATE = """
import json, sys
import torch, transformers
out, prompt, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(out)
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    generated = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
new = generated[0, ids.shape[1]:]
print(json.dumps({
    "model": type(model).__name__,
    "parameters": sum(p.numel() for p in model.parameters()),
    "new_tokens": int(new.numel()),
    "text": tokenizer.decode(generated[0]),
}))
"""


def export_card(store: Path, out: Path) -> dict:
    """Export the newest set in ``store`` to ``out`` and load it in transformers; what each step gave."""
    started = time.monotonic()
    exported = subprocess.run(
        [*CLI, "export", "--store", str(store), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=EXPORT_TIMEOUT_S,
    )
    card: dict = {"ok": False, "export_s": round(time.monotonic() - started, 1)}
    if exported.returncode != 0:
        return {**card, "error": f"agora export (exit {exported.returncode}): {_last_line(exported)}"}
    record = json.loads((out / "agora_export.json").read_text())
    card["set"] = {"at": record["at"], "loss": record["loss"], "dtype": record["dtype"]}
    loaded = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_GENERATE, str(out), PROMPT, str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=EXPORT_TIMEOUT_S,
    )
    if loaded.returncode != 0:
        return {**card, "error": f"loading in transformers (exit {loaded.returncode}): {_last_line(loaded)}"}
    generated = json.loads(loaded.stdout.strip().splitlines()[-1])
    return {**card, **generated, "ok": generated["new_tokens"] > 0}


def _last_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else "no output"
