"""Start-up to the first claim: `work` and `embed` load only what they use. Dagster, the
local model's runtime, the OpenAI SDK, the tokenizer, the progress bar and the metrics
server are imported when (and only if) a run needs them."""

from __future__ import annotations

import json
import subprocess
import sys

# Imported lazily: by a run that uses them, never by the command's start.
NOT_AT_START = ("dagster", "onnxruntime", "tokenizers", "openai", "tiktoken", "rich", "prometheus_client")


def test_the_work_and_embed_commands_start_without_what_they_may_not_use():
    probe = (
        "import json, sys\n"
        "import pipeline_assets.cli.root, pipeline_assets.cli.pipeline\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "click" in loaded and "psycopg" in loaded  # the probe did load the commands
    assert not loaded & set(NOT_AT_START), sorted(loaded & set(NOT_AT_START))
